"""Benchmarks: when CUDA graphs pay in Lightning training, by how much, and against what."""
