"""Benchmarks for implicitdiff (run as scripts or with `python -m benchmarks.<name>`)."""
