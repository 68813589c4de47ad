"""Shared test helpers: run requests on one simulated instance, a fake clock, layer-boundary
replay, random JSON schemas (structured output and tool calling), fake block tables."""

from __future__ import annotations

import random

from laser.core.config import SchedulerConfig
from laser.core.plan import StepPlan, Work
from laser.core.request import Request
from laser.cluster.handles import InstanceFailure, LocalHandle
from laser.sim import SimInstance


def run_sim(policy: str, reqs: list[Request], lm, num_layers: int, max_steps: int = 2_000_000,
            config: SchedulerConfig | None = None, record_plans: bool = True, **instance_kw) -> SimInstance:
    """Submit ``reqs`` to a fresh :class:`SimInstance` of ``policy`` on ``lm`` (scheduler knobs
    ``config``, its policy replaced), run it to the end and check that it is empty and consistent
    and that every request got all its ``max_tokens`` tokens (none lost)."""
    sim = SimInstance(policy, num_layers, lm, config or SchedulerConfig(policy=policy), record_plans=record_plans,
                      **instance_kw)
    for r in reqs:
        sim.submit(r)
    sim.run(max_steps=max_steps)
    sim.check_integrity(expect_empty=True)
    assert all(r.num_output_tokens == r.sampling_params.max_tokens for r in reqs), "a request lost tokens"
    return sim


class FakeBlockTables:
    """Block tables of fake requests, the attention-metadata builder's ``bm`` interface:
    ``canon`` {request id: canonical table}, ``over`` {(request id, layer): that layer's own
    table}; block ids are ints, ``block_size`` tokens a block."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.canon: dict[str, list[int]] = {}
        self.over: dict[tuple[str, int], list[int]] = {}

    def canonical_table(self, rid):
        return self.canon[rid]

    def overridden_layers(self, rid):
        return tuple(layer for r, layer in self.over if r == rid)

    def table(self, rid, layer):
        return self.over.get((rid, layer), self.canon[rid])


def split_decode_rows(dec: list[int], works, limit: int) -> list[list[int]]:
    """A runner's decode split, played: the rows ``dec`` (indices into ``works``) in consecutive
    gather groups of at most ``limit`` padded KV positions (rows x the longest context)."""
    out: list[list[int]] = []
    for i in dec:
        if out and (len(out[-1]) + 1) * works[i].context_len <= limit:
            out[-1].append(i)
        else:
            out.append([i])
    return out


class FakeClock:
    """Advances a fixed amount per reading: deterministic 'time' for SLO decisions (seconds)."""

    def __init__(self, tick: float = 2e-4):
        self.t = 0.0
        self.tick = tick

    def __call__(self) -> float:
        self.t += self.tick
        return self.t


def replay_at_layer_boundaries(target, engines, reqs, params, start: int = 0) -> list:
    """Run ``target`` (an engine, or a DisaggregatedPair of ``engines``) until it is idle, adding
    request i of ``reqs`` -- ``(prompt ids, n, slo, at)`` -- from the engines' arrival hook at the
    ``at``-th layer boundary (counted from ``start``), mid-step as a server does, with sampling
    params ``params(n)``; while nothing runs, each idle turn counts as a boundary. Returns the
    requests in ``reqs`` order, followed through a pair's hand-off (``target.resolve``)."""
    import itertools

    pending = sorted(enumerate(reqs), key=lambda x: x[1][3])
    added: dict[int, object] = {}
    counter = itertools.count(start)

    def hook():
        c = next(counter)
        while pending and pending[0][1][3] <= c:
            i, (prompt, n, slo, _) = pending.pop(0)
            added[i] = target.add_request(list(prompt), params(n), slo)

    for e in engines:
        e.arrival_hook = hook
    try:
        while pending or target.has_unfinished():
            if not target.has_unfinished():
                hook()
                continue
            target.step()
    finally:
        for e in engines:
            e.arrival_hook = None
    resolve = getattr(target, "resolve", lambda r: r)
    return [resolve(added[i]) for i in range(len(reqs))]


def random_schema(rng, depth: int = 0) -> dict:
    """A bounded random JSON schema: an object of booleans, enums, bounded integers, short strings,
    short enum arrays and (at depth 0) one nested object; every property required."""
    props = {}
    for i in range(rng.randint(1, 3)):
        kind = rng.choice(["boolean", "enum", "integer", "string", "array"] + (["object"] if depth == 0 else []))
        if kind == "enum":
            p = {"enum": rng.sample(["red", "green", "blue", "a b", "x\"y", "é"], rng.randint(1, 3))}
        elif kind == "integer":
            lo = rng.randint(-50, 50)
            p = {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 60)}
        elif kind == "string":
            p = {"type": "string", "maxLength": rng.randint(0, 4)}
        elif kind == "array":
            p = {"type": "array", "items": {"enum": ["u", "v"]}, "maxItems": rng.randint(0, 3)}
        elif kind == "object":
            p = random_schema(rng, depth + 1)
        else:
            p = {"type": "boolean"}
        props[f"k{i}"] = p
    return {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False}


def random_prompts(n: int, seed: int) -> list[list[int]]:
    """``n`` prompts of random token ids (3..499), 4..59 tokens each, drawn from ``seed``."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(4, 60))] for _ in range(n)]


class DiesMidStream(LocalHandle):
    """A decode instance that dies at its 4th step with token events while ``deaths_left[0]`` > 0
    (shared by the decode instances: the next one holding a stream dies)."""

    deaths_left = [0]
    tokens = 0

    def call(self, method, *args, timeout=None):
        out = super().call(method, *args, timeout=timeout)
        if method == "step" and out["events"]:
            self.tokens += 1
            if self.tokens >= 4 and self.deaths_left[0] > 0:
                self.deaths_left[0] -= 1
                self.kill()
                raise InstanceFailure(self.instance_id, "killed mid-stream")
        return out


def random_plan(rng: random.Random, n: int, sample_p: float = 1.0) -> StepPlan:
    """A random step plan over ``n`` layers: 1-6 works over random layer ranges (most from layer 0
    to the last), decode rows (one token past a cached context) or prefill chunks of 1-64 tokens; a
    work that reaches the last layer samples with probability ``sample_p``."""
    works = []
    for i in range(rng.randint(1, 6)):
        lo = rng.choice([0, 0, rng.randint(0, n - 1)])
        hi = rng.choice([n, n, rng.randint(lo + 1, n)])
        start = rng.randint(0, 300)
        q = 1 if rng.random() < 0.5 and start > 0 else rng.randint(1, 64)
        works.append(Work(f"w{i}", start, q, lo, hi, sample=hi == n and (sample_p >= 1.0 or rng.random() < sample_p)))
    return StepPlan(n, works)
