"""Experiments: configs, harnesses and benchmarks that drive glmc and the Flower apps."""
