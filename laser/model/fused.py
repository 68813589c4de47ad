"""Fused decode layers: the glue around a layer's quantized matmuls compiled by inductor.

At a few rows a bf16 decode step on a CPU is bound by per-operation overhead, not bytes: around
its four int4 kernel calls an eager layer runs ~30 aten ops (two RMSNorms of ~8 ops each, RoPE,
residual adds, SwiGLU, casts, views), each a dispatch of a few microseconds on 1-8 rows. Two
graphs per layer replace them, each one inductor kernel per fused elementwise/reduction run
with the aten int4/int8 kernels as extern calls between:

- **A** (:meth:`FusedDecode.qkv`): RMSNorm -> QKV matmul (+ bias) -> (QK-norm) -> RoPE on q and k
  (:meth:`laser.model.llama.LlamaModel.qkv_of` traced);
- **B** (:meth:`FusedDecode.finish`): O matmul + residual -> RMSNorm -> gate/up matmul ->
  SiLU * up -> down matmul + residual (:meth:`~laser.model.llama.LlamaModel.finish_of` traced).

- **D** (:meth:`FusedDecode.attend`): decode attention (one query row per sequence) over the KV
  cache, the context rows gathered by their slot index inside the kernel: it replaces the gather
  of K and V plus torch's flash kernel, which at one query row costs ~100-200 us per layer at 520
  positions for ~1 MFLOP (its blocking is sized for long queries). A hand-written C++ kernel
  (:mod:`laser.model.attn_kernel`, bf16 or fp32: 0.25x SDPA's time at one sequence of 520
  positions, 0.4x at 32 of 100 in fp32 on an AVX2-only EPYC); in bf16 inductor's graph of the
  reference where that kernel cannot be compiled (~1.4x faster than flash at one sequence, ~5x
  at 32; AMD EPYC, 1 thread), in fp32 torch's SDPA then.

The K/V write stays eager between A and D. The weights are graph inputs,
so one graph serves every layer of the same shapes; the graphs are traced with ``make_fx`` on
symbolic sizes (no dynamo: no guards evaluated per call; one graph for every row count) and
compiled by inductor, cached on disk by its FX graph cache under the Laser cache dir (as
:class:`laser.model.quant.CompiledGemv`). They run for rows up to the kernels' crossover
(``QuantLinear.kernel_max_rows``); more rows run the eager methods (dense matmuls there).

Only models whose layer matmuls all run the aten int4/int8 kernels take this path: bf16 models,
and fp32 models with int4 layers, or int8 ones on the aten kernel (the AVX2 kind's default for a
4-bit GGUF: ``--dtype auto`` is fp32 there; fp32 int8 layers otherwise run the compiled GEMV),
whose graphs also fuse the casts to and from the kernels' bf16 activations into the glue. An fp32
model with dense layers (``--quantization none``, the exactness tests' setting) stays eager, bit
for bit. Not bit-equal to the eager layers: inductor keeps fp32 between fused ops where eager
bf16 rounds each op (RoPE, SiLU * up), and it reduces the norms in another order, so a value
differs by about one bf16 ulp (in fp32, where a norm's output is rounded to bf16 for the kernel);
a row's result does not depend on the other rows of its batch (per-row code, checked in
tests/model/test_fused.py); graph D reduces over the context positions in order, one sequence at
a time, so a sequence's attention does not depend on the padding its group adds either (torch's
flash kernel does: its last block's sums change with the padded length). In fp32 graph D runs only
through the C++ kernel: inductor's graph of the reference made whole decode steps slower than
torch's SDPA (AVX2-only AMD EPYC, 1 thread, SmolLM2 int4, 300-token prompts: 26.5-27.0 against
25.6-25.9 ms at batch 1, 100-109 against 81-84 ms at batch 8). Measured there
(``benchmarks/engine_speed.py --dtype float32 --threads 1 --quantizations auto:::0,auto:::1``,
graphs A and B only): batch-1 decode 33.2 -> 40.9 tok/s, batch 4 90.7 -> 102.1; graph D's fp32
kernel on top of them, against SDPA (medians of 3, 64 new tokens): batch 1 38.2 -> 43.1 tok/s
(64-token prompts), 30.3 -> 38.7 (500), batch 8 86.7 -> 102.3 (300), batch 32 138.0 -> 152.9 (64).
``$LASER_FUSED_DECODE`` = ``1`` (the default) or
``0`` (eager; the test suite's default, so that tests compile only where they mean to). Where
compiling fails, the model runs eager.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from .attn_kernel import decode_attention_kernel, load_kernel
from .loader import compile_graph
from .quant import QuantLinear

log = logging.getLogger(__name__)

#: The fields of a layer each graph reads (the rest of the layer is not touched).
_QKV_FIELDS = ("ln1", "qkv", "q_norm", "k_norm")
_FINISH_FIELDS = ("o", "ln2", "gate_up", "down")


def fused_enabled() -> bool:
    """``$LASER_FUSED_DECODE``: ``1`` (the default) or ``0``. Raises ValueError on another value."""
    mode = os.environ.get("LASER_FUSED_DECODE", "1")
    if mode not in ("0", "1"):
        raise ValueError(f"LASER_FUSED_DECODE={mode!r}: use 0 or 1")
    return mode == "1"


def _flatten(L, fields: tuple[str, ...]) -> tuple[tuple, tuple[torch.Tensor, ...]]:
    """The layer ``L``'s tensors under ``fields`` as one flat tuple, and its layout: per field,
    ``(name, count, kind, group)`` (a matmul's kind and group decide which kernel the graph calls)."""
    layout, tensors = [], []
    for name in fields:
        v = getattr(L, name)
        if v is None:
            layout.append((name, 0, "", 0))
        elif isinstance(v, QuantLinear):
            ops = v.operands()
            layout.append((name, len(ops), v.qw.kind, v.qw.group_size))
            tensors.extend(ops)
        else:
            layout.append((name, 1, "", 0))
            tensors.append(v)
    return tuple(layout), tuple(tensors)


def _shadow(L, layout: tuple, tensors: tuple[torch.Tensor, ...]):
    """A layer like ``L`` whose fields in ``layout`` compute with ``tensors`` (graph inputs)."""
    S = type(L)()
    for name in type(L).__slots__:
        setattr(S, name, getattr(L, name))
    k = 0
    for name, n, _, _ in layout:
        v = getattr(L, name)
        if isinstance(v, QuantLinear):
            setattr(S, name, v.with_operands(tensors[k:k + n]))
        elif n:
            setattr(S, name, tensors[k])
        k += n
    return S


class FusedDecode:
    """The compiled graphs A and B of every layer of ``model`` (see the module docstring).

    Attributes: ``qkv_rows`` / ``finish_rows``, the most rows each graph runs (the crossover of
    the matmuls it calls); ``graphs``, how many distinct graphs were compiled; ``seconds``, what
    compiling (or loading from the cache) took.

    Raises:
        Exception: whatever tracing or inductor raises (:func:`prepare_fused` falls back to eager).
    """

    def __init__(self, model):
        self.model = model
        layers = model.layers
        self.qkv_rows = min(L.qkv.kernel_max_rows for L in layers)
        self.finish_rows = min(m.kernel_max_rows for L in layers for m in (L.o, L.gate_up, L.down))
        cache: dict = {}
        t0 = time.perf_counter()
        self._qkv = [self._graph(cache, L, _QKV_FIELDS) for L in layers]
        self._finish = [self._graph(cache, L, _FINISH_FIELDS) for L in layers]
        #: graph D's hand-written C++ kernel (:mod:`laser.model.attn_kernel`) for the model dtype;
        #: None (it did not load, or set so for A/B timings) with :attr:`decode_attention` True:
        #: inductor's graph of :func:`decode_attention` (compiled on first use)
        self.attention_kernel = load_kernel(model.dtype)
        self._attend = None
        #: decode attention through graph D (False: torch's SDPA, as before it; for A/B timings):
        #: the C++ kernel, or in bf16 inductor's graph where the kernel did not load (in fp32 that
        #: graph is slower than SDPA: see the module docstring)
        self.decode_attention = self.attention_kernel is not None or model.dtype == torch.bfloat16
        self.graphs, self.seconds = len(cache) + self.decode_attention, time.perf_counter() - t0

    def _graph(self, cache: dict, L, fields: tuple[str, ...]):
        """(compiled graph, the layer's tensors) for ``L``'s ``fields``; layers of one layout and
        the same tensor shapes share one graph."""
        layout, tensors = _flatten(L, fields)
        key = (layout, tuple((tuple(t.shape), t.dtype) for t in tensors))
        fn = cache.get(key)
        if fn is None:
            fn = cache[key] = _boxed(self._compile(L, layout, tensors, fields is _QKV_FIELDS))
        return fn, list(tensors)

    def _compile(self, L, layout: tuple, tensors: tuple[torch.Tensor, ...], is_qkv: bool):
        m, c = self.model, self.model.config
        # an example row count equal to no other size (a symbolic size equal to another at the
        # trace stays tied to it) and not 0 or 1 (which a symbolic trace specializes)
        sizes = {int(s) for t in tensors for s in t.shape} | {c.hidden_size, c.head_dim, c.num_heads,
                                                               c.num_kv_heads, c.q_size}
        T = next(n for n in range(5, 1 << 16) if n not in sizes)
        hidden = torch.zeros(T, c.hidden_size, dtype=m.dtype)
        if is_qkv:
            def graph_a(h, cos, sin, *ops):
                q, k, v = m.qkv_of(_shadow(L, layout, ops), h, cos, sin)
                return q.contiguous(), k.contiguous(), v.contiguous()

            rope = torch.zeros(T, c.head_dim, dtype=m.dtype)
            return compile_graph(graph_a, (hidden, rope, rope.clone(), *tensors), dynamic=True, serial=True)

        def graph_b(h, attn, *ops):
            return (m.finish_of(_shadow(L, layout, ops), h, attn),)

        attn = torch.zeros(T, c.num_heads, c.head_dim, dtype=m.dtype)
        return compile_graph(graph_b, (hidden, attn, *tensors), dynamic=True, serial=True)

    def _compile_attention(self):
        """Graph D, traced on symbolic sequence and context counts (any B, C; any cache size)."""
        m, c = self.model, self.model.config
        kvh, d = c.num_kv_heads, c.head_dim

        def graph_d(q, kc, vc, kv_index, mask):
            return (decode_attention(q, kc, vc, kv_index, mask, kvh),)

        # example sizes equal to no other (see compile_graph); 0 and 1 would be specialized
        B, C, S = 5, 37, 101
        q = torch.zeros(B, c.num_heads, d, dtype=m.dtype)
        kc = torch.zeros(S, kvh, d, dtype=m.dtype)
        return compile_graph(graph_d, (q, kc, kc.clone(), torch.zeros(B, C, dtype=torch.long),
                                  torch.zeros(B, C, dtype=m.dtype)), dynamic=True)

    def attend(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, kv_index: torch.Tensor,
               mask: torch.Tensor, cols: int | None = None) -> torch.Tensor:
        """Graph D: :func:`decode_attention` of ``q`` [B, Hq, d] (one query row per sequence)
        over the cache ``kc``/``vc`` [slots, kvh, d] at ``kv_index`` [B, C] (int64 slots) with the
        additive ``mask`` [B, C] (0 / -inf, model dtype) -> [B, Hq, d], model dtype; through the C++
        kernel where it loaded, else inductor's graph (compiled on first use). ``cols``: the
        context is the first ``cols`` columns (:attr:`laser.model.llama.AttnGroup.cols`; the C++
        kernel only)."""
        if self.attention_kernel is not None:
            return decode_attention_kernel(self.attention_kernel, q, kc, vc, kv_index, mask, cols)
        if cols is not None:
            raise ValueError("graph D: a group with spare columns needs the C++ kernel (AttnGroup.trimmed)")
        if self._attend is None:
            self._attend = _boxed(self._compile_attention())
        return self._attend([q.contiguous(), kc, vc, kv_index, mask])[0]

    def qkv(self, i: int, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Graph A of layer ``i``: as :meth:`LlamaModel.qkv` (hidden [T, H], cos/sin [T, head_dim],
        T <= :attr:`qkv_rows`) -> q [T, Hq, d], k and v [T, kvh, d], contiguous, model dtype."""
        fn, ops = self._qkv[i]
        return fn([hidden.contiguous(), cos.contiguous(), sin.contiguous(), *ops])

    def finish(self, i: int, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Graph B of layer ``i``: as :meth:`LlamaModel.finish_layer` (hidden [T, H], attn
        [T, Hq, d], T <= :attr:`finish_rows`) -> the new residual stream [T, H], model dtype."""
        fn, ops = self._finish[i]
        return fn([hidden.contiguous(), attn.contiguous(), *ops])[0]


def decode_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, kv_index: torch.Tensor,
                     mask: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Grouped-query attention of one query row per sequence over cached K/V (the reference
    graph D traces; plain softmax(q k^T / sqrt(d) + mask) v, Vaswani et al. 2017, in fp32).

    q [B, Hq, d] (Hq = ``kv_heads`` * g: query heads sharing a KV head are consecutive);
    kc, vc [slots, kv_heads, d]; kv_index [B, C] int64 cache slots of each sequence's positions
    (pads: any valid slot); mask [B, C] additive (0 = attend, -inf = pad; every row has at least
    one 0). Returns [B, Hq, d] in q's dtype. The products and sums run in fp32; the sums over C
    are written as reductions over a non-innermost dim (inductor loops them in position order), so
    masked pads past a sequence's context add exact zeros after its own terms.
    """
    B, Hq, d = q.shape
    g = Hq // kv_heads
    qf = q.view(B, kv_heads, g, d).float()
    k = kc[kv_index].float()  # [B, C, kvh, d]
    v = vc[kv_index].float()
    s = (qf[:, None] * k[:, :, :, None, :]).sum(-1) * (d ** -0.5) + mask.float()[:, :, None, None]  # [B, C, kvh, g]
    e = torch.exp(s - s.amax(1, keepdim=True))
    p = e / e.sum(1, keepdim=True)
    o = (p[..., None] * v[:, :, :, None, :]).sum(1)  # [B, kvh, g, d]
    return o.reshape(B, Hq, d).to(q.dtype)


def _boxed(fn):
    """``fn`` (inductor's compiled graph) as a call on one list of inputs (emptied by the call).
    Its inner callable where there is one (``current_callable``: the generated code behind the
    input-alignment check): the AOT runtime wrapper around it costs ~3.5 us a call (measured, 1
    thread), ~0.2 ms of a batch-1 step of 60 calls, and does nothing for these graphs (no
    autograd, no input mutated, no output aliasing an input)."""
    inner = getattr(fn, "current_callable", None)
    return inner if callable(inner) else (lambda args: fn(*args))


def eligible(model) -> str:
    """Why ``model`` cannot run fused decode layers (``""`` when it can): the model dtype must be
    bf16 or fp32 and every layer matmul a :class:`QuantLinear` on the aten kernel (bf16
    activations; an fp32 model's graphs cast around it)."""
    if model.dtype not in (torch.bfloat16, torch.float32):
        return f"{str(model.dtype).removeprefix('torch.')} activations; bf16 and fp32 only"
    for L in model.layers:
        for lin in (L.qkv, L.o, L.gate_up, L.down):
            if not isinstance(lin, QuantLinear) or lin.gemv is not None or lin.act_dtype != torch.bfloat16:
                return "a layer matmul not on the aten int4/int8 kernels"
    if min(lin.kernel_max_rows for L in model.layers for lin in (L.qkv, L.o, L.gate_up, L.down)) < 1:
        return "the dense matmul wins from one row"
    return ""


def prepare_fused(model) -> tuple[FusedDecode | None, str]:
    """The fused decode graphs of ``model`` (compiled now, or loaded from the on-disk cache), or
    None where ``$LASER_FUSED_DECODE`` is 0, the model is not :func:`eligible`, or compiling
    fails (a warning; eager then). Call after the kernels' row crossover is set
    (:func:`laser.model.kernel_rows.choose_kernel_rows`). Returns it and a sentence for the
    startup log ("" when the switch is off)."""
    if not fused_enabled():
        return None, ""
    why = eligible(model)
    if why:
        return None, f"decode layers eager ({why})"
    try:
        fused = FusedDecode(model)
    except Exception as e:  # noqa: BLE001 -- tracing and inductor raise many kinds; eager always works
        log.warning("fused decode layers unavailable (%s: %s); running them eager", type(e).__name__,
                    str(e).splitlines()[0] if str(e) else "")
        return None, "decode layers eager (compiling the fused graphs failed)"
    attention = ("torch's SDPA (the decode-attention kernel did not compile, and inductor's fp32 graph of it "
                 "measured slower than SDPA)" if not fused.decode_attention else
                 "a C++ kernel" if fused.attention_kernel is not None else "an inductor graph")
    return fused, (f"decode layers fused: norm+QKV+RoPE up to {fused.qkv_rows} rows and O+norm+MLP up to "
                   f"{fused.finish_rows} rows in inductor graphs, decode attention at any row count in "
                   f"{attention} ({fused.graphs} graphs, {fused.seconds:.1f} s "
                   f"to compile or load from the cache; LASER_FUSED_DECODE=0 for eager)")
