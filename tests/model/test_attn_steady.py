"""A steady decode batch's metadata derived from the previous step's (laser.model.attn_steady)
equals the full builder's bit for bit -- values, dtypes, shapes, strides -- over random step
sequences: rows joining (some on a cached prefix: blocks shared with another request), leaving,
pausing a step, crossing block boundaries, steps with prefill chunks, per-layer block tables,
a block of the context replaced (trimmed and regrown), a request id reused, several gather groups."""

from __future__ import annotations

import random

import pytest
import torch

import laser.model.attn_steady as steady_mod
from laser.core.plan import Work
from laser.model.attn_metadata import build_attn_metadata
from laser.model.attn_steady import SteadyDecode
from simutil import FakeBlockTables, split_decode_rows

BS = 4  # block size
LAYERS = 4


class Blocks(FakeBlockTables):
    """Growing block tables of fake requests (the builder's ``bm`` interface)."""

    def __init__(self, rng: random.Random):
        super().__init__(BS)
        self.rng, self.next_id = rng, 1

    def fresh(self, n: int) -> list[int]:
        out = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        return out

    def cover(self, rid: str, num_tokens: int) -> None:
        """Grow ``rid``'s table (and its overrides) to cover ``num_tokens``, sometimes a spare block."""
        t = self.canon.setdefault(rid, [])
        need = -(-num_tokens // BS) + (self.rng.random() < 0.1)
        if len(t) < need:
            t.extend(self.fresh(need - len(t)))
        for (r, _), ov in self.over.items():
            if r == rid and len(ov) < len(t):
                ov.extend(self.fresh(len(t) - len(ov)))


def same(a, b) -> bool:
    """Bit-equal tensors (dtype, shape, strides, values; floats compared as bits), or equal others."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        if not (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and a.stride() == b.stride()):
            return False
        bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}.get(a.dtype)
        if bits is not None:
            a, b = a.view(bits), b.view(bits)
        return torch.equal(a, b)
    return a == b


def assert_same(got, want) -> None:
    for field in ("cos", "sin", "slot_mapping", "layer_slot_mapping"):
        assert same(getattr(got, field), getattr(want, field)), field
    assert len(got.groups) == len(want.groups)
    for g, w in zip(got.groups, want.groups):
        for field in ("q_index", "kv_index", "mask", "out_valid", "out_rows", "layer_kv_index", "causal",
                      "q_start", "chunks"):
            assert same(getattr(g, field), getattr(w, field)), field


class Sim:
    """Random decode steps: ``pos[rid]`` is the next decode token's position."""

    def __init__(self, rng: random.Random):
        self.rng, self.bm, self.pos, self.serial = rng, Blocks(rng), {}, 0

    def join(self) -> None:
        rid = f"r{self.serial}"
        self.serial += 1
        p = self.rng.randint(0, 40)
        others = [r for r in self.pos if len(self.bm.canon.get(r, ())) * BS > p]
        if others and self.rng.random() < 0.4:  # a prefix-cache hit: the other's leading blocks
            self.bm.canon[rid] = list(self.bm.canon[self.rng.choice(others)][: p // BS])
        self.pos[rid] = p

    def events(self) -> set[str]:
        """Changes before a step; returns the rows paused for it."""
        rng, bm = self.rng, self.bm
        if bm.over and rng.random() < 0.2:  # the layers' own blocks released again
            bm.over.clear()
        if rng.random() < 0.8:
            return set()
        kind = rng.choice(["join", "leave", "pause", "override", "replace", "reuse"])
        rids = list(self.pos)
        if kind == "join" or not rids:
            self.join()
        elif kind == "leave":
            del self.pos[rng.choice(rids)]
        elif kind == "pause":
            return {rng.choice(rids)}
        elif kind == "override":
            rid = rng.choice(rids)
            bm.over[(rid, rng.randrange(LAYERS))] = bm.fresh(len(bm.canon.get(rid, [])))
        elif kind == "replace" and any(bm.canon.get(r) for r in rids):  # trimmed and regrown
            t = bm.canon[rng.choice([r for r in rids if bm.canon.get(r)])]
            t[rng.randrange(len(t))] = bm.fresh(1)[0]
        elif kind == "reuse":  # the id of a request that left, on other blocks, one token on
            rid = rng.choice(rids)
            bm.canon[rid] = bm.fresh(len(bm.canon.get(rid, [])))
        return set()

    def active(self, paused: set[str]) -> list[Work]:
        dec = sorted((r for r in self.pos if r not in paused), key=lambda r: self.pos[r])
        for r in dec:
            self.bm.cover(r, self.pos[r] + 1)
        return [Work(r, self.pos[r], 1, 0, LAYERS) for r in dec]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("seed", range(12))
def test_derived_metadata_equals_the_builders(seed, dtype, monkeypatch):
    rng = random.Random(seed)
    sim, state = Sim(rng), SteadyDecode()
    for _ in range(rng.randint(1, 6)):
        sim.join()
    cos, sin = torch.randn(512, 8), torch.randn(512, 8)
    limit = rng.choice([10 ** 6, 96])  # one decode group, or several
    built = []
    monkeypatch.setattr(steady_mod, "build_attn_metadata",
                        lambda *a, **k: built.append(1) or build_attn_metadata(*a, **k))
    steps = 150
    for step in range(steps):
        active = sim.active(sim.events())
        if not active:
            sim.join()
            continue

        def split(dec, active=active):  # consecutive groups of at most `limit` padded positions
            return split_decode_rows(dec, active, limit)

        layers = range(0, LAYERS) if step % 5 else range(1, 3)
        memo = {} if rng.random() < 0.5 else None
        got = state.build(active, layers, sim.bm, (cos, sin), dtype, 3, split, memo)
        assert_same(got, build_attn_metadata(active, layers, sim.bm, (cos, sin), dtype, 3, split))
        if rng.random() < 0.2:  # the same step's next composition: a prefill chunk joins
            mixed = active + [Work("pf", rng.randint(0, 20), rng.randint(2, 9), 0, LAYERS)]
            sim.bm.cover("pf", mixed[-1].context_len)
            got = state.build(mixed, layers, sim.bm, (cos, sin), dtype, 3, split, memo, prefill_masks=False)
            assert_same(got, build_attn_metadata(mixed, layers, sim.bm, (cos, sin), dtype, 3, split,
                                                 prefill_masks=False))
            del sim.bm.canon["pf"]
        for w in active:
            sim.pos[w.req_id] += 1
    assert len(built) < steps * 0.7  # most steps were derived, not built



def trimmed(meta):
    """``meta`` with its in-place groups cut to their context columns (the builder's layout)."""
    meta.groups = [g.trimmed() if g.cols is not None else g for g in meta.groups]
    return meta


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("seed", range(8))
def test_in_place_derivation_equals_the_builders(seed, dtype, monkeypatch):
    """In place (a runner whose decode groups run the C++ kernel; bf16 or fp32 masks and rope
    rows), a steady group's [B, L] tensors hold the builder's [B, C] in their first ``cols``
    columns (slot 0 and -inf after them), the slot mapping and rope rows are the builder's, and
    most steps make no new tensor."""
    rng = random.Random(seed)
    sim, state = Sim(rng), SteadyDecode(in_place=True, dtype=dtype)
    if not state.in_place:
        pytest.skip("no C++ compiler")
    for _ in range(rng.randint(1, 6)):
        sim.join()
    cos, sin = torch.randn(512, 8).to(dtype), torch.randn(512, 8).to(dtype)
    limit = rng.choice([10 ** 6, 96])
    built, same_ptr = [], 0
    monkeypatch.setattr(steady_mod, "build_attn_metadata",
                        lambda *a, **k: built.append(1) or build_attn_metadata(*a, **k))
    steps, last = 150, []
    for step in range(steps):
        active = sim.active(sim.events())
        if not active:
            sim.join()
            continue

        def split(dec, active=active):
            return split_decode_rows(dec, active, limit)

        layers = range(0, LAYERS) if step % 5 else range(1, 3)
        got = state.build(active, layers, sim.bm, (cos, sin), dtype, 3, split, {})
        ptrs = [g.kv_index.data_ptr() for g in got.groups]
        same_ptr += ptrs == last
        last = ptrs
        for g in got.groups:
            if g.cols is not None:
                assert (g.kv_index[:, g.cols:] == 0).all() and (g.mask[..., g.cols:] == float("-inf")).all()
        assert_same(trimmed(got), build_attn_metadata(active, layers, sim.bm, (cos, sin), dtype, 3, split))
        for w in active:
            sim.pos[w.req_id] += 1
    assert len(built) < steps * 0.7 and same_ptr > steps * 0.2  # mostly derived, often in place


def test_in_place_builds_batches_of_another_dtype():
    """fp32 batches of a state made for bf16 are built, never derived in place (its C++ helper
    writes bf16 bits)."""
    state = SteadyDecode(in_place=True)
    if not state.in_place:
        pytest.skip("no C++ compiler")
    sim = Sim(random.Random(1))
    sim.join()
    cos, sin = torch.randn(512, 8), torch.randn(512, 8)
    split = lambda dec: [dec]  # noqa: E731
    for _ in range(3):
        active = sim.active(set())
        got = state.build(active, range(LAYERS), sim.bm, (cos, sin), torch.float32, 3, split)
        assert all(g.cols is None for g in got.groups)
        for w in active:
            sim.pos[w.req_id] += 1
