"""Benchmarks: `python -m tests.bench [names...]` (run by `make bench`, not by `make test`)."""
