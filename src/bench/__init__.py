"""Benchmark harness: headrace's server-side workflows against client-side baselines on the same daemon."""
