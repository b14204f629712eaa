"""Benchmarks: what the fault tolerance costs and what it saves, each as a ratio against its limit."""
