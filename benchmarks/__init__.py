"""Benchmark harness: ``python benchmarks/run.py [--quick] [--out FILE]``.

See docs/performance.md.
"""
