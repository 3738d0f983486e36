"""Benchmarks: python -m bench.<name>; results go to bench/out/ (curated reports: bench/reports/)."""
