"""Tests of ``agent/node/deviceplugin`` against the kubelet double."""
