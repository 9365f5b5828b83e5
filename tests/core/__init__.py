"""Tests of ``agent/core``: model, store backends, ledger and slot decisions, inotify, protos."""
