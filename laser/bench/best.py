"""``<policy>:best``: the best-tuned baseline, found on the workload at hand.

A budgeted policy (Sarathi-Serve's chunked prefill, vLLM's scheduler: every policy whose
``max_num_batched_tokens`` shapes its iterations) is only as good as its token budget,
and the best budget depends on the hardware's prefill/decode cost ratio, the mix and the
SLOs. ``sarathi:best`` therefore runs one candidate target per budget in
:data:`DEFAULT_BEST_BUDGETS` (label ``sarathi:best@<budget>``) through the same goodput
search as everything else (:func:`laser.bench.goodput.search_goodput`), and reports the
candidate with the highest goodput under the label ``sarathi:best``, with the budget it
chose and every candidate's goodput (:class:`BudgetSweep`). A lead is then stated
against the best baseline, which includes this one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from laser.bench.goodput import GoodputResult

DEFAULT_BEST_BUDGETS = (16, 32, 64, 128, 256, 512, 1024)
# The policy whose ``:best`` is added to a comparison with Laser when none is given.
DEFAULT_BEST_BASELINE = "sarathi:best"

Spec = tuple[str, str, "int | str | None"]  # (label, policy, token budget / "auto" / "best" / None)


def candidate_label(label: str, budget: int) -> str:
    """Label of one budget candidate of ``label`` (e.g. ``sarathi:best@128``)."""
    return f"{label}@{budget}"


def parse_budgets(s: str) -> tuple[int, ...]:
    """``"16,64,256"`` -> (16, 64, 256). Raises ValueError on a non-positive or non-integer entry."""
    try:
        out = tuple(sorted({int(x) for x in s.split(",") if x.strip()}))
    except ValueError:
        raise ValueError(f"bad token budget list {s!r}: want integers like 16,64,256") from None
    if not out or out[0] < 1:
        raise ValueError(f"bad token budget list {s!r}: want at least one budget, each >= 1")
    return out


def expand_best(specs: Sequence[Spec], budgets: Sequence[int] = DEFAULT_BEST_BUDGETS
                ) -> tuple[list[Spec], dict[str, list[tuple[str, int]]]]:
    """Replace every ``(label, policy, "best")`` spec by one spec per budget.

    Returns (expanded specs, groups): ``groups[label]`` = [(candidate label, budget), ...].
    """
    out: list[Spec] = []
    groups: dict[str, list[tuple[str, int]]] = {}
    for label, policy, b in specs:
        if b == "best":
            groups[label] = [(candidate_label(label, k), int(k)) for k in budgets]
            out.extend((c, policy, k) for c, k in groups[label])
        else:
            out.append((label, policy, b))
    return out, groups


@dataclass
class BudgetSweep:
    """What ``<policy>:best`` found: every candidate budget's goodput and the best one."""

    label: str
    best_budget: int
    best_candidate: str
    results: dict[int, GoodputResult]

    def to_json(self) -> dict:
        return {"best_budget": self.best_budget,
                "goodput_rps_by_budget": {str(k): g.goodput_rps for k, g in self.results.items()},
                "display_by_budget": {str(k): g.display() for k, g in self.results.items()}}

    def format(self) -> str:
        cells = ", ".join(f"{k}: {g.display()}" + (" *" if k == self.best_budget else "")
                          for k, g in self.results.items())
        return f"{self.label} token budget sweep (goodput req/s; * = best): {cells}"


def pick_best(results: dict[str, GoodputResult], group: Sequence[tuple[str, int]]) -> tuple[str, int]:
    """The candidate (label, budget) with the highest goodput; ties go to the smaller budget."""
    return max(group, key=lambda cb: (results[cb[0]].goodput_rps, -cb[1]))


def resolve_best(results: dict[str, GoodputResult], groups: dict[str, list[tuple[str, int]]],
                 order: Sequence[str]) -> tuple[dict[str, GoodputResult], dict[str, BudgetSweep]]:
    """Fold each group's candidates into one result under the group's label.

    ``order``: the labels to return, in order (the user's policy list). The best
    candidate's result and probes are relabelled with the group's label.
    """
    sweeps = {}
    out = {}
    for label in order:
        if label not in groups:
            out[label] = results[label]
            continue
        cand, budget = pick_best(results, groups[label])
        g = results[cand]
        probes = [dataclasses.replace(p, label=label) for p in g.probes]
        out[label] = dataclasses.replace(g, label=label, probes=probes)
        sweeps[label] = BudgetSweep(label, budget, cand, {k: results[c] for c, k in groups[label]})
    return out, sweeps
