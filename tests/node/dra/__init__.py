"""Tests of ``agent/node/dra`` against the DRA kubelet and scheduler doubles."""
