"""Helpers shared by the tests, the example and the benchmarks: a Llama-style model and rank spawning."""
