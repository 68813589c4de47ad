"""SLO classes: loaded from a config file, scaled, and resolved per request.

The shipped file (``laser/configs/slo_classes.json``) has the paper's three classes —
``chat`` (ShareGPT: TTFT 0.25 s, TBT 0.1 s), ``code`` (HumanEval: 0.125 s, 0.05 s),
``summarization`` (LongBench: 2 s, 0.2 s) — plus ``batch`` (cold: the job deadline of a Batch
API job is its only target) and ``best_effort`` (no targets).

Tiers (issue 14): **hot** classes (``chat``, ``code``) have per-request TTFT/TBT targets; **warm**
(``summarization``) relaxed per-request targets; **cold** (``batch``) a job deadline; ``best_effort``
none. A hot request is *demotable* when its class says so (``"demotable": true``) or the request
asks (``slo_demotable``); under predicted pressure it is served as its class's ``demote_to`` (a
warm class; default: the first warm class) — see :meth:`laser.frontend.async_engine.AsyncEngine.admit`.
"""

from __future__ import annotations

import json
from pathlib import Path

from .depth import DynamicDepth
from .request import SLO, InvalidRequestError

TIERS = ("hot", "warm", "cold", "best_effort")


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
        self.demote_to: dict[str, str] = {}  # hot class -> the warm class it is demoted to
        # class -> the dynamic depth its requests get (config entry "dynamic_depth": true or
        # {"threshold": .., "min_depth": ..}; laser.core.depth): lossy early exit, opted in per class
        self.dynamic_depth: dict[str, DynamicDepth] = {}
        for name, spec in self.raw.items():
            t, b = spec.get("ttft"), spec.get("tbt")
            tier = spec.get("tier") or ("best_effort" if t is None and b is None else "hot")
            if tier not in TIERS:
                raise ValueError(f"SLO class {name!r}: tier must be one of {TIERS}, got {tier!r}")
            try:
                dd = DynamicDepth.parse(spec.get("dynamic_depth"), f"SLO class {name!r}: dynamic_depth")
            except InvalidRequestError as e:
                raise ValueError(str(e)) from None
            if dd is not None:
                self.dynamic_depth[name] = dd
            self.classes[name] = SLO(
                ttft=None if t is None else t * scale, tbt=None if b is None else b * scale, name=name,
                tier=tier, demotable=bool(spec.get("demotable", False)),
            )
        if "best_effort" not in self.classes:
            self.classes["best_effort"] = SLO(name="best_effort", tier="best_effort")
        if default not in self.classes:
            raise ValueError(f"default SLO class {default!r} is not one of {self.names()}")
        self.default = default
        warm = sorted(n for n, c in self.classes.items() if c.tier == "warm")
        for name, spec in self.raw.items():
            if self.classes[name].tier != "hot":
                continue
            to = spec.get("demote_to") or (warm[0] if warm else None)
            if to is not None and (to not in self.classes or self.classes[to].tier != "warm"):
                raise ValueError(f"SLO class {name!r}: demote_to must name a warm class, got {to!r}")
            if to is not None:
                self.demote_to[name] = to

    @classmethod
    def load(cls, path: str | Path | None = None, scale: float = 1.0, default: str = "best_effort") -> "SLOClasses":
        """Load from ``path`` (JSON) or the shipped file. Raises ValueError (naming the file) when
        it cannot be read, is not JSON or is not a JSON object, and for invalid classes."""
        if path is None:
            return cls(json.loads((Path(__file__).parent.parent / "configs" / "slo_classes.json").read_text()),
                       scale=scale, default=default)
        try:
            spec = json.loads(Path(path).read_text())
        except OSError as e:
            raise ValueError(f"--slo-config {str(path)!r}: cannot read it ({e.strerror or e})") from None
        except ValueError as e:
            raise ValueError(f"--slo-config {str(path)!r}: not JSON ({e})") from None
        if not isinstance(spec, dict):
            raise ValueError(f"--slo-config {str(path)!r}: want a JSON object of SLO classes, got "
                             f"{type(spec).__name__}")
        return cls(spec, scale=scale, default=default)

    def names(self) -> list[str]:
        return sorted(self.classes)

    def get(self, name: str | None) -> SLO:
        """The SLO of class ``name`` (the default class when None). Raises InvalidRequestError if
        unknown, or when ``name`` is not a string (e.g. a dict of targets: pass an ``SLO``)."""
        if name is not None and not isinstance(name, str):
            raise InvalidRequestError(f"slo must be an SLO class name (or an SLO, or None), got {type(name).__name__}: "
                                      f"{name!r:.80}")
        name = name or self.default
        try:
            return self.classes[name]
        except KeyError:
            raise InvalidRequestError(f"unknown slo_class {name!r}; known: {', '.join(self.names())}") from None

    def names_of_tier(self, tier: str) -> list[str]:
        return sorted(n for n, c in self.classes.items() if c.tier == tier)

    def resolve(self, name: str | None = None, ttft: float | None = None, tbt: float | None = None,
                demotable: bool | None = None) -> SLO:
        """Class targets, overridden by explicit per-request targets (seconds) and demotability.

        Targets on a ``best_effort``-tier class (the default class, when none is named) make the
        request ``hot``: it has per-request targets, and must be treated as the class with the
        same targets is, by every route (issue 28: ``ttft_slo_ms``/``tbt_slo_ms`` alone were
        served as best-effort tier, which batch work does not yield to).

        Raises InvalidRequestError for an unknown class, or ``demotable`` on a class that is not hot.
        """
        base = self.get(name)
        if demotable and base.tier != "hot":
            raise InvalidRequestError(f"slo_demotable: only hot classes may be demoted; {base.name!r} is {base.tier}")
        if ttft is None and tbt is None and (demotable is None or demotable == base.demotable):
            return base
        return SLO(
            ttft=ttft if ttft is not None else base.ttft,
            tbt=tbt if tbt is not None else base.tbt,
            name=base.name if name or (ttft is None and tbt is None) else "custom",
            tier="hot" if base.tier == "best_effort" and (ttft is not None or tbt is not None) else base.tier,
            demotable=base.demotable if demotable is None else bool(demotable),
        )

    def demotion_target(self, slo: SLO) -> SLO | None:
        """The warm SLO a demotable hot request of ``slo``'s class is served as (None: none)."""
        if not slo.demotable or slo.tier != "hot":
            return None
        to = self.demote_to.get(slo.name) or next(iter(self.names_of_tier("warm")), None)
        return None if to is None else self.classes[to]

    def looser_than(self, slo: SLO) -> list[SLO]:
        """The hot and warm classes with a TTFT target looser than ``slo``'s (seconds), strictest
        first (ties by name): where ``--on-infeasible demote`` looks for a class to serve a
        request whose own target is predicted missed (every class when ``slo`` has no target)."""
        return sorted((c for c in self.classes.values() if c.tier in ("hot", "warm") and c.ttft is not None
                       and (slo.ttft is None or c.ttft > slo.ttft)), key=lambda c: (c.ttft, c.name))
