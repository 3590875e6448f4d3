"""Training scripts shared by the benchmarks (run as separate processes)."""
