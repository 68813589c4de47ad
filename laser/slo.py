"""SLO classes: loaded from a config file, scaled, and resolved per request.

The shipped file (``laser/configs/slo_classes.json``) has the paper's three classes —
``chat`` (ShareGPT: TTFT 0.25 s, TBT 0.1 s), ``code`` (HumanEval: 0.125 s, 0.05 s),
``summarization`` (LongBench: 2 s, 0.2 s) — plus ``best_effort`` (no targets).
"""

from __future__ import annotations

import json
from pathlib import Path

from .request import SLO, InvalidRequestError


class SLOClasses:
    """Named SLO classes with every target multiplied by ``scale``.

    Args:
        classes: name -> {"ttft": seconds|None, "tbt": seconds|None}.
        scale: multiplier for all targets (paper sweeps 0.8–1.3).
        default: class used when a request names none.
    Raises:
        ValueError: bad scale or default; InvalidRequestError for bad targets.
    """

    def __init__(self, classes: dict[str, dict], scale: float = 1.0, default: str = "best_effort"):
        if not scale > 0:
            raise ValueError(f"slo scale must be positive, got {scale}")
        self.scale = scale
        self.raw = {k: v for k, v in classes.items() if not k.startswith("_")}
        self.classes: dict[str, SLO] = {}
        for name, spec in self.raw.items():
            t, b = spec.get("ttft"), spec.get("tbt")
            self.classes[name] = SLO(
                ttft=None if t is None else t * scale, tbt=None if b is None else b * scale, name=name
            )
        if "best_effort" not in self.classes:
            self.classes["best_effort"] = SLO(name="best_effort")
        if default not in self.classes:
            raise ValueError(f"default SLO class {default!r} is not one of {self.names()}")
        self.default = default

    @classmethod
    def load(cls, path: str | Path | None = None, scale: float = 1.0, default: str = "best_effort") -> "SLOClasses":
        """Load from ``path`` (JSON) or the shipped file."""
        if path is None:
            text = (Path(__file__).parent / "configs" / "slo_classes.json").read_text()
        else:
            text = Path(path).read_text()
        return cls(json.loads(text), scale=scale, default=default)

    def names(self) -> list[str]:
        return sorted(self.classes)

    def get(self, name: str | None) -> SLO:
        """The SLO of class ``name`` (the default class when None). Raises InvalidRequestError if unknown."""
        name = name or self.default
        try:
            return self.classes[name]
        except KeyError:
            raise InvalidRequestError(f"unknown slo_class {name!r}; known: {', '.join(self.names())}") from None

    def resolve(self, name: str | None = None, ttft: float | None = None, tbt: float | None = None) -> SLO:
        """Class targets, overridden by explicit per-request targets (seconds)."""
        base = self.get(name)
        if ttft is None and tbt is None:
            return base
        return SLO(
            ttft=ttft if ttft is not None else base.ttft,
            tbt=tbt if tbt is not None else base.tbt,
            name=base.name if name else "custom",
        )
