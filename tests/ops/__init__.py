"""Tests of ``agent/ops``: health, metrics, logs, GC tuning."""
