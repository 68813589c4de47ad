"""A steady decode batch's attention metadata, derived from the previous one's.

Most decode steps run the very batch of the step before: the same requests in the same row order,
each one token further (one decode token each). Their :class:`~laser.model.llama.AttnMetadata` is
then the previous one with one more context position per row, so :class:`SteadyDecode` derives it
with a handful of numpy calls instead of the full builder's ~25
(:func:`~laser.model.attn_metadata.build_attn_metadata`): right after a layer call each numpy or
torch call pays a cold-cache penalty of several microseconds, and the builder was the largest part
of switching at 2 threads (310-390 us a step, AMD EPYC; docs/benchmarks.md, sw22).

Derivation (row ``i`` at new position ``p_i``, the previous context length; ``s_i`` its KV slot
``table[p_i // bs] * bs + p_i % bs``; a gather group of ``B`` rows padded to ``C`` positions):

- KV indices ``[B, C + 1]``: the previous ``[B, C]`` with a zero (pad) column appended, then
  ``[i, p_i] = s_i`` (that position was a pad, or the new column).
- mask ``[B, 1, 1, C + 1]``: position ``c`` is valid for row ``i`` iff ``c < p_i + 1``, i.e. iff
  ``c - 1`` was valid before: the previous mask with a 0 (attend) column prepended. A group whose
  rows all had context ``C`` stays unpadded (a fresh zero mask, as the builder makes).
- slot mapping ``[s_i]``, positions ``p``; the query rows (``q_index``) are unchanged.

The result equals the builder's bit for bit (values, dtypes, shapes, strides), which
``tests/model/test_attn_steady.py`` checks over random step sequences. Anything else falls back to
the builder: a row joined, left, moved or took more than one token; a layer of ``layers`` with its
own block table (per-layer overrides); a block of the previous context that changed (trimmed and
regrown, a request id reused); a different split into gather groups; a mask dtype other than
bfloat16 or float32.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from ..core.plan import Work
from .attn_metadata import _group_key, build_attn_metadata
from .llama import AttnGroup, AttnMetadata


class SteadyDecode:
    """The last decode-only build's state (one per runner, kept across steps): its rows' request
    ids, positions, the block-table prefixes their contexts used, the gather
    groups (lists of row indices) and, per group, ``[first row, end row, KV indices (int64
    [B, C] numpy), mask storage (int16 bits [B, 1, 1, C] for bfloat16, float32 for float32; None
    when no row is padded), the group's AttnGroup]``. ``ids`` None: nothing to derive from."""

    __slots__ = ("ids", "starts", "tables", "parts", "groups")

    def __init__(self) -> None:
        self.ids: list[str] | None = None

    def build(self, active: Sequence[Work], layers: range, bm, rope: tuple[torch.Tensor, torch.Tensor],
              dtype: torch.dtype, group_size: int, split_decode: Callable[[list[int]], list[list[int]]],
              memo: dict | None = None, prefill_masks: bool = True) -> AttnMetadata:
        """:func:`~laser.model.attn_metadata.build_attn_metadata`'s result for these arguments (the
        same contract): derived from the previous decode-only build when ``active`` is its steady
        successor, else built (and remembered when decode-only)."""
        got = self._derive(active, layers, bm, rope, dtype, split_decode, memo)
        if got is None:
            got = build_attn_metadata(active, layers, bm, rope, dtype, group_size, split_decode, memo, prefill_masks)
            self._record(active, layers, bm, dtype, split_decode, got)
        return got

    def _derive(self, active, layers, bm, rope, dtype, split_decode, memo) -> AttnMetadata | None:
        """The steady successor's metadata, or None (not one: the caller builds). Its gather
        groups go into ``memo`` as the builder's would (a later composition of the step reuses them)."""
        ids, bs = self.ids, bm.block_size
        if ids is None or len(ids) != len(active) or dtype not in _MASK_NP:
            return None
        old, tables, starts, slots, opened = self.starts, self.tables, [], [], []
        for i, w in enumerate(active):
            p = w.token_start
            if w.num_tokens != 1 or w.req_id != ids[i] or p != old[i] + 1:
                return None
            ov = bm.overridden_layers(w.req_id)
            if ov and any(l in layers for l in ov):
                return None
            t, prev = bm.canonical_table(w.req_id), tables[i]
            if t[: len(prev)] != prev:  # a block of the previous context changed
                return None
            slots.append(t[p // bs] * bs + p % bs)  # IndexError past the table, as the builder
            starts.append(p)
            if p % bs == 0:  # position p opens a new block: the next step checks it too
                opened.append((i, t[: p // bs + 1]))
        parts = split_decode(list(range(len(active))))
        if parts != self.parts:
            return None
        for i, t in opened:
            tables[i] = t
        self.starts = starts
        pos, slot = np.array((starts, slots), dtype=np.int64)  # [T] each
        one = len(parts) == 1
        groups = []
        for part, g in zip(parts, self.groups):
            grp = g[4] = self._grow(g, pos if one else pos[g[0]:g[1]], slot if one else slot[g[0]:g[1]], dtype)
            if memo is not None:
                memo[_group_key(active, part, {})] = (grp.kv_index, grp.mask, {})
            groups.append(grp)
        cos, sin = rope
        pt = torch.from_numpy(pos)
        return AttnMetadata(cos=cos.index_select(0, pt), sin=sin.index_select(0, pt),
                            slot_mapping=torch.from_numpy(slot), layer_slot_mapping={}, groups=groups)

    @staticmethod
    def _grow(g: list, pos: np.ndarray, slot: np.ndarray, dtype) -> AttnGroup:
        """Group ``g`` (``[first row, end row, KV indices, mask storage, AttnGroup]``) one position
        further (module docstring): its new AttnGroup; ``g``'s arrays are replaced by the new ones.
        ``pos``, ``slot``: the group's rows' new positions and their KV slots, int64 [B]."""
        kvi, mask, old = g[2], g[3], g[4]
        B, C = kvi.shape
        kvi = np.concatenate((kvi, _zeros(B, 2, np.int64)), axis=1)  # [B, C + 1]
        kvi[_rows(B), pos] = slot
        if mask is None:
            m = torch.zeros((B, 1, 1, C + 1), dtype=dtype)
        else:
            mask = np.concatenate((_zeros(B, 4, mask.dtype), mask), axis=3)  # [B, 1, 1, C + 1]
            m = torch.from_numpy(mask)
            if m.dtype != dtype:
                m = m.view(dtype)
        g[2], g[3] = kvi, mask
        return AttnGroup(old.q_index, torch.from_numpy(kvi), m, None, None, {}, q_start=old.q_start)

    def _record(self, active, layers, bm, dtype, split_decode, meta: AttnMetadata) -> None:
        """Remember a built decode-only ``meta`` for the next step (when its gather groups are
        consecutive row ranges, as the runner's are, and no layer has its own tables); forget the
        last one when it cannot be. A build with prefill rows leaves the state as it is (a later
        decode batch may still be the last one's successor: every derivation checks it all)."""
        if not active or any(w.num_tokens != 1 for w in active):
            return
        self.ids = None
        if dtype not in _MASK_NP or any(l in layers for w in active for l in bm.overridden_layers(w.req_id)):
            return
        parts = split_decode(list(range(len(active))))
        if [i for p in parts for i in p] != list(range(len(active))):
            return
        bs = bm.block_size
        self.starts = [w.token_start for w in active]
        self.tables = [bm.canonical_table(w.req_id)[: -(-w.context_len // bs)] for w in active]
        self.parts, self.groups = parts, []
        for part, grp in zip(parts, meta.groups):
            a, b = part[0], part[-1] + 1
            pad = any(active[i].context_len != grp.kv_index.shape[1] for i in part)
            mask = grp.mask.view(_MASK_NP[dtype][0]).numpy() if pad else None
            self.groups.append([a, b, grp.kv_index.numpy(), mask, grp])
        self.ids = [w.req_id for w in active]


#: mask dtype -> (torch dtype of the same bits that numpy has, numpy dtype)
_MASK_NP = {torch.bfloat16: (torch.int16, np.int16), torch.float32: (torch.float32, np.float32)}
_ZEROS: dict = {}


def _zeros(B: int, ndim: int, dt) -> np.ndarray:
    """Read-only zeros of numpy dtype ``dt``, shape ``[B, 1]`` (``ndim`` 2) or ``[B, 1, 1, 1]`` (4)
    (cached)."""
    got = _ZEROS.get((B, ndim, dt))
    if got is None:
        got = _ZEROS[(B, ndim, dt)] = np.zeros((B,) + (1,) * (ndim - 1), dtype=dt)
        got.flags.writeable = False
    return got


def _rows(B: int) -> np.ndarray:
    """Read-only int64 ``0..B-1``."""
    return np.arange(B, dtype=np.int64) if B > 4096 else _ROWS[:B]


_ROWS = np.arange(4096, dtype=np.int64)
_ROWS.flags.writeable = False
