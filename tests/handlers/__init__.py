"""Tests of ``discovery_handlers/`` against real peers (mosquitto, zeroconf, fake cameras,
umockdev)."""
