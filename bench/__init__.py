"""Benchmarks: trace replay, metrics, mode comparison."""
