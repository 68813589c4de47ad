"""Latency models without a profile: explicit constants for tests, and a roofline estimate.

* :class:`SimpleLatencyModel`: a few explicit constants, for tests with a fake clock.
* :class:`AnalyticLatencyModel`: a roofline *estimate* from the model shape
  (:class:`ModelShape`) and a hardware table (:class:`HardwareSpec`), for hardware we
  cannot profile (A100/H100/H200) and for schedulers before a profile exists.

Torch-free, numpy-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .base import LatencyModel


# --------------------------------------------------------------------------------------
# Simple model (tests with a fake clock)


@dataclass
class SimpleLatencyModel(LatencyModel):
    """``layer = per_layer + per_token·n + per_context·Σc``; ``embed = per_embed_token·n``;
    ``head = head_const + per_head_row·rows`` (0 for 0 rows). Exact, easy numbers for tests."""

    num_layers: int
    per_layer: float = 1e-3
    per_token: float = 1e-5
    per_context: float = 0.0
    per_embed_token: float = 0.0
    head_const: float = 0.0
    per_head_row: float = 0.0

    @property
    def layer_overhead_s(self) -> float:  # type: ignore[override]
        return self.per_layer

    def stateless_time(self, n_tokens: int) -> float:
        return self.per_token * n_tokens if n_tokens > 0 else 0.0

    def attention_time(self, query_lens, context_lens) -> float:
        return self.per_context * sum(context_lens)

    def embed_time(self, n_tokens: int) -> float:
        return self.per_embed_token * n_tokens if n_tokens > 0 else 0.0

    def head_time(self, n_rows: int) -> float:
        return self.head_const + self.per_head_row * n_rows if n_rows > 0 else 0.0


# --------------------------------------------------------------------------------------
# Analytic (roofline) model — an ESTIMATE, not a measurement.


@dataclass(frozen=True)
class ModelShape:
    """Shape of a llama-family decoder (gated MLP, GQA)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tie_embeddings: bool = False

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelShape":
        """From a HF ``config.json`` dict (``text_config`` is used when present)."""
        cfg = cfg.get("text_config", cfg)
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(
            hidden=hidden,
            layers=int(cfg["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate=int(cfg["intermediate_size"]),
            vocab=int(cfg["vocab_size"]),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )

    @classmethod
    def preset(cls, name: str) -> "ModelShape":
        try:
            return MODEL_SHAPES[name.lower()]
        except KeyError:
            raise KeyError(f"unknown model shape {name!r}; known: {sorted(MODEL_SHAPES)}") from None

    def layer_params(self) -> int:
        """Weights of one decoder layer (norms ignored)."""
        h, d = self.hidden, self.head_dim
        return h * (self.heads + 2 * self.kv_heads) * d + self.heads * d * h + 3 * h * self.intermediate

    def num_params(self) -> int:
        emb = self.vocab * self.hidden
        return self.layers * self.layer_params() + emb * (1 if self.tie_embeddings else 2)


MODEL_SHAPES = {
    "qwen2.5-14b": ModelShape(5120, 48, 40, 8, 128, 13824, 152064),
    "qwen2.5-32b": ModelShape(5120, 64, 40, 8, 128, 27648, 152064),
    "llama-3-70b": ModelShape(8192, 80, 64, 8, 128, 28672, 128256),
    "smollm2-135m": ModelShape(576, 30, 9, 3, 64, 1536, 49152, tie_embeddings=True),
}


@dataclass(frozen=True)
class HardwareSpec:
    """Per-device peak numbers (vendor datasheets; dense, no sparsity)."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s
    mem_bw: float  # HBM/DRAM bytes/s
    link_bw: float  # interconnect bytes/s per direction per device (NVLink)
    link_latency_s: float  # fixed cost of one collective
    layer_overhead_s: float  # kernel launches / framework per layer call


HARDWARE = {
    "a100-80gb": HardwareSpec("a100-80gb", 312e12, 2.039e12, 300e9, 10e-6, 20e-6),
    "h100-sxm": HardwareSpec("h100-sxm", 989e12, 3.35e12, 450e9, 8e-6, 15e-6),
    "h200": HardwareSpec("h200", 989e12, 4.8e12, 450e9, 8e-6, 15e-6),
    # A rough 2-core CPU running the Python executor: bf16 matmuls with AMX-class
    # throughput, ~20 GB/s DRAM, ~0.15 ms of Python/dispatch per layer call.
    "cpu-2core": HardwareSpec("cpu-2core", 2e11, 20e9, 1e12, 0.0, 1.5e-4),
}


class AnalyticLatencyModel(LatencyModel):
    """Roofline estimate: each module costs ``max(FLOPs/(peak·flops_eff), bytes/(bw·bw_eff))``
    per device, under tensor parallelism ``tp`` (weights, heads and FLOPs split ``tp``
    ways; two ring all-reduces of the hidden states per layer, ``2·(tp−1)/tp·bytes /
    link_bw + latency`` each). Plus the hardware's per-layer-call overhead.

    This is an estimate for planning and simulation, not a measurement: it ignores
    kernel efficiency curves, tile quantisation, and overlap. Fit a profile for real numbers.
    """

    #: Token counts whose stateless time is memoised (the simulator asks for the same few again and again).
    STATELESS_MEMO = 1 << 16

    def __init__(self, shape: ModelShape | str, hardware: HardwareSpec | str = "h200", *, tp: int = 1,
                 dtype_bytes: int = 2, flops_efficiency: float = 0.7, bw_efficiency: float = 0.85,
                 layer_overhead_s: float | None = None):
        self.shape = ModelShape.preset(shape) if isinstance(shape, str) else shape
        if isinstance(hardware, str):
            try:
                hardware = HARDWARE[hardware.lower()]
            except KeyError:
                raise KeyError(f"unknown hardware {hardware!r}; known: {sorted(HARDWARE)}") from None
        if tp < 1 or not (0 < flops_efficiency <= 1) or not (0 < bw_efficiency <= 1):
            raise ValueError("need tp >= 1 and efficiencies in (0, 1]")
        self.hardware, self.tp, self.dtype_bytes = hardware, tp, dtype_bytes
        self.num_layers = self.shape.layers
        self.layer_overhead_s = hardware.layer_overhead_s if layer_overhead_s is None else layer_overhead_s
        s, t, db = self.shape, tp, dtype_bytes
        F = hardware.peak_flops * flops_efficiency  # FLOP/s
        BW = hardware.mem_bw * bw_efficiency  # bytes/s
        self._F, self._BW = F, BW
        h, d = s.hidden, s.head_dim
        heads_dev = s.heads / t
        kv_dev = max(s.kv_heads / t, 1.0)  # KV heads are replicated when tp > kv_heads

        # Linear modules: (name, in_features, out_features per device) on n tokens.
        #   per token: 2·in·out FLOPs; weight in·out·db bytes; activations (in + out)·db bytes.
        mods = [("qkv", h, (heads_dev + 2 * kv_dev) * d), ("o", heads_dev * d, h),
                ("mlp_up_gate", h, 2 * s.intermediate / t), ("mlp_down", s.intermediate / t, h)]
        # (name, seconds per token of compute, fixed seconds of weight reads, seconds per token of activation traffic)
        self._mods = tuple((nm, 2 * i * o / F, i * o * db / BW, (i + o) * db / BW) for nm, i, o in mods)
        self._norm_tok = 2 * 2 * h * db / BW  # two RMSNorms: read + write each
        # Attention per device: 4·H_dev·d FLOPs per (query, key) pair; K and V reads per
        # context token; q and output per query token.
        self._attn_pair = 4 * heads_dev * d / F
        self._attn_ctx = 2 * kv_dev * d * db / BW
        self._attn_tok = 2 * heads_dev * d * db / BW
        # Two all-reduces of n·h·db bytes per layer.
        if t > 1:
            self._ar_tok = 2 * (2 * (t - 1) / t) * h * db / hardware.link_bw
            self._ar_const = 2 * hardware.link_latency_s
        else:
            self._ar_tok = self._ar_const = 0.0
        # LM head (vocab-parallel): 2·h·V/t FLOPs per row, h·V/t·db weight bytes.
        self._head = (2 * h * s.vocab / t / F, h * s.vocab / t * db / BW, (h + s.vocab / t) * db / BW)
        self._embed_tok = 2 * h * db / BW
        self._stateless: dict[int, float] = {}  # n_tokens -> stateless_time (memo)

    def breakdown(self, query_lens: Sequence[int], context_lens: Sequence[int]) -> dict[str, tuple[float, str]]:
        """Per module of one layer call: ``(seconds, "compute" | "memory" | "network")``."""
        n = sum(query_lens)
        out = {}
        for nm, fl, w, act in self._mods:
            c, m = fl * n, w + act * n
            out[nm] = (max(c, m), "compute" if c > m else "memory")
        pairs = sum(q * c - q * (q - 1) // 2 for q, c in zip(query_lens, context_lens))
        c, m = self._attn_pair * pairs, self._attn_ctx * sum(context_lens) + self._attn_tok * n
        out["attention"] = (max(c, m), "compute" if c > m else "memory")
        out["norms"] = (self._norm_tok * n, "memory")
        out["allreduce"] = ((self._ar_tok * n + self._ar_const) if n else 0.0, "network")
        return out

    def stateless_time(self, n_tokens: int) -> float:
        t = self._stateless.get(n_tokens)
        if t is not None:
            return t
        if n_tokens <= 0:
            return 0.0
        t = self._norm_tok * n_tokens + self._ar_tok * n_tokens + self._ar_const
        for _, fl, w, act in self._mods:
            c, m = fl * n_tokens, w + act * n_tokens
            t += c if c > m else m
        if len(self._stateless) < self.STATELESS_MEMO:
            self._stateless[n_tokens] = t  # a pure function of n_tokens: the same float every time
        return t

    def attention_time(self, query_lens, context_lens) -> float:
        b = len(query_lens)
        if not b:
            return 0.0
        n = sum(query_lens)
        if n == b:
            pairs = sc = sum(context_lens)
        else:
            sc = sum(context_lens)
            pairs = sum(q * c - q * (q - 1) // 2 for q, c in zip(query_lens, context_lens))
        c = self._attn_pair * pairs
        m = self._attn_ctx * sc + self._attn_tok * n
        return c if c > m else m

    def embed_time(self, n_tokens: int) -> float:
        return self._embed_tok * n_tokens if n_tokens > 0 else 0.0

    def head_time(self, n_rows: int) -> float:
        if n_rows <= 0:
            return 0.0
        fl, w, act = self._head
        return max(fl * n_rows, w + act * n_rows)
