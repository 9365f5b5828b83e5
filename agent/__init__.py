"""Akri-compatible device discovery agent."""

# The one version string `akri --version` prints without importlib.metadata (which scans every
# installed distribution: 14-56 ms per command); tests/ops/test_startup_cost.py checks that it
# equals pyproject.toml's [project] version.
__version__ = "0.1.0"
