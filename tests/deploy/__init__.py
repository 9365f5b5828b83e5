"""Tests of what an operator applies and runs: crds/, deploy/, examples, the README's commands."""
