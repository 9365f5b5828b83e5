"""Akri-compatible device discovery agent."""
