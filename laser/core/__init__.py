"""Torch-free data and shared rules: requests, plans, SLOs, configs, the block manager, the
intermediate cache, metrics, the one plan walker and plan pricing. Used by the engine, the
simulator and the Ray actors alike."""
