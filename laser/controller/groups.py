"""Instance groups by TBT target (PPoPP'26 §7.2.2).

One virtual group per TBT target; decode instances are split in proportion to
``n_g = λ_g / μ_g``: λ_g the arrival rate of that target (EWMA over ``window_s``), μ_g one
instance's throughput in requests/s at the largest batch its latency model keeps under
the target (CONTROLLER.md A7: ``μ_g = B_g / (T_iter(B_g, c̄_g) · ō_g)``). Largest-remainder
rounding, at least one instance per non-empty group while there are enough instances;
groups only steer assignment, so resizing never moves a running request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..scheduler.util import largest


@dataclass
class Group:
    tbt: float  # seconds (inf: best effort)
    members: list[int] = field(default_factory=list)  # decode instance ids
    rate: float = 0.0  # λ_g, req/s (EWMA)
    mean_context: float = 512.0  # c̄_g, tokens (EWMA of prompt + half the output)
    mean_output: float = 128.0  # ō_g, tokens


def largest_remainder(weights: list[float], total: int, min_one: list[bool] | None = None) -> list[int]:
    """Split ``total`` integers in proportion to ``weights`` (largest-remainder method);
    entries flagged in ``min_one`` get at least one when ``total`` allows it. Sums to
    ``total``. Equal split when every weight is 0."""
    k = len(weights)
    if k == 0:
        return []
    min_one = min_one or [False] * k
    need = [i for i in range(k) if min_one[i]]
    base = [0] * k
    if len(need) <= total:
        for i in need:
            base[i] = 1
    left = total - sum(base)
    w = list(weights) if sum(weights) > 0 else [1.0] * k
    s = sum(w)
    quotas = [left * x / s for x in w]
    counts = [math.floor(q) for q in quotas]
    rest = left - sum(counts)
    order = sorted(range(k), key=lambda i: (-(quotas[i] - counts[i]), -w[i], i))
    for i in order[:rest]:
        counts[i] += 1
    return [b + c for b, c in zip(base, counts)]


class GroupManager:
    """Groups of decode instances by TBT target, re-sized every ``interval_s``.

    Args:
        instance_ids: decode instance ids. latency_model: a decode instance's model (for μ_g).
        num_blocks / block_size: its KV pool (caps the batch). window_s: λ EWMA time constant.
        interval_s: re-size period. margin: plan iterations to this fraction of a target.
    """

    def __init__(self, instance_ids: list[int], latency_model, num_blocks: int, block_size: int,
                 tbt_targets: list[float] = (), window_s: float = 30.0, interval_s: float = 10.0,
                 margin: float = 0.9):
        self.ids = list(instance_ids)
        self.lm = latency_model
        self.pool_tokens = num_blocks * block_size
        self.window_s, self.interval_s, self.margin = window_s, interval_s, margin
        self.groups: dict[float, Group] = {}
        self.last_t: float | None = None
        self.last_resize = -math.inf
        self.resizes = 0
        for t in tbt_targets:
            self.groups.setdefault(t, Group(t))
        self.resize(0.0)

    # -- rates ------------------------------------------------------------------------------
    def observe(self, tbt: float, context: float, now: float) -> None:
        """An arrival of a request with TBT target ``tbt`` (s) and ``context`` tokens."""
        new = tbt not in self.groups
        g = self.groups.setdefault(tbt, Group(tbt))
        self._decay(now)
        g.rate += 1.0 / self.window_s
        g.mean_context = 0.95 * g.mean_context + 0.05 * context
        if new or now - self.last_resize >= self.interval_s:
            self.resize(now)

    def set_output(self, tbt: float, mean_output: float) -> None:
        if tbt in self.groups:
            self.groups[tbt].mean_output = mean_output

    def _decay(self, now: float) -> None:
        if self.last_t is not None and now > self.last_t:
            f = math.exp(-(now - self.last_t) / self.window_s)
            for g in self.groups.values():
                g.rate *= f
        self.last_t = now if self.last_t is None else max(self.last_t, now)

    # -- sizing -----------------------------------------------------------------------------
    def max_batch(self, tbt: float, context: float, output: float) -> int:
        """B_g: the largest decode batch whose predicted iteration stays within
        ``margin · tbt`` and whose KV fits the pool (at least 1)."""
        if math.isinf(tbt):
            return max(1, int(self.pool_tokens // max(1.0, context + output)))
        c = max(1, round(context))
        limit = max(1, int(self.pool_tokens // max(1.0, context + output)))

        def ok(b: int) -> bool:
            return self.lm.predict_decode_iteration([c] * b) <= self.margin * tbt

        return largest(1, min(limit, 4096), ok) or 1

    def throughput(self, g: Group) -> float:
        """μ_g, requests/s one instance finishes at its largest SLO-compliant batch."""
        b = self.max_batch(g.tbt, g.mean_context, g.mean_output)
        it = self.lm.predict_decode_iteration([max(1, round(g.mean_context))] * b)
        return b / max(1e-9, it * max(1.0, g.mean_output))

    def demand(self) -> dict[float, float]:
        """n_g = λ_g / μ_g per group (instances)."""
        return {t: g.rate / self.throughput(g) for t, g in self.groups.items()}

    def resize(self, now: float) -> None:
        """Re-split the instances ∝ n_g (largest remainder), keeping members where possible."""
        self.last_resize = now
        self.resizes += 1
        keys = sorted(self.groups)
        if not keys:
            return
        dem = self.demand()
        counts = largest_remainder([dem[k] for k in keys], len(self.ids), [self.groups[k].rate > 0 for k in keys])
        free = [i for i in self.ids if not any(i in self.groups[k].members for k in keys)]
        for k, c in zip(keys, counts):
            g = self.groups[k]
            while len(g.members) > c:
                free.append(g.members.pop())
        for k, c in zip(keys, counts):
            g = self.groups[k]
            while len(g.members) < c:
                g.members.append(free.pop(0))

    def ordered(self, tbt: float) -> list[Group]:
        """Groups nearest ``tbt`` first (|TBT_g − TBT_r|, ties: the stricter group)."""
        return sorted(self.groups.values(), key=lambda g: (abs(g.tbt - tbt) if not (math.isinf(g.tbt) and math.isinf(tbt)) else 0.0, g.tbt))

    def group_of(self, instance_id: int) -> float | None:
        for t, g in self.groups.items():
            if instance_id in g.members:
                return t
        return None
