"""Unit tests of the benchmarks' pure parts (the goodput simulator's math)."""
