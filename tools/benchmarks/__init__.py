"""Benchmarks, each runnable as `python -m tools.benchmarks.NAME [--quick]`."""
