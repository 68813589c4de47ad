"""Attention metadata of one batch composition (:class:`~laser.model.llama.AttnMetadata`): the
one builder, used by the model runner at every composition change and by callers that run
layers themselves (self-speculation, exit training, the profiler).

The index arithmetic runs in numpy and each result becomes a tensor once
(``torch.from_numpy``, no copy): a composition change costs tens of microseconds, where one
eager torch call per small index tensor cost ~0.35 ms for a decode batch of 8 (AMD EPYC,
1 thread). The tensors are exactly those of the torch formulation (int64 indices, additive
masks of 0 / -inf in the model dtype); ``tests/model/test_attn_metadata.py`` checks them
against a plain reference.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Callable, Sequence

import numpy as np
import torch

from ..core.plan import Work
from .llama import AttnGroup, AttnMetadata


def build_attn_metadata(active: Sequence[Work], layers: range, bm, rope: tuple[torch.Tensor, torch.Tensor],
                        dtype: torch.dtype, group_size: int,
                        split_decode: Callable[[list[int]], list[list[int]]], memo: dict | None = None,
                        prefill_masks: bool = True) -> AttnMetadata:
    """Metadata for ``active`` (rows in this order: each work's ``num_tokens`` rows, contiguous;
    decode works -- one token -- first), valid for every layer in ``layers``.

    ``bm``: block tables (``block_size``, ``canonical_table``, ``table``, ``overridden_layers``);
    every work's blocks must be allocated. ``rope``: the model's (cos, sin) [max_pos, head_dim].
    ``dtype``: the masks' dtype (the model's). ``group_size``: query heads per KV head.
    ``split_decode(rows)``: the decode rows' gather groups (lists of indices into ``active``).
    ``memo``: a dict the caller keeps while the block tables of ``active``'s works do not change
    and ``bm``, ``dtype`` and ``group_size`` stay the same (the runner: one step). Each gather
    group's KV indices and mask are kept there by its works (request, first position, tokens) and
    the overridden layers, so a later composition with the same decode group or the same prefill
    chunks (a step's works leave and join around them) reuses those tensors (read only
    downstream); the row indices, which move with the rows before the group, are built anew.
    ``prefill_masks``: False where the model runs prefill groups through its C++ prefill kernel
    (:attr:`~laser.model.llama.AttnGroup.chunks`, never the mask): their mask is not built (None,
    the group not causal unless it is one sequence without cached context). Same for one ``memo``.
    Raises IndexError when a position lies past a work's block table."""
    bs = bm.block_size
    override = sorted({l for w in active for l in bm.overridden_layers(w.req_id) if l in layers})
    starts = list(accumulate([w.num_tokens for w in active], initial=0))  # first row of each work
    dec, pf = [], []
    for i, w in enumerate(active):
        (dec if w.num_tokens == 1 else pf).append(i)
    canon = [bm.canonical_table(w.req_id) for w in active]
    per_layer = {l: [bm.table(w.req_id, l) for w in active] for l in override}
    groups: list[AttnGroup] = []
    for part in split_decode(dec):
        kvi, mask, layer_kvi = _shared(memo, _group_key(active, part, per_layer),
                                       lambda: _decode_parts(active, canon, per_layer, part, bs, dtype))
        q_index = torch.from_numpy(np.array([starts[i] for i in part], dtype=np.int64).reshape(-1, 1))  # [B, 1]
        groups.append(AttnGroup(q_index, kvi, mask, None, None, layer_kvi,
                                q_start=starts[part[0]]))  # decode rows of a part are consecutive
    if pf:
        groups.append(_prefill_group(active, canon, per_layer, pf, starts, bs, dtype, group_size, memo,
                                     prefill_masks))
    pos = torch.from_numpy(_positions(active))
    cos, sin = rope
    return AttnMetadata(cos=cos.index_select(0, pos), sin=sin.index_select(0, pos),
                        slot_mapping=_slot_map(active, canon, bs),
                        layer_slot_mapping={l: _slot_map(active, t, bs) for l, t in per_layer.items()},
                        groups=groups)


