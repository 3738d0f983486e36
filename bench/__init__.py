"""Benchmarks: python -m bench.<name>; results go to bench/results/."""
