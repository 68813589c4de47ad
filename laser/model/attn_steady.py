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
bfloat16 or float32. (In place: the dtype it was made for, the model's.)

In place (``SteadyDecode(in_place=True)``: a runner whose decode groups all run the C++ decode
kernel, :mod:`laser.model.attn_kernel`): even those dozen numpy/torch calls cost ~200 us a step at
2 threads (each 10-50 us cache-cold right after a layer call, AMD EPYC; docs/benchmarks.md, sw24),
so a steady step makes no tensor at all. A group's KV indices and mask live in [B, L] tensors with
spare columns (:data:`ROOM`; slot 0 and -inf there) whose first ``cols`` columns are the builder's
[B, C] (:attr:`~laser.model.llama.AttnGroup.cols`; the kernel reads only those: the same work and
bits); one C++ call (:func:`load_grow_kernel`) writes the new position's slot and 0 mask entry, and
the rows' slots and rope rows into the last step's slot mapping and cos/sin tensors. Sound because
nothing holds a step's metadata past the step (the runner drops it; its public ``build_metadata``
never derives in place); a full group gets a new layout, the context copied once.
"""

from __future__ import annotations

from array import array
from typing import Callable, Sequence

import numpy as np
import torch

from ..core.plan import Work
from .attn_kernel import compile_kernel
from .attn_metadata import _group_key, build_attn_metadata
from .llama import AttnGroup, AttnMetadata


class SteadyDecode:
    """The last decode-only build's state (one per runner, kept across steps): its rows' request
    ids, positions, the block-table prefixes their contexts used, the gather
    groups (lists of row indices) and, per group, ``[first row, end row, KV indices (int64
    [B, C] numpy), mask storage (int16 bits [B, 1, 1, C] for bfloat16, float32 for float32; None
    when no row is padded), the group's AttnGroup]``; in place, ``[first row, end row, KV indices
    (int64 tensor [B, L]), mask (tensor [B, 1, 1, L] in :attr:`dtype`), L, cols, the group's AttnGroup]`` and
    ``out`` = (cos, sin, slot mapping) of the rows. ``ids`` None: nothing to derive from."""

    __slots__ = ("ids", "starts", "tables", "parts", "groups", "in_place", "dtype", "kernel", "out")

    def __init__(self, in_place: bool = False, dtype: torch.dtype = torch.bfloat16) -> None:
        self.ids: list[str] | None = None
        #: derive in place (:meth:`_grow_in_place`), for a runner whose decode groups all run the
        #: C++ decode kernel (it reads :attr:`~laser.model.llama.AttnGroup.cols`); False where
        #: the C++ helper does not compile (a warning), for a dtype other than bf16 and fp32, or
        #: not asked
        self.kernel = load_grow_kernel(dtype) if in_place else None
        self.in_place = self.kernel is not None
        #: the masks' and rope rows' dtype (bf16 or fp32) derived in place; other builds fall back
        self.dtype = dtype

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

    def _advance(self, active, layers, bm, split_decode, limit: int) -> tuple | None:
        """When ``active`` is the last batch's steady successor: its rows' new positions and KV
        slots (lists) and gather groups, the state moved to them; else None (nothing changed).
        ``limit``: positions must lie below it (the rope tables' rows; past them the builder raises)."""
        ids, bs = self.ids, bm.block_size
        if ids is None or len(ids) != len(active):
            return None
        old, tables, starts, slots, opened = self.starts, self.tables, [], [], []
        for i, w in enumerate(active):
            p = w.token_start
            if w.num_tokens != 1 or w.req_id != ids[i] or p != old[i] + 1 or p >= limit:
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
        return starts, slots, parts

    def _derive(self, active, layers, bm, rope, dtype, split_decode, memo) -> AttnMetadata | None:
        """The steady successor's metadata, or None (not one: the caller builds). Its gather
        groups go into ``memo`` as the builder's would (a later composition of the step reuses
        them); in place (:attr:`in_place`), none do (their tensors have spare columns)."""
        if dtype not in _MASK_NP or (self.in_place and (dtype, rope[0].dtype) != (self.dtype,) * 2):
            return None
        got = self._advance(active, layers, bm, split_decode, rope[0].shape[0])
        if got is None:
            return None
        starts, slots, parts = got
        if self.in_place:
            return self._grow_in_place(starts, slots, rope, dtype)
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

    def _grow_in_place(self, starts: list[int], slots: list[int], rope, dtype) -> AttnMetadata:
        """In-place derivation (module docstring): one C++ call per gather group writes the new
        position's slot and mask entry into the group's [B, L] tensors (new ones, with
        :data:`ROOM` spare columns, when full or still the builder's) and the rows' slots and
        rope rows into the last build's slot mapping and cos/sin: a steady step makes no tensor."""
        rows = array("q", starts)
        rows.extend(slots)
        addr, T = rows.buffer_info()[0], len(starts)
        cos, sin, slot = self.out
        rc, rs = rope
        hd = rc.shape[1]
        groups = []
        for g in self.groups:
            a, b, kvi, mask, ld, cols, old = g
            B = b - a
            if cols + 1 > ld:  # no room: a new layout, the context copied
                ld2 = cols + 1 + ROOM
                dkv, dm = torch.empty((B, ld2), dtype=torch.int64), torch.empty((B, 1, 1, ld2), dtype=dtype)
            else:
                ld2, dkv, dm = ld, kvi, mask
            self.kernel(kvi, mask, dkv, dm, ld, ld2, cols, B, addr, a, T, slot, rc, rs, cos, sin, hd)
            grp = AttnGroup(old.q_index, dkv, dm, None, None, {}, q_start=old.q_start, cols=cols + 1)
            g[2:] = [dkv, dm, ld2, cols + 1, grp]
            groups.append(grp)
        return AttnMetadata(cos=cos, sin=sin, slot_mapping=slot, layer_slot_mapping={}, groups=groups)

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
        if self.in_place:  # the build's tensors, read by the first derivation, then written in place
            if dtype != self.dtype or meta.cos.dtype != self.dtype:
                return
            self.out = (meta.cos, meta.sin, meta.slot_mapping)
            for part, grp in zip(parts, meta.groups):
                C = grp.kv_index.shape[1]
                self.groups.append([part[0], part[-1] + 1, grp.kv_index, grp.mask, C, C, grp])
            self.ids = [w.req_id for w in active]
            return
        for part, grp in zip(parts, meta.groups):
            a, b = part[0], part[-1] + 1
            pad = any(active[i].context_len != grp.kv_index.shape[1] for i in part)
            mask = grp.mask.view(_MASK_NP[dtype][0]).numpy() if pad else None
            self.groups.append([a, b, grp.kv_index.numpy(), mask, grp])
        self.ids = [w.req_id for w in active]


#: Spare context columns a steady group's tensors get when it outgrows them (in place: a new
#: layout every ROOM + 1 steps, the context copied once; the decode kernel reads none of them).
ROOM = 63

_GROW_SOURCE = r"""
#include <cstdint>
#include <cstring>
// One steady decode group of B rows one position further (laser.model.attn_steady): KV indices
// and mask bits [B, dld] from [B, sld] (their first cols columns; the same tensors when
// skv == dkv: nothing moves), the rows' new positions and slots read from rows (int64: T
// positions, then T slots; the group's rows from a), its slots and rope rows (hd elements each)
// written to slot_out, co, so (rows a..a+B-1). E: the bits of one mask / rope element (int16_t for
// bf16, int32_t for fp32), NEG: -inf's bits.
using E = LASER_BITS;
extern "C" void kernel(const int64_t* skv, const E* smask, int64_t* dkv, E* dmask,
                       int64_t sld, int64_t dld, int64_t cols, int64_t B, uintptr_t rows, int64_t a,
                       int64_t T, int64_t* slot_out, const E* rc, const E* rs, E* co,
                       E* so, int64_t hd) {
    const int64_t* pos = reinterpret_cast<const int64_t*>(rows) + a;
    const int64_t* slot = reinterpret_cast<const int64_t*>(rows) + T + a;
    const E neg = static_cast<E>(LASER_NEG);
    if (dkv != skv) {
        for (int64_t i = 0; i < B; ++i) {
            std::memcpy(dkv + i * dld, skv + i * sld, cols * sizeof(int64_t));
            std::memcpy(dmask + i * dld, smask + i * sld, cols * sizeof(E));
            for (int64_t c = cols; c < dld; ++c) {
                dkv[i * dld + c] = 0;
                dmask[i * dld + c] = neg;
            }
        }
    }
    for (int64_t i = 0; i < B; ++i) {
        const int64_t p = pos[i];
        dkv[i * dld + p] = slot[i];
        dmask[i * dld + p] = 0;
        slot_out[a + i] = slot[i];
        std::memcpy(co + (a + i) * hd, rc + p * hd, hd * sizeof(E));
        std::memcpy(so + (a + i) * hd, rs + p * hd, hd * sizeof(E));
    }
}
"""
#: per dtype: the C type of one element's bits, -inf's bits
_GROW_BITS = {torch.bfloat16: ("int16_t", "-128"), torch.float32: ("int32_t", "-8388608")}  # 0xFF80, 0xFF800000
_GROW: dict = {}


def load_grow_kernel(dtype: torch.dtype = torch.bfloat16):
    """The in-place derivation's C++ helper for ``dtype`` masks and rope rows (bf16 or fp32;
    compiled once a process, through the decode attention kernel's loader
    :func:`~laser.model.attn_kernel.compile_kernel`), or None where that fails or for another dtype."""
    if dtype not in _GROW_BITS:
        return None
    if dtype not in _GROW:
        e, neg = _GROW_BITS[dtype]
        args = ["const int64_t*", f"const {e}*", "int64_t*", f"{e}*", "int64_t", "int64_t", "int64_t", "int64_t",
                "uintptr_t", "int64_t", "int64_t", "int64_t*", f"const {e}*", f"const {e}*", f"{e}*", f"{e}*",
                "int64_t"]
        source = f"#define LASER_BITS {e}\n#define LASER_NEG {neg}\n" + _GROW_SOURCE
        _GROW[dtype] = compile_kernel(args, source, f"steady decode metadata helper ({str(dtype).removeprefix('torch.')})")
    return _GROW[dtype]


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