def _prefill_group(active, canon, per_layer, pf: list[int], starts: list[int], bs: int, dtype, g: int,
                   memo: dict | None, with_mask: bool) -> AttnGroup:
    """The prefill works' group: queries padded to the longest chunk ``Q``, causal within the
    work's context; one sequence without cached context takes the causal kernel (no mask)."""
    causal = len(pf) == 1 and active[pf[0]].token_start == 0
    kvi, mask, layer_kvi = _shared(memo, _group_key(active, pf, per_layer),
                                   lambda: _prefill_parts(active, canon, per_layer, pf, bs, dtype, g,
                                                          with_mask and not causal))
    qlens = [active[i].num_tokens for i in pf]
    Q = max(qlens)
    first = [starts[i] for i in pf]
    unpadded = min(qlens) == Q
    if unpadded:
        q_index = torch.from_numpy(np.array(first, dtype=np.int64)[:, None] + _arange(Q))  # [B, Q]
    else:
        qi = np.arange(Q, dtype=np.int64)
        ql = np.array(qlens, dtype=np.int64)
        q_np = np.array(first, dtype=np.int64)[:, None] + np.minimum(qi[None, :], ql[:, None] - 1)  # [B, Q]
        q_index = torch.from_numpy(q_np)
    out_valid = out_rows = None
    q_start = first[0] if unpadded else None  # unpadded prefill rows are consecutive
    if not unpadded:
        ov = np.flatnonzero(qi[None, :] < ql[:, None])  # [R] real slots of the padded [B*Q]
        out_valid, out_rows = torch.from_numpy(ov), torch.from_numpy(q_np.reshape(-1)[ov])
    chunks = tuple((starts[i], active[i].token_start, active[i].num_tokens) for i in pf)
    return AttnGroup(q_index, kvi, mask, out_valid, out_rows, layer_kvi, causal=causal, q_start=q_start,
                     chunks=chunks)


def _shared(memo: dict | None, key, build):
    """``build()``, or what it gave for ``key`` earlier in ``memo`` (stored there; None: no memo)."""
    if memo is None:
        return build()
    got = memo.get(key)
    if got is None:
        got = memo[key] = build()
    return got


def _group_key(active, idxs: list[int], per_layer: dict) -> tuple:
    """What a gather group's KV indices and mask depend on, block tables aside: its works
    (request, first position, tokens) in order and the overridden layers."""
    return tuple((active[i].req_id, active[i].token_start, active[i].num_tokens) for i in idxs), tuple(per_layer)


def _decode_parts(active, canon, per_layer, part: list[int], bs: int, dtype):
    """A decode group's [B, C] KV indices, [B, 1, 1, C] mask and per-layer KV indices."""
    kvi, valid = _kv_index(active, canon, part, bs)
    mask = (torch.zeros((len(part), 1, 1, kvi.shape[1]), dtype=dtype) if valid is None
            else _additive(valid[:, None, None, :], dtype))
    return kvi, mask, {l: _kv_index(active, t, part, bs)[0] for l, t in per_layer.items()}


def _prefill_parts(active, canon, per_layer, pf: list[int], bs: int, dtype, g: int, with_mask: bool):
    """The prefill group's [B, C] KV indices, mask (None unless ``with_mask``) and per-layer KV
    indices."""
    kvi, _ = _kv_index(active, canon, pf, bs)
    chunks = [(active[i].token_start, active[i].num_tokens) for i in pf]
    Q = max(n for _, n in chunks)
    mask = _prefill_mask(chunks, Q, kvi.shape[1], g, dtype) if with_mask else None
    return kvi, mask, {l: _kv_index(active, t, pf, bs)[0] for l, t in per_layer.items()}


