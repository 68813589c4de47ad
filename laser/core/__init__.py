"""Torch-free core shared by the engine, the simulator and (next) Ray actors."""
