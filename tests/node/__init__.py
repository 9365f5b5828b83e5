"""Tests of ``agent/node``: discovery, settings, status, the local agent, slot safety."""
