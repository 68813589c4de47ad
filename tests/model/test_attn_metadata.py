"""The attention metadata builder (laser.model.attn_metadata) gives exactly the tensors of the
plain torch formulation (the runner's builder before it moved to numpy), on random batch
compositions: decode rows split in gather groups, padded and unpadded prefill chunks, a lone
causal prefill, per-layer block tables that differ from the canonical ones, fp32 and bf16 masks."""

from __future__ import annotations

import random

import pytest
import torch

from laser.core.plan import Work
from laser.model.attn_metadata import build_attn_metadata
from simutil import FakeBlockTables, split_decode_rows

BS = 4  # block size


class Tables(FakeBlockTables):
    """Block tables of fake requests: canonical ones, plus overrides at some layers."""

    def __init__(self, rng: random.Random, works: list[Work], num_layers: int):
        super().__init__(BS)
        free = list(range(1, 4096))
        rng.shuffle(free)
        for w in works:
            n = -(-w.context_len // BS) + rng.randint(0, 2)  # tables may hold spare blocks
            self.canon[w.req_id] = [free.pop() for _ in range(n)]
            if rng.random() < 0.3:
                layer = rng.randrange(num_layers)
                self.over[(w.req_id, layer)] = [free.pop() for _ in range(n)]


def reference(active, layers, bm, cos_t, sin_t, dtype, g, split):
    """The torch formulation, written out plainly: one small tensor op per index."""
    bs = bm.block_size
    rows, r = [], 0
    for w in active:
        rows.append((r, r + w.num_tokens))
        r += w.num_tokens
    pos = torch.cat([torch.arange(w.token_start, w.context_len) for w in active])
    over = sorted({l for w in active for l in bm.overridden_layers(w.req_id) if l in layers})
    dec = [i for i, w in enumerate(active) if w.num_tokens == 1]
    pf = [i for i, w in enumerate(active) if w.num_tokens > 1]

    def tables(layer):
        return [bm.canonical_table(w.req_id) if layer is None else bm.table(w.req_id, layer) for w in active]

    def additive(allowed):
        return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))

    def kv_indices(tbls, idxs):
        ctx = torch.tensor([active[i].context_len for i in idxs])
        C = int(ctx.max())
        nb = -(-C // bs)
        tbl = torch.tensor([(tbls[i] + [0] * nb)[:nb] for i in idxs], dtype=torch.long)
        p = torch.arange(C)
        valid = p[None, :] < ctx[:, None]
        return torch.where(valid, tbl[:, p // bs] * bs + p % bs, 0), valid

    def slot_map(tbls):
        out = []
        for w, t in zip(active, tbls):
            p = torch.arange(w.token_start, w.context_len)
            out.append(torch.tensor(t, dtype=torch.long)[p // bs] * bs + p % bs)
        return torch.cat(out)

    groups = []
    for part in split(dec):
        kvi, valid = kv_indices(tables(None), part)
        groups.append(dict(q_index=torch.tensor([rows[i][0] for i in part]).view(-1, 1), kv_index=kvi,
                           mask=additive(valid[:, None, None, :]), out_valid=None, out_rows=None,
                           layer_kv_index={l: kv_indices(tables(l), part)[0] for l in over},
                           causal=False, q_start=rows[part[0]][0]))
    if pf:
        kvi, valid = kv_indices(tables(None), pf)
        qlens = [active[i].num_tokens for i in pf]
        Q, B = max(qlens), len(pf)
        qi, ql = torch.arange(Q), torch.tensor(qlens)
        q_index = torch.tensor([rows[i][0] for i in pf])[:, None] + torch.minimum(qi[None, :], ql[:, None] - 1)
        qpos = torch.tensor([active[i].token_start for i in pf])[:, None] + qi[None, :]
        causal = B == 1 and active[pf[0]].token_start == 0
        mask = None
        if not causal:
            C = kvi.shape[1]
            m = (torch.arange(C)[None, None, :] <= qpos[:, :, None]) & valid[:, None, :]
            mask = additive(m[:, None].expand(B, g, Q, C).reshape(B, 1, g * Q, C))
        out_valid = out_rows = None
        q_start = rows[pf[0]][0] if all(q == Q for q in qlens) else None
        if q_start is None:
            out_valid = (qi[None, :] < ql[:, None]).view(-1).nonzero().squeeze(1)
            out_rows = q_index.view(-1)[out_valid]
        groups.append(dict(q_index=q_index, kv_index=kvi, mask=mask, out_valid=out_valid, out_rows=out_rows,
                           layer_kv_index={l: kv_indices(tables(l), pf)[0] for l in over},
                           causal=causal, q_start=q_start))
    return dict(cos=cos_t[pos], sin=sin_t[pos], slot_mapping=slot_map(tables(None)),
                layer_slot_mapping={l: slot_map(tables(l)) for l in over}, groups=groups)


def same(a, b) -> bool:
    """Equal values, dtypes and shapes (None, ints, tensors, dicts of tensors)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def composition(rng: random.Random) -> list[Work]:
    """Random works: decode rows (by context) first, then prefill chunks (some from 0)."""
    n_dec, n_pf = rng.randint(0, 7), rng.randint(0, 3)
    if n_dec + n_pf == 0:
        n_dec = 1
    works = [Work(f"d{k}", c - 1, 1, 0, 4) for k, c in enumerate(sorted(rng.randint(1, 70) for _ in range(n_dec)))]
    for k in range(n_pf):
        q = rng.randint(2, 20)
        start = 0 if rng.random() < 0.4 else rng.randint(1, 50)
        works.append(Work(f"p{k}", start, q, 0, 4))
    return works


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(40))  # (decode-only, one-work and unpadded groups among them)
def test_metadata_equals_the_torch_formulation(seed, dtype):
    rng = random.Random(seed)
    works = composition(rng)
    bm = Tables(rng, works, num_layers=4)
    cos, sin = torch.randn(128, 8), torch.randn(128, 8)
    limit = rng.choice([10 ** 6, 64])  # one decode group, or several

    def split(dec):  # consecutive groups of at most `limit` padded positions (decode rows sorted)
        return split_decode_rows(dec, works, limit)

    layers = range(0, 4) if seed % 3 else range(1, 3)
    got = build_attn_metadata(works, layers, bm, (cos, sin), dtype, 3, split)
    ref = reference(works, layers, bm, cos, sin, dtype, 3, split)
    assert same(ref["cos"], got.cos) and same(ref["sin"], got.sin)
    assert same(ref["slot_mapping"], got.slot_mapping)
    assert same(ref["layer_slot_mapping"], got.layer_slot_mapping)
    assert len(ref["groups"]) == len(got.groups)
    for want, grp in zip(ref["groups"], got.groups):
        for field, value in want.items():
            assert same(value, getattr(grp, field)), (seed, field)
        # the attention views them flat (kv_index.view(-1), mask.view(B, C)): C-contiguous
        for t in (grp.mask, grp.q_index, grp.kv_index, *grp.layer_kv_index.values()):
            assert t is None or t.is_contiguous(), (seed, t.shape, t.stride())
    assert got.slot_mapping.is_contiguous() and got.cos.is_contiguous()


def test_a_steps_compositions_share_the_prefill_mask():
    """With a memo (the runner keeps one per step), a later composition with the same prefill
    chunks -- here after a decode row left -- reuses the first one's mask tensor, and every
    composition's metadata still equals the torch formulation's."""
    rng = random.Random(3)
    works = [Work("d0", 40, 1, 0, 4), Work("d1", 60, 1, 0, 4), Work("p0", 8, 12, 0, 4), Work("p1", 30, 5, 0, 4)]
    bm = Tables(rng, works, num_layers=4)
    bm.over = {}
    cos, sin = torch.randn(128, 8), torch.randn(128, 8)

    def split(dec):
        return [dec] if dec else []

    memo: dict = {}
    metas = []
    for active in (works, works[1:]):
        got = build_attn_metadata(active, range(0, 4), bm, (cos, sin), torch.bfloat16, 3, split, memo)
        ref = reference(active, range(0, 4), bm, cos, sin, torch.bfloat16, 3, split)
        for want, grp in zip(ref["groups"], got.groups):
            for field, value in want.items():
                assert same(value, getattr(grp, field)), field
        metas.append(got)
    assert metas[1].groups[-1].mask is metas[0].groups[-1].mask
    assert metas[1].groups[-1].q_index[0, 0] == 1  # the prefill rows moved up by the row that left


def test_no_prefill_mask_where_the_prefill_kernel_takes_the_group():
    """``prefill_masks=False`` (a model with the C++ prefill kernel): a prefill group over cached
    context has no mask and is not causal, a lone fresh prompt stays causal, and every other
    field is the torch formulation's."""
    rng = random.Random(5)
    works = [Work("d0", 40, 1, 0, 4), Work("p0", 8, 12, 0, 4), Work("p1", 30, 5, 0, 4)]
    bm = Tables(rng, works, num_layers=4)
    cos, sin = torch.randn(128, 8), torch.randn(128, 8)

    def split(dec):
        return [dec] if dec else []

    got = build_attn_metadata(works, range(0, 4), bm, (cos, sin), torch.bfloat16, 3, split, prefill_masks=False)
    ref = reference(works, range(0, 4), bm, cos, sin, torch.bfloat16, 3, split)
    pf = got.groups[-1]
    assert pf.mask is None and not pf.causal and pf.chunks == ((1, 8, 12), (13, 30, 5))
    assert same(ref["groups"][0]["mask"], got.groups[0].mask)  # decode masks are still built
    for field, value in ref["groups"][-1].items():
        if field != "mask":
            assert same(value, getattr(pf, field)), field
    fresh = [Work("p2", 0, 9, 0, 4)]
    lone = build_attn_metadata(fresh, range(0, 4), Tables(rng, fresh, 4), (cos, sin), torch.bfloat16, 3, split,
                               prefill_masks=False)
    assert lone.groups[-1].causal and lone.groups[-1].mask is None
