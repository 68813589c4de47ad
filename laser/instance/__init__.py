"""The instance interface the global controller talks to (plain data in and out)."""

from .interface import Instance
from .messages import InstanceReport, LatencyIncrement, RequestInfo

__all__ = ["Instance", "InstanceReport", "LatencyIncrement", "RequestInfo"]
