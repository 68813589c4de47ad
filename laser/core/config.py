"""Frozen configuration objects, validated in ``__post_init__`` and never mutated later."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


class ConfigError(ValueError):
    """A configuration value is invalid (message says which and why)."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder, read from a Hugging Face config.

    Covers Llama 2/3 (incl. Llama-3 RoPE scaling), Qwen2 (QKV bias), Qwen3 (QK-norm),
    Mistral (without sliding window) and SmolLM2.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...] = ()
    # The transformers config object; used for RoPE initialisation (incl. scaling types).
    hf_config: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {self.model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads {self.num_heads} not a multiple of num_kv_heads {self.num_kv_heads}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token_per_layer(self, dtype_bytes: int) -> int:
        """Bytes of K and V one token occupies in one layer."""
        return 2 * self.kv_size * dtype_bytes

    def layer_flops(self, num_tokens: int, sum_context: int) -> float:
        """Approximate FLOPs of one decoder layer: projections/MLP (2·params·n) plus attention (4·d·Σ q·c)."""
        h, i = self.hidden_size, self.intermediate_size
        params = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i
        return 2.0 * params * num_tokens + 4.0 * self.q_size * sum_context

    @classmethod
    def from_hf(cls, hf_config) -> "ModelConfig":
        """Build from a ``transformers.PretrainedConfig``. Raises ConfigError for unsupported models."""
        c = hf_config
        mt = getattr(c, "model_type", None)
        # Sliding-window attention (Mistral v0.1) is not implemented: full attention is used.
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        eos = getattr(c, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        return cls(
            model_type=mt,
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_layers=c.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=float(c.rms_norm_eps),
            max_position=int(getattr(c, "max_position_embeddings", 4096)),
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            qkv_bias=bool(getattr(c, "attention_bias", False)) or mt == "qwen2",
            qk_norm=mt == "qwen3",
            eos_token_ids=eos_ids,
            hf_config=c,
        )


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing."""

    block_size: int = 16  # tokens per block
    kv_cache_gib: float = 1.0  # total pool size over all layers, GiB
    num_blocks: int | None = None  # per layer; overrides kv_cache_gib when set
    # Capacity of the intermediate (paused hidden state) cache, tokens.
    # Paper §6.1: 16,384 on prefill instances, 2,048 on decode instances.
    intermediate_cache_tokens: int = 16384
    # Automatic prefix caching (laser.core.block_manager): reuse the KV of full prompt blocks computed
    # before (vLLM's enable_prefix_caching; on by default as in vLLM v1).
    enable_prefix_caching: bool = True

    def __post_init__(self):
        if self.block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {self.block_size}")
        if self.num_blocks is None and not (math.isfinite(self.kv_cache_gib) and self.kv_cache_gib > 0):
            raise ConfigError(f"kv_cache_gib must be a positive number, got {self.kv_cache_gib}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ConfigError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.intermediate_cache_tokens <= 0:
            raise ConfigError("intermediate_cache_tokens must be positive")

    def blocks_per_layer(self, model: ModelConfig, dtype_bytes: int) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        per_block_all_layers = model.kv_bytes_per_token_per_layer(dtype_bytes) * self.block_size * model.num_layers
        n = int(self.kv_cache_gib * (1 << 30)) // per_block_all_layers
        if n < 1:
            raise ConfigError(f"kv_cache_gib={self.kv_cache_gib} is too small for one block")
        return n


ROLES = ("mixed", "prefill", "decode")
QUEUE_ORDERS = ("edf", "fcfs")


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduling policy and its knobs (one instance)."""

    policy: str = "laser"  # a name registered in laser.scheduler (vllm, sarathi, laser)
    queue_order: str = "edf"  # edf: by arrival + TTFT target; fcfs: by arrival
    role: str = "mixed"  # mixed | prefill | decode
    max_num_seqs: int = 256  # running requests at most
    # Token budget of one iteration: Sarathi-Serve's chunk budget; vLLM's prefill batch budget.
    max_num_batched_tokens: int = 512
    # Bounded aging against starvation: for queue ordering, a best-effort request's
    # deadline is arrival + this many seconds (paper has no best-effort class).
    best_effort_deadline_s: float = 30.0
    # Laser: most of an iteration with SLO work that best-effort work may take (fraction in (0, 1];
    # 1.0: the paper's rule, best effort fills iterations up to T_g). Issue 28 item 3.
    best_effort_share: float = 0.2

    def __post_init__(self):
        if self.queue_order not in QUEUE_ORDERS:
            raise ConfigError(f"queue_order must be one of {QUEUE_ORDERS}, got {self.queue_order!r}")
        if self.role not in ROLES:
            raise ConfigError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.best_effort_deadline_s <= 0:
            raise ConfigError("best_effort_deadline_s must be positive")
        if not 0.0 < self.best_effort_share <= 1.0:  # (NaN fails too)
            raise ConfigError(f"best_effort_share must be in (0, 1] (the most of an iteration with SLO work that "
                              f"best-effort work may take; 1: no limit), got {self.best_effort_share}")


def resolve_max_model_len(requested: int | None, max_position: int, pool_tokens: int) -> int:
    """The context length an engine serves (prompt + output tokens of one request).

    Follows vLLM: an explicit ``requested`` length that the model's positions or the KV
    pool (``pool_tokens`` per layer) cannot hold is refused at start rather than silently
    shortened. Without a request, the model's ``max_position`` is capped to the pool, with
    a warning that names both numbers.

    Raises:
        ConfigError: ``requested`` < 1, > ``max_position``, or > ``pool_tokens`` (the message
            says how many tokens the pool holds and which options change it).
    """
    if requested is not None:
        if requested < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {requested}")
        if requested > max_position:
            raise ConfigError(f"max_model_len {requested} is larger than the model's maximum context "
                              f"({max_position} positions)")
        if requested > pool_tokens:
            raise ConfigError(
                f"max_model_len {requested} is larger than the KV cache can hold: the pool has room for "
                f"{pool_tokens} tokens, so one request of the maximum length would never fit; raise "
                f"--kv-cache-gib / --num-blocks or lower --max-model-len to at most {pool_tokens}"
            )
        return requested
    if max_position > pool_tokens:
        logging.getLogger("laser.frontend.engine").warning(
            "the KV cache holds %d tokens, fewer than the model's context of %d: serving a context of %d tokens "
            "(raise --kv-cache-gib / --num-blocks for more)", pool_tokens, max_position, pool_tokens)
        return pool_tokens
    return max_position
