"""Every row count a layer call can take, run once at start-up: oneDNN's per-shape set-up paid before serving.

A bf16 matmul on the CPU runs through oneDNN, which builds (and JIT-compiles, on AMX as tile
GEMMs) a primitive for every new shape: a layer call with a row count the process has not seen
pays that set-up in each of its four weight shapes (QKV, O, gate/up, down), the LM head in its
own. Measured on an Intel Xeon with AMX + AVX512-BF16 + VNNI, 2 vCPUs, 1 thread (SmolLM2-135M,
``F.linear`` of a [M, 576] x [3072, 576] product): first call 0.5-3.5 ms against 0.25-1.1 ms for
the next ones. The latency profile times fixed shapes, warmed; a served workload with random
prompt lengths meets ~150 new row counts in a 120-request run (decode rows plus a prefill chunk
of any size). In ``benchmarks/sim_vs_real.py``'s in-process run at the simulated knee the steps
with a new row count ran 1.01-1.04x their price against 0.87-0.91x for the other steps with
prefill (docs/benchmarks.md, "sim26"): one step in ten, slow, which the online calibration reads
as timing spread and plans every later step smaller for.

:func:`warm_row_counts` runs layer 0's stateless parts (:meth:`~laser.model.llama.LlamaModel.qkv`,
:meth:`~laser.model.llama.LlamaModel.finish_layer`: the model's own dispatch, so every kernel a
row count takes -- fused decode graphs, packed dense copies, compiled glue, oneDNN GEMMs) on
dummy rows for each row count from 1 to ``max_rows`` (:func:`layer_row_counts`: the token budget and some
decode rows, at most :data:`WARM_MAX_ROWS`), and the LM head for 1 to ``head_rows``.
Nothing is written: no KV, no model state. oneDNN keeps 1,024 primitives by default, fewer than
four weight shapes x 512 row counts; :data:`CACHE_CAPACITY` is set (unless the environment set
one) before this package loads a weight, as oneDNN reads it when it builds its cache.

What it costs (SmolLM2-135M bf16, ``--quantization auto``, the AMX Xeon): ~6 s of start-up (16.5 s
against 10.4 s to build ``LLM(dtype="bfloat16")``; the primitives' set-up, a second pass takes 1.2 s) and
~0.86 GB of resident memory (4.20 against 3.34 GB: the ~2,000 primitives kept; with oneDNN's default
cache of 1,024, +0.39 GB and half of them evicted again).

``$LASER_WARM_ROWS``: ``auto`` (the default: bf16 models, whose matmuls are oneDNN's), ``1``
(every dtype) or ``0`` (off; the test suite's default, so that building an engine stays quick).
"""

from __future__ import annotations

import logging
import os
import time

import torch

log = logging.getLogger(__name__)

#: Most LM head row counts warmed (rows sampled in one step: decode batches up to this; ``max_num_seqs``
#: when smaller). Beyond it a new count is rare, and each costs a head's matmul to warm.
WARM_HEAD_ROWS = 64

#: Most layer-call row counts warmed (:func:`layer_row_counts`: fewer when a step cannot take more). Every
#: count costs its primitives' set-up and memory: ``benchmarks/engine_speed.py``'s two engines of 4,096 tokens
#: a step warmed 1-4,096 each and were killed for memory at 24 GB (the AMX Xeon, session 27).
WARM_MAX_ROWS = 640
#: Decode rows a layer call may hold beside a full prefill budget that are warmed too (``max_num_seqs`` when
#: smaller). With 512 warmed for a 512-token budget, a layer call of 559 and one of 603 rows (a 434-token chunk
#: and a 113-token prompt beside 12 decode rows) took 40.8 and 44.0 ms at first use against 10.9 and 11.9 ms
#: once set up, on the AMX Xeon at 1 thread (session 28): two such steps in a run put the calibration's timing
#: spread at its cap for the next 64 steps, and cut every plan's prefill by a third.
WARM_DECODE_ROWS = 128


def layer_row_counts(max_num_batched_tokens: int, max_num_seqs: int) -> tuple[int, int]:
    """``(warmed, most)``: the row counts :func:`warm_row_counts` sets up at start (``1..warmed``) for an engine
    whose steps hold at most ``max_num_batched_tokens`` prefill tokens and ``max_num_seqs`` requests, and the
    most rows one of its layer calls takes in the common case (the token budget plus up to
    :data:`WARM_DECODE_ROWS` decode rows; ``warmed`` is that, at most :data:`WARM_MAX_ROWS`)."""
    most = max_num_batched_tokens + min(max_num_seqs, WARM_DECODE_ROWS)
    return min(most, WARM_MAX_ROWS), most

#: oneDNN primitive cache entries this package asks for (oneDNN's default: 1,024).
CACHE_CAPACITY = 8192
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(CACHE_CAPACITY))


def warm_rows_mode(dtype: torch.dtype) -> bool:
    """Whether :func:`warm_row_counts` runs for a model of ``dtype`` (``$LASER_WARM_ROWS``: ``auto``,
    the default, for bf16; ``1`` always; ``0`` never). Raises ValueError on another value."""
    mode = os.environ.get("LASER_WARM_ROWS", "auto")
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"LASER_WARM_ROWS={mode!r}: use auto, 1 or 0")
    return mode == "1" or (mode == "auto" and dtype == torch.bfloat16)


@torch.inference_mode()
def warm_row_counts(model, max_rows: int, head_rows: int, step_rows: int = 0) -> str:
    """Run ``model``'s layer 0 (a :class:`~laser.model.llama.LlamaModel`) on dummy rows [M, H]
    of its dtype for every M in ``1..max_rows`` (its QKV part and its finishing part), and its
    LM head on ``1..head_rows`` rows, so that no served step builds a kernel for a new row count
    (module docstring). Writes no KV and no model state. Returns a sentence for the startup log
    (row counts, seconds; ``step_rows``: the most rows a step may take, named when past ``max_rows``,
    whose larger counts pay the set-up at first use). Raises ValueError for ``max_rows`` or ``head_rows``
    below 0."""
    if max_rows < 0 or head_rows < 0:
        raise ValueError(f"need max_rows, head_rows >= 0, got {max_rows}, {head_rows}")
    c, dt = model.config, model.dtype
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    n = max(max_rows, head_rows)
    h = (torch.randn(n, c.hidden_size, generator=gen) * 0.1).to(dt)  # rows of every call: views of one tensor
    attn = (torch.randn(n, c.num_heads, c.head_dim, generator=gen) * 0.1).to(dt)
    cos, sin = model.rope_cos[:n].contiguous(), model.rope_sin[:n].contiguous()
    for m in range(1, max_rows + 1):
        model.qkv(0, h[:m], cos[:m], sin[:m])
        model.finish_layer(0, h[:m], attn[:m])
    for m in range(1, head_rows + 1):
        model.compute_logits(h[:m])
    larger = (f"; counts {max_rows + 1}-{step_rows} (this engine's token budget and decode rows) are set up at "
              f"first use" if step_rows > max_rows else "")
    return (f"row counts 1-{max_rows} of a layer call and 1-{head_rows} of the LM head run once at start-up "
            f"({time.perf_counter() - t0:.1f} s): no step of up to {max_rows} rows pays oneDNN's set-up of a new "
            f"shape{larger} (LASER_WARM_ROWS=0 to skip)")
