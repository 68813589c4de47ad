"""Global controllers (PPoPP'26 §7) and baselines, registered by name. Torch-free."""

from .base import CONTROLLERS, Controller, Route, get_controller, register
from . import baselines, laser  # noqa: F401  (registers the policies)

__all__ = ["CONTROLLERS", "Controller", "Route", "get_controller", "register"]
