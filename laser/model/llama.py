"""Llama-family decoder with an explicit per-layer API.

Covers Llama 2/3, Qwen2 (QKV bias), Qwen3 (QK-norm), Mistral and SmolLM2: RMSNorm,
RoPE (any ``transformers`` rope type, incl. Llama-3 scaling), grouped-query attention,
SwiGLU MLP, tied or untied embeddings.

The per-layer API is what makes layer-level scheduling possible::

    hidden = model.embed(token_ids)                 # [T] int64 -> [T, H]
    hidden = model.forward_layer(i, hidden, meta)   # [T, H] -> [T, H], reads/writes layer i's KV
    logits = model.compute_logits(hidden)           # [R, H] -> [R, V] float32

``hidden`` is the residual stream between layers: exactly the state a paused request
keeps in the intermediate cache. Attention runs over ragged batches through
:class:`AttnMetadata` (built once per batch composition by the model runner).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ..core.config import ModelConfig
from .linear import GatedLinear, Linear, add_linear, gated_linear, pack_for_onednn, swiglu_of
from .kernel_rows import choose_kernel_rows, gated_dense_copy, rows_label
from .fused import prepare_fused
from .prefill import (MIN_ROWS, blocked_causal_attention, causal_through_flash, load_prefill_kernel,
                      uses_blocked_attention)
from .prefill_glue import PrefillGlue
from .prefill_kernel import prefill_attention_kernel
from .quant import QuantLinear, concat, prepare_decode_kernels
from .frozen_gemm import use_frozen_head

log = logging.getLogger(__name__)


@dataclass
class AttnGroup:
    """Padded attention for one group of sequences (decode tokens, or prefill chunks).

    ``Q`` = padded query length (1 for decode), ``C`` = padded context length.
    """

    # [B, Q] rows of the flat token dimension feeding each padded query slot (pads repeat a real row).
    q_index: torch.Tensor
    # [B, C] flat KV slots of every context position (pads point at slot 0, masked out).
    kv_index: torch.Tensor
    # [B, 1, G*Q, C] additive mask in the model dtype (0 = attend, -inf = masked; G = query
    # heads per KV head). None when ``causal``.
    mask: torch.Tensor | None
    # [R] positions in the flattened [B*Q] padded output that are real tokens...
    out_valid: torch.Tensor | None
    # ...and [R] the flat token rows they go to. ``None`` for both when no padding is needed.
    out_rows: torch.Tensor | None
    # Per-layer kv_index for layers whose block tables differ from the canonical ones.
    layer_kv_index: dict[int, torch.Tensor]
    # One sequence with no cached context: attend over its own new K/V with a causal kernel
    # (no gather, no explicit mask). ``q_index`` is then [1, Q] of contiguous rows.
    causal: bool = False
    # First row of ``q_index`` when its rows are one contiguous range (always for decode
    # groups and causal groups), so attention slices instead of gathering; else None.
    q_start: int | None = None
    # Prefill groups: per sequence (first row in the flat token dimension, cached positions before
    # the chunk, rows), the chunked-prefill form of the C++ prefill kernel; None for decode groups.
    chunks: tuple[tuple[int, int, int], ...] | None = None
    # Decode groups of a steady batch derived in place (laser.model.attn_steady): ``kv_index``
    # [B, L] and ``mask`` [B, 1, 1, L] hold the context in their first ``cols`` columns, the rest
    # is spare room (slot 0, masked); the C++ decode kernel reads the first ``cols`` only. None: C = L.
    cols: int | None = None

    def kv_index_for(self, layer: int) -> torch.Tensor:
        return self.layer_kv_index.get(layer, self.kv_index)

    def trimmed(self) -> "AttnGroup":
        """This group with ``kv_index``/``mask`` cut to their ``cols`` context columns (contiguous
        copies; the same values): for the attention paths other than the C++ decode kernel."""
        c, fmt = self.cols, torch.contiguous_format  # (clone: plain strides even at one row)
        return replace(self, kv_index=self.kv_index[:, :c].clone(memory_format=fmt),
                       mask=self.mask[..., :c].clone(memory_format=fmt), cols=None)


@dataclass
class AttnMetadata:
    """Attention inputs shared by every layer a batch composition runs (T = new tokens)."""

    cos: torch.Tensor  # [T, head_dim]
    sin: torch.Tensor  # [T, head_dim]
    slot_mapping: torch.Tensor  # [T] flat KV slots the new tokens are written to
    layer_slot_mapping: dict[int, torch.Tensor]  # overrides for layers with non-canonical tables
    groups: list[AttnGroup]

    def slots_for(self, layer: int) -> torch.Tensor:
        return self.layer_slot_mapping.get(layer, self.slot_mapping)


class _Layer:
    __slots__ = ("ln1", "qkv", "q_norm", "k_norm", "o", "ln2", "gate_up", "down")


class LlamaModel:
    """Weights and forward functions; no module hierarchy, no autograd.

    Args:
        config: model shape.
        weights: HF-named state dict (``model.layers.{i}.self_attn.q_proj.weight``, ...).
        dtype: compute dtype (float32 or bfloat16).
        quant: HF name -> :class:`~laser.model.quant.QWeight` for the linear weights served
            quantized (:func:`laser.model.loader.load_quantized`); those run through
            :class:`~laser.model.quant.QuantLinear`, the others through :class:`Linear`.
            None or empty: every weight dense in ``dtype``.
    Raises:
        KeyError: a required weight is missing (message names it).
    """

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                 quant: dict | None = None):
        self.config = config
        self.dtype = dtype
        c = config
        quant = quant or {}
        self.quant_kinds = sorted({q.kind for q in quant.values()})

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"weight {name!r} missing from checkpoint")
            return weights[name].to(dtype).contiguous()

        self.embed_w = w("model.embed_tokens.weight")
        self.norm_w = w("model.norm.weight")
        if c.tie_word_embeddings or "lm_head.weight" not in weights:
            self.lm_head_w = self.embed_w
        else:
            self.lm_head_w = w("lm_head.weight")
        def linear(names: list[str], bias: torch.Tensor | None = None, gated: bool = False):
            """One (fused) matmul over the weights ``names`` stacked by output rows; ``gated``: the
            MLP's gate and up, a :class:`GatedLinear` where :func:`gated_linear` builds one."""
            if all(n in quant for n in names):
                return QuantLinear(concat([quant[n] for n in names]), bias)
            stacked = torch.cat([w(n) for n in names]) if len(names) > 1 else w(names[0])
            return (gated_linear(stacked) if gated and bias is None else None) or Linear(stacked, bias)

        self.layers: list[_Layer] = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            L = _Layer()
            L.ln1 = w(p + "input_layernorm.weight")
            L.ln2 = w(p + "post_attention_layernorm.weight")
            L.qkv = linear([p + f"self_attn.{n}_proj.weight" for n in "qkv"],
                           torch.cat([w(p + f"self_attn.{n}_proj.bias") for n in "qkv"]) if c.qkv_bias else None)
            L.q_norm = w(p + "self_attn.q_norm.weight") if c.qk_norm else None
            L.k_norm = w(p + "self_attn.k_norm.weight") if c.qk_norm else None
            L.o = linear([p + "self_attn.o_proj.weight"])
            L.gate_up = linear([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], gated=True)
            L.down = linear([p + "mlp.down_proj.weight"])
            self.layers.append(L)
        self._init_lm_head(quant, dtype)
        self.kv: torch.Tensor | None = None
        # decode rows through compiled graphs of the glue around the quantized matmuls
        # (laser.model.fused.FusedDecode); None: every row runs the eager methods
        self.fused = None
        # bf16 causal prefill groups through blocked matmuls (laser.model.prefill), not the flash kernel
        self.blocked_attn = uses_blocked_attention(dtype)
        # ... or, where it loads (AVX512-BF16), through one C++ kernel (laser.model.prefill_kernel)
        self.prefill_kernel = load_prefill_kernel(dtype, self.config.head_dim) if self.blocked_attn else None
        # ... but on a CPU with AMX (LASER_PREFILL_ATTN auto -> amx) whole prompts through torch's flash
        # kernel, whose products run as AMX tile GEMMs; chunks over cached context keep the C++ kernel
        self.causal_flash = causal_through_flash(dtype)
        # bf16 prefill rows: RMSNorm, RoPE and SiLU * up as inductor graphs (laser.model.prefill_glue)
        self.glue = self._prefill_glue() if dtype == torch.bfloat16 else None
        self._init_rope()
        qlins = [m for L in self.layers for m in (L.qkv, L.o, L.gate_up, L.down) if isinstance(m, QuantLinear)]
        if self.lm_head_q is not None:
            qlins.append(self.lm_head_q)
        if qlins:
            log.info(prepare_decode_kernels(qlins))
            msg = use_frozen_head(self.lm_head_q, dtype)
            if msg:
                log.info(msg)
            log.info(choose_kernel_rows(qlins, dtype))
            for L in self.layers:  # the int4 gate/up's dense copy (prefill rows) as two halves
                if isinstance(L.gate_up, QuantLinear):
                    gated_dense_copy(L.gate_up, dtype)
            self.fused, msg = prepare_fused(self)
            if msg:
                log.info(msg)
        # bf16 MLP rows through GatedLinear (SiLU(gate) * up in the matmul epilogues): the dense gate/up,
        # or the int4 gate/up's dense copy for rows past its crossover (laser.model.linear.gated_mode)
        self.gated_mlp = any(isinstance(m, GatedLinear) or isinstance(getattr(m, "dense", None), GatedLinear)
                             for m in (L.gate_up for L in self.layers))
        if self.causal_flash:
            log.info("bf16 prefill attention: torch's flash kernel (SDPA: AMX tile GEMMs) for whole prompts, %s for "
                     "chunks over cached context (chosen from the CPU flags: AMX; LASER_PREFILL_ATTN=kernel for the "
                     "C++ kernel everywhere)", "the C++ kernel" if self.prefill_kernel is not None else "SDPA")
        elif self.prefill_kernel is not None:
            log.info("bf16 prefill attention: the C++ kernel (AVX512-BF16, no AMX; LASER_PREFILL_ATTN=blocked for "
                     "blocked matmuls, sdpa for the flash kernel, amx for the flash kernel on whole prompts)")
        elif self.blocked_attn:
            log.info("bf16 prefill attention: blocked matmuls from %d rows (LASER_PREFILL_ATTN=sdpa for the flash "
                     "kernel)", MIN_ROWS)
        if self.gated_mlp:
            log.info("bf16 MLP: SiLU(gate) * up in the epilogues of two oneDNN matmuls (gate and up packed apart) "
                     "for %s (chosen from the CPU flags: AMX; LASER_GATED_MLP=off for the stacked matmul and a "
                     "separate SiLU * up)", "every row" if isinstance(self.layers[0].gate_up, GatedLinear)
                     else "the rows past the int4 crossover")
        if self.glue is not None:
            log.info("bf16 prefill glue (RMSNorm, RoPE, SiLU * up) compiled by inductor from %d rows "
                     "(LASER_PREFILL_GLUE=0 for eager)", self.glue.min_rows)
        self._init_executor_path(qlins)

    def _prefill_glue(self) -> PrefillGlue | None:
        """The compiled prefill glue for this model's shape (:class:`PrefillGlue`), or None."""
        c = self.config
        eps, heads, d = c.rms_norm_eps, c.num_heads + c.num_kv_heads, c.head_dim

        def norm(x, w):
            return _rms_norm(x, w, eps)

        def swiglu(gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return F.silu(gate) * up

        key = (c.hidden_size, c.q_size + 2 * c.kv_size, heads, d, c.intermediate_size, eps)
        return PrefillGlue.get(key, norm, _rope, swiglu, c.hidden_size, key[1], heads, d, c.intermediate_size)

    def _init_lm_head(self, quant: dict, dtype: torch.dtype) -> None:
        """The LM head's layouts (below); sets ``lm_head_q``, ``lm_head_packed``, ``lm_head_t``."""
        # LM head layouts: the plain [V, H] weight is read with a dot product per vocabulary
        # row (and, for M > 1, packed anew by MKL on every call: a full copy of the head).
        # One row reads the transposed copy [H, V] as an axpy stream; more rows use a oneDNN
        # copy packed once at load. Measured on a 2-core AVX2 CPU (fp32, 49k x 576 head):
        # 2.3-3x faster at 1 row, 1.7-2.2x at 2-32 rows. Costs two more copies of the head.
        # bf16 (where pack_for_onednn packs it): the packed copy serves one row too, one more
        # copy in all (measured on an AVX512-BF16 EPYC, 1 thread, 49k x 576: 4.9 ms against 11.6
        # for the transposed copy at 1 row, 6.4 vs 14.2 at 8 rows, bit-equal logits).
        # A quantized head (``quant["lm_head.weight"]``) runs through QuantLinear instead.
        self.lm_head_q = QuantLinear(quant["lm_head.weight"]) if "lm_head.weight" in quant else None
        if self.lm_head_q is None:
            self.lm_head_packed = pack_for_onednn(self.lm_head_w, batch_hint=32)
            packed_only = self.lm_head_packed is not None and dtype == torch.bfloat16
            self.lm_head_t = None if packed_only else self.lm_head_w.t().contiguous()  # [H, V]

    def _init_executor_path(self, qlins: list) -> None:
        """Names the executor path (the profile key, ``laser.profiler.executor_path_of``) from
        the kernels chosen at load; logs the bf16 weight layout."""
        # "tmpl-int8": the int8 LM head through inductor's C++ GEMM template (laser.model.frozen_gemm)
        parts = [] if not qlins else ["compiled-int8" if any(m.gemv is not None for m in qlins) else "",
                                      "tmpl-int8" if any(m.frozen is not None for m in qlins) else "",
                                      rows_label(qlins)]
        # bf16 Linear weights in oneDNN's packed layout for every row count (Linear's docstring)
        mats = [m for L in self.layers for m in (L.qkv, L.o, L.gate_up, L.down)]
        packed = any(isinstance(m, Linear) and not m.sliceable for m in mats)
        if packed:
            log.info("bf16 weights: oneDNN-packed for every row count (LASER_PACKED_WEIGHTS=off for F.linear)")
        # "dattn": decode attention through graph D, "-cpp" its C++ kernel, bf16 or fp32 (a profile timed
        # before either prices slower steps)
        # "pattn": bf16 prefill attention through blocked matmuls, "-cpp" through the C++ kernel, "-amx"
        # whole prompts through the flash kernel (AMX) and chunks through the C++ kernel
        # "gmlp": SiLU(gate) * up in the gate/up matmuls' epilogues (laser.model.linear.GatedLinear)
        pattn = "-amx" if self.causal_flash else "-cpp" if self.prefill_kernel is not None else ""
        # "cglue": bf16 prefill glue compiled (laser.model.prefill_glue)
        parts += ["pw" if packed else "", "gmlp" if self.gated_mlp else "", "cglue" if self.glue is not None else "",
                  "" if not self.blocked_attn else "pattn" + pattn,
                  "" if self.fused is None else "fused" + ("" if not self.fused.decode_attention else
                                                           "-dattn-cpp" if self.fused.attention_kernel is not None
                                                           else "-dattn")]
        # another machine to the latency model: its own profile (laser.profiler.executor_path_of)
        path = "-".join(p for p in parts if p)
        if path:
            self.executor_path = path

    def _init_rope(self) -> None:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        hf = self.config.hf_config
        params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "default":
            theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
            d = self.config.head_dim
            inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
        pos = torch.arange(self.config.max_position, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq.float())
        emb = torch.cat([freqs, freqs], dim=-1)
        self.rope_cos = (emb.cos() * scaling).to(self.dtype)  # [max_position, head_dim]
        self.rope_sin = (emb.sin() * scaling).to(self.dtype)

    def bind_kv_cache(self, kv: torch.Tensor) -> None:
        """Attend over ``kv`` [layers, 2, slots, kv_heads, head_dim] (the KV cache tensor); each
        layer's K and V views are made once here (two selects each cost ~4 us a layer call)."""
        self.kv = kv
        self._kv_layers = [(kv[i, 0], kv[i, 1]) for i in range(kv.shape[0])]

    # -- per-layer API -----------------------------------------------------------------------
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[T] int64 -> [T, H] hidden states."""
        return F.embedding(token_ids, self.embed_w)

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """RMSNorm of ``x`` [..., H] with weight ``w`` [H] (:func:`_rms_norm`); rows [T, H] of a bf16
        prefill through the compiled glue (:attr:`glue`)."""
        if self.glue is not None and x.dim() == 2 and self.glue.takes(x, x):
            return self.glue.norm(x, w)
        return _rms_norm(x, w, self.config.rms_norm_eps)

    def forward_layer(self, i: int, hidden: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        """Run decoder layer ``i`` on ``hidden`` [T, H]; writes the T new tokens' K/V of layer i.

        Returns the new residual stream [T, H] (same dtype). Three pieces, each also timed on
        its own by the profiler: :meth:`qkv` (stateless), :meth:`attend` (KV write + kernel),
        :meth:`finish_layer` (stateless).
        """
        q, k, v = self.qkv(i, hidden, meta.cos, meta.sin)
        return self.finish_layer(i, hidden, self.attend(i, q, k, v, meta))

    def qkv(self, i: int, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Norm, fused QKV projection (one matmul), QK-norm, RoPE on q and k together.

        hidden [T, H]; cos/sin [T, head_dim]. Returns q [T, Hq, d], k [T, kvh, d],
        v [T, kvh, d] (views, not necessarily contiguous), the model's dtype. Up to
        ``fused.qkv_rows`` rows run the compiled graph of :attr:`fused` instead (quantized layers).
        """
        if self.fused is not None and hidden.shape[0] <= self.fused.qkv_rows:
            return self.fused.qkv(i, hidden, cos, sin)
        return self.qkv_of(self.layers[i], hidden, cos, sin)

    def qkv_of(self, L: _Layer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """:meth:`qkv` eagerly with the weights of ``L`` (a layer of this model, or one whose
        tensors a fused graph traces: :mod:`laser.model.fused`)."""
        c = self.config
        T = hidden.shape[0]
        nh, kvh, d = c.num_heads, c.num_kv_heads, c.head_dim
        qkv = L.qkv(self._norm(hidden, L.ln1))  # [T, (Hq + 2 kvh) d]
        v = qkv[:, c.q_size + c.kv_size :].view(T, kvh, d)
        if L.q_norm is None:
            # one RoPE over the q and k heads side by side: [T, Hq + kvh, d]
            qk = qkv[:, : c.q_size + c.kv_size].view(T, nh + kvh, d)
            if self.glue is not None and self.glue.takes(qk, cos, sin):  # qk: the view the graph was compiled for
                qk = self.glue.rope(qk, cos, sin)
            else:
                qk = _rope(qk, cos, sin)
            return qk[:, :nh], qk[:, nh:], v
        q = self._norm(qkv[:, : c.q_size].view(T, nh, d), L.q_norm)
        k = self._norm(qkv[:, c.q_size : c.q_size + c.kv_size].view(T, kvh, d), L.k_norm)
        return _rope(q, cos, sin), _rope(k, cos, sin), v

    def kv_projection(self, i: int, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Layer ``i``'s K and V of ``hidden`` [T, H] alone: norm, the K/V rows of the fused QKV
        projection, QK-norm and RoPE on k (no query, attention or MLP). cos/sin [T, head_dim].
        Returns k, v [T, kvh, d] in the model's dtype: what :meth:`qkv` returns for them. What an
        early exit writes into the layers it skips (CALM's KV propagation, Schuster et al.
        NeurIPS'22 §3.2; :meth:`laser.model.runner.ModelRunner.early_exit`)."""
        c = self.config
        L = self.layers[i]
        T = hidden.shape[0]
        kvh, d = c.num_kv_heads, c.head_dim
        x = self._norm(hidden, L.ln1)
        lin = L.qkv
        if isinstance(lin, Linear):
            kv = lin.columns(x, c.q_size)
        else:  # quantized: the fused matmul, the K/V part kept
            kv = lin(x)[:, c.q_size:]
        k = kv[:, : c.kv_size].view(T, kvh, d)
        v = kv[:, c.kv_size :].view(T, kvh, d)
        if L.k_norm is not None:
            k = self._norm(k, L.k_norm)
        return _rope(k, cos, sin), v

    def attend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        """Write the new tokens' K/V [T, kvh, d] into layer ``i``'s cache slots, then attend.

        Returns [T, Hq, d] (see :meth:`_attention`).
        """
        kc, vc = self._kv_layers[i]
        slots = meta.slots_for(i)
        kc.index_copy_(0, slots, k)  # index_copy_ is a row memcpy; kc[slots] = k is elementwise
        vc.index_copy_(0, slots, v)
        return self._attention(i, q, k, v, kc, vc, meta)

    def finish_layer(self, i: int, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """O projection + residual, norm, fused gate/up matmul, SwiGLU in place, down + residual.

        hidden [T, H], attn [T, Hq, d] -> new residual stream [T, H]. Up to
        ``fused.finish_rows`` rows run the compiled graph of :attr:`fused` instead (quantized layers).
        """
        if self.fused is not None and hidden.shape[0] <= self.fused.finish_rows:
            return self.fused.finish(i, hidden, attn)
        return self.finish_of(self.layers[i], hidden, attn)

    def finish_of(self, L: _Layer, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """:meth:`finish_layer` eagerly with the weights of ``L`` (see :meth:`qkv_of`)."""
        T = hidden.shape[0]
        hidden = add_linear(L.o, attn.reshape(T, self.config.q_size), hidden)
        x = self._norm(hidden, L.ln2)
        act = swiglu_of(L.gate_up, x)  # [T, I] from the matmul epilogues (GatedLinear), or None
        if act is not None:
            return add_linear(L.down, act, hidden)
        gate_up = L.gate_up(x)  # [T, 2 I]
        if self.glue is not None and self.glue.takes(gate_up, gate_up):
            act = self.glue.swiglu(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate, inplace=True).mul_(up)  # in the gate half of gate_up: no new [T, I] tensors
        return add_linear(L.down, act, hidden)

    def _attention(self, i, q, k, v, kc, vc, meta: AttnMetadata) -> torch.Tensor:
        """Grouped-query attention over ragged sequences: q [T, Hq, d] -> [T, Hq, d].

        ``k``/``v`` [T, kv_heads, d] are the new tokens' (already in the cache ``kc``/``vc``).
        Each group reads its padded context with ``index_select`` (a row gather, several
        times faster than advanced indexing here) and masks the pads with an additive mask
        built once per batch composition. A group whose query rows are one contiguous range
        (decode rows always are) reads and writes them as a slice, without copies. Decode
        groups of a fused model (bf16) run graph D of :attr:`fused` instead, which gathers the
        context inside its kernel (:meth:`laser.model.fused.FusedDecode.attend`).
        """
        if len(meta.groups) == 1 and meta.groups[0].out_rows is None:
            out = None  # filled directly below
        else:
            out = torch.empty(q.shape, dtype=q.dtype)
        for grp in meta.groups:
            B, Q = grp.q_index.shape
            if grp.causal:
                a = grp.q_start
                if self.prefill_kernel is not None and not self.causal_flash:
                    o = prefill_attention_kernel(self.prefill_kernel, q[a : a + Q], k[a : a + Q], v[a : a + Q])
                elif self.blocked_attn and not self.causal_flash and Q >= MIN_ROWS:
                    o = blocked_causal_attention(q[a : a + Q], k[a : a + Q], v[a : a + Q])
                else:
                    qs = q[a : a + Q].transpose(0, 1).unsqueeze(0)  # [1, Hq, Q, d]
                    ks = k[a : a + Q].transpose(0, 1).unsqueeze(0)  # [1, kvh, Q, d]
                    vs = v[a : a + Q].transpose(0, 1).unsqueeze(0)
                    o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
                    o = o[0].transpose(0, 1)  # [Q, Hq, d]
                if out is None:
                    return o
                out[a : a + Q] = o
                continue
            f = self.fused
            dec = Q == 1 and f is not None and f.decode_attention and grp.q_start is not None
            if grp.cols is not None and not (dec and f.attention_kernel is not None):
                grp = grp.trimmed()
            kv_idx = grp.kv_index_for(i).view(-1)
            C = kv_idx.shape[0] // B
            if dec:  # decode rows: graph D
                o = f.attend(q[grp.q_start : grp.q_start + B], kc, vc, kv_idx.view(B, C), grp.mask.view(B, C),
                             grp.cols)
            elif grp.chunks is not None and self.prefill_kernel is not None:  # chunks over cached context
                out = out if out is not None else torch.empty(q.shape, dtype=q.dtype)
                self._chunks_through_kernel(grp, q, kc, vc, kv_idx.view(B, C), out)
                continue
            else:
                o = self._sdpa_group(grp, q, kc, vc, kv_idx, B, Q, C)
            if out is None:
                return o
            if grp.out_rows is not None:
                out[grp.out_rows] = o[grp.out_valid]
            elif grp.q_start is not None:
                out[grp.q_start : grp.q_start + B * Q] = o
            else:
                out[grp.q_index.view(-1)] = o
        return out

    def _chunks_through_kernel(self, grp: AttnGroup, q, kc, vc, kv_idx: torch.Tensor, out: torch.Tensor) -> None:
        """A prefill group's chunks one sequence at a time through the C++ prefill kernel, reading
        their cached context by slot (kv_idx [B, C]); writes their rows of ``out`` [T, Hq, d]."""
        for b, (row, before, n) in enumerate(grp.chunks):
            out[row : row + n] = prefill_attention_kernel(self.prefill_kernel, q[row : row + n], kc, vc,
                                                          slots=kv_idx[b, : before + n])

    def _sdpa_group(self, grp: AttnGroup, q, kc, vc, kv_idx, B: int, Q: int, C: int) -> torch.Tensor:
        """One padded group through torch's SDPA: q [T, Hq, d] (the group's rows read from it),
        kv_idx [B*C] slots -> [B*Q, Hq, d]."""
        c = self.config
        kvh, d = c.num_kv_heads, c.head_dim
        g = c.num_heads // kvh
        if grp.q_start is not None:
            qr = q[grp.q_start : grp.q_start + B * Q]
        else:
            qr = q.index_select(0, grp.q_index.view(-1))
        # [B, Q, kvh, g, d] -> [B, kvh, g*Q, d]: query heads sharing a KV head are stacked
        qg = qr.reshape(B, Q, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(B, kvh, g * Q, d)
        kg = kc.index_select(0, kv_idx).view(B, C, kvh, d).transpose(1, 2)  # [B, kvh, C, d]
        vg = vc.index_select(0, kv_idx).view(B, C, kvh, d).transpose(1, 2)
        o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=grp.mask)
        return o.view(B, kvh, g, Q, d).permute(0, 3, 1, 2, 4).reshape(B * Q, c.num_heads, d)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, H] last-position hidden states -> [R, V] float32 logits (final norm + LM head)."""
        x = self._norm(hidden, self.norm_w)
        if self.lm_head_q is not None:
            logits = self.lm_head_q(x)
        elif x.shape[0] == 1 and self.lm_head_t is not None:
            logits = torch.mm(x, self.lm_head_t)
        elif self.lm_head_packed is not None:
            logits = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.lm_head_packed, None, "none", [], "")
        else:
            logits = F.linear(x, self.lm_head_w)
        return logits.float()

    # -- cost estimates ------------------------------------------------------------------------
    def weight_bytes(self) -> int:
        """Bytes of weights one full forward step reads (layers' matmuls + LM head; quantized
        weights at their packed size)."""
        es = self.lm_head_w.element_size()
        mats = [m for L in self.layers for m in (L.qkv, L.o, L.gate_up, L.down)]
        mats.append(self.lm_head_q if self.lm_head_q is not None else None)
        n = sum(m.nbytes() if isinstance(m, QuantLinear) else m.numel() * es for m in mats if m is not None)
        return n + (0 if self.lm_head_q is not None else self.lm_head_w.numel() * es)

    @property
    def weights_tag(self) -> str:
        """The executor's weight format, e.g. ``float32`` or ``float32-int4`` (what latency depends
        on beyond the shape: a latency profile is keyed by it)."""
        name = str(self.dtype).removeprefix("torch.")
        return "-".join([name, *self.quant_kinds])


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` with weight ``w`` (HF's order in bf16: normalised in fp32,
    rounded to the dtype, then times the weight)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * w


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, HF "rotate_half" convention. x [T, heads, d]; cos/sin [T, d]."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin
