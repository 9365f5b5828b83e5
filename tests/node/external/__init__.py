"""Tests of ``agent/node/external``: Akri's v0 discovery protocol, both directions."""
