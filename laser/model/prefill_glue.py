"""bf16 prefill glue compiled by inductor: the layer RMSNorms, RoPE and SiLU * up over many rows.

On a CPU with AMX the four matmuls of a 512-token SmolLM2 layer take ~2.5-4 ms (oneDNN's AMX
GEMMs) and the eager elementwise glue around them ~1.7-2 ms, a quarter of the layer: each eager
op makes its own pass over the [T, H] or [T, I] rows with a bf16 rounding after it (the bf16
RMSNorm is 4 passes: cast to fp32, norm, cast back, times the weight; RoPE 5: two slices
negated and concatenated, two products, a sum). One inductor kernel per piece reads the rows once
and writes them once (measured on an Intel Xeon with AMX, 1 thread, 512 rows, exploratory: RMSNorm
332 -> 101 us, RoPE over the 12 q/k heads 391 -> 232 us, SiLU * up 620 -> 509 us).

:class:`PrefillGlue` holds the three graphs for one model shape (traced from the eager functions of
:mod:`laser.model.llama` with ``make_fx`` on symbolic row counts: one graph for every row count, no
guards evaluated per call; compiled by inductor and cached on disk by its FX graph cache, as
:mod:`laser.model.fused`'s graphs). The model calls them for rows from :data:`MIN_ROWS` on (prefill
chunks; decode rows stay eager or in the fused decode graphs). bf16 only: fp32 keeps its eager
results bit for bit. Not bit-equal to eager bf16 (inductor keeps fp32 between the fused ops
where eager rounds each op to bf16, and reduces the norm in another order: about one bf16 ulp),
and each row's result depends only on that row. ``$LASER_PREFILL_GLUE`` = ``1`` (the default) or
``0`` (eager; the test suite's default, so that tests compile only where they mean to); where
compiling fails the model runs eager (a warning).
"""

from __future__ import annotations

import logging
import os
from typing import Callable

import torch

from .loader import compile_graph

log = logging.getLogger(__name__)

#: Fewest rows that take the compiled glue (below it a prefill chunk is a few rows: dispatch-bound).
MIN_ROWS = 64
# graphs per model shape (see PrefillGlue.get): one set serves every model of that shape in a process
_CACHE: dict[tuple, "PrefillGlue"] = {}


def glue_mode() -> str:
    """``$LASER_PREFILL_GLUE``: ``1`` (the default: compiled) or ``0`` (eager). Raises ValueError
    on another value."""
    mode = os.environ.get("LASER_PREFILL_GLUE", "1")
    if mode not in ("0", "1"):
        raise ValueError(f"LASER_PREFILL_GLUE={mode!r}: use 1 or 0")
    return mode


class PrefillGlue:
    """Compiled RMSNorm / RoPE / SiLU * up for rows of one model shape (bf16).

    Args:
        norm: the eager ``(x [T, H], w [H]) -> [T, H]`` RMSNorm (the model's formula and eps).
        rope: the eager ``(x [T, heads, d], cos [T, d], sin [T, d]) -> [T, heads, d]`` RoPE.
        swiglu: the eager ``gate_up [T, 2 I] -> [T, I]`` SiLU(gate) * up.
        hidden: H; qkv_width: the fused QKV output's columns (RoPE's input is a view of it:
            [T, q_heads + kv_heads, d] with row stride ``qkv_width``); rope_heads, head_dim;
            intermediate: I.
    """

    __slots__ = ("norm", "rope", "swiglu", "min_rows")

    def __init__(self, norm: Callable, rope: Callable, swiglu: Callable, hidden: int, qkv_width: int,
                 rope_heads: int, head_dim: int, intermediate: int):
        bf, T = torch.bfloat16, 97  # an example row count equal to no other size (see compile_graph)
        x = torch.randn(T, hidden).to(bf)
        self.norm = compile_graph(norm, (x, torch.ones(hidden, dtype=bf)), dynamic=True)
        qkv = torch.randn(T, qkv_width).to(bf)
        qk = qkv[:, : rope_heads * head_dim].view(T, rope_heads, head_dim)
        cs = torch.randn(T, head_dim).to(bf)
        self.rope = compile_graph(rope, (qk, cs, cs.clone()), dynamic=True)
        self.swiglu = compile_graph(swiglu, (torch.randn(T, 2 * intermediate).to(bf),), dynamic=True)
        self.min_rows = MIN_ROWS

    @classmethod
    def get(cls, key: tuple, *args) -> "PrefillGlue | None":
        """The glue for the model shape ``key`` (``args`` as :class:`PrefillGlue` takes them),
        compiled on first use in this process; None where ``$LASER_PREFILL_GLUE`` is ``0`` or
        compiling fails."""
        if glue_mode() == "0":
            return None
        if key not in _CACHE:
            try:
                _CACHE[key] = cls(*args)
            except Exception as e:  # noqa: BLE001 -- any compiler failure: the eager glue works
                log.warning("compiling the bf16 prefill glue failed (%s: %s); it runs eager", type(e).__name__, e)
                return None
        return _CACHE[key]

    def takes(self, x: torch.Tensor, *contiguous: torch.Tensor) -> bool:
        """Whether ``x`` (rows first) runs through these graphs: an int row count (not a symbolic
        size being traced by another graph) of at least :attr:`min_rows`, and each tensor of
        ``contiguous`` contiguous (the layouts the graphs were compiled for; inductor checks
        its inputs' strides)."""
        n = x.shape[0]
        return isinstance(n, int) and n >= self.min_rows and all(t.is_contiguous() for t in contiguous)
