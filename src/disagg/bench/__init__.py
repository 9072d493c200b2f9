"""Benchmark harness: seeded workloads, open-loop rate sweeps and goodput reports."""