def _prefill_mask(chunks, Q: int, C: int, g: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, g*Q, C] additive mask (0 / -inf in ``dtype``) of prefill chunks (``chunks``: B pairs
    (first position ``s``, ``num_tokens``)) padded to ``Q``
    queries over ``C`` context positions: query ``q`` of a chunk starting at position ``s``
    attends to positions ``<= s + q``, and never past its own context (its padded queries,
    ``q >= num_tokens``, repeat the last real row's reach). Repeated for the ``g`` query heads of
    a KV head. Built in ``dtype`` directly: ``triu_`` over a ``-inf`` fill keeps ``-inf`` exactly
    where ``c - q >= s + 1`` (the causal rule with the chunk's offset)."""
    B = len(chunks)
    mask = torch.full((B, g, Q, C), float("-inf"), dtype=dtype)
    for b, (s, n) in enumerate(chunks):
        mask[b].triu_(s + 1)
        if n < Q:  # padded queries reach past the context: cut them at it
            mask[b, :, n:, s + n:] = float("-inf")
    return mask.view(B, 1, g * Q, C)


def _kv_index(active, tables, idxs: list[int], bs: int) -> tuple[torch.Tensor, np.ndarray | None]:
    """[B, C] KV slots of positions ``0..C-1`` of the works ``idxs`` (C = their longest
    context; pads point at slot 0) and the [B, C] bool array of the real ones (None when every
    work's context is C: no pad, e.g. one work). Few numpy calls (each one is several
    microseconds when the code is cache-cold after a layer call): the block table rows in one
    array, then slot ``c`` of a row is ``table[c // bs] * bs + c % bs`` through the cached
    position patterns (:func:`_position_pattern`)."""
    ctx = [active[i].context_len for i in idxs]
    C = max(ctx)
    nb = -(-C // bs)
    rows = [tables[i][:nb] for i in idxs]
    if all(len(t) == nb for t in rows):
        tbl = np.array(rows, dtype=np.int64)  # [B, nb]
    else:  # a short table (a work whose context ends blocks before C): zero-filled
        tbl = np.zeros((len(idxs), nb), dtype=np.int64)
        for k, t in enumerate(rows):
            tbl[k, : len(t)] = t
    ar, blk, off = _position_pattern(C, bs)
    kvi = np.take(tbl * bs, blk, axis=1) + off  # [B, C], C-contiguous (``tbl[:, blk]`` is not: the runner views it flat)
    if min(ctx) == C:
        return torch.from_numpy(kvi), None
    valid = ar < np.array(ctx, dtype=np.int64)[:, None]
    return torch.from_numpy(np.where(valid, kvi, 0)), valid


_PATTERNS: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}


def _position_pattern(C: int, bs: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Read-only int64 ``[C]`` arrays of positions ``c``, ``c // bs`` and ``c % bs``: views of a
    per-block-size cache grown by doubling (shared by every build; never written)."""
    got = _PATTERNS.get(bs)
    if got is None or got[0].shape[0] < C:
        n = max(C, 2 * got[0].shape[0] if got is not None else 4096)
        ar = np.arange(n, dtype=np.int64)
        got = _PATTERNS[bs] = (ar, ar // bs, ar % bs)
        for a in got:
            a.flags.writeable = False
    return got[0][:C], got[1][:C], got[2][:C]


def _arange(n: int) -> np.ndarray:
    """Read-only int64 ``[n]`` array ``0..n-1`` (a view of :func:`_position_pattern`'s cache)."""
    return _position_pattern(n, 1)[0]


def _slot_map(active, tables, bs: int) -> torch.Tensor:
    """[T] KV slots the new tokens of ``active`` write (rows in order). A decode-only batch (one
    row per work: most steps) is one list of slots, without a part per row."""
    if all(w.num_tokens == 1 for w in active):
        return torch.from_numpy(np.array([t[w.token_start // bs] * bs + w.token_start % bs
                                          for w, t in zip(active, tables)], dtype=np.int64))
    parts: list = []
    _, blk, off = _position_pattern(max(w.context_len for w in active), bs)
    for w, t in zip(active, tables):
        p = w.token_start
        if w.num_tokens == 1:
            parts.append((t[p // bs] * bs + p % bs,))
        else:
            c = w.context_len
            parts.append(np.asarray(t, dtype=np.int64)[blk[p:c]] * bs + off[p:c])
    return torch.from_numpy(np.concatenate(parts).astype(np.int64, copy=False))


def _positions(active) -> np.ndarray:
    """[T] positions of the new tokens of ``active`` (rows in order)."""
    if all(w.num_tokens == 1 for w in active):  # decode only: one position per work
        return np.array([w.token_start for w in active], dtype=np.int64)
    ar = _arange(max(w.context_len for w in active))
    return np.concatenate([(w.token_start,) if w.num_tokens == 1 else ar[w.token_start:w.context_len]
                           for w in active]).astype(np.int64, copy=False)


#: Bit pattern of -inf in bfloat16 (numpy has no bfloat16): a bf16 mask is built as these
#: integers and viewed as bf16, no float32 array and no conversion kernel.
_NEG_INF_BITS = {torch.bfloat16: np.uint16(0xFF80)}


def _additive(allowed: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Bool array (True = attend) -> additive mask tensor in ``dtype`` (0 / -inf), contiguous.

    SDPA on CPU adds a float mask directly; a bool one is converted on every call."""
    neg = _NEG_INF_BITS.get(dtype)
    if neg is not None:
        return torch.from_numpy(np.where(allowed, np.uint16(0), neg)).view(dtype)
    return torch.from_numpy(np.where(allowed, np.float32(0), np.float32(-np.inf))).to(dtype)
