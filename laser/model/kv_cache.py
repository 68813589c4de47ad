"""Paged K/V tensors, written and read through flat slot indices.

Layout: one preallocated tensor ``[num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim]``.
Slot ``s`` of a layer is token ``s % block_size`` of block ``s // block_size``. Block ids
come from :class:`laser.core.block_manager.BlockManager`, which owns all allocation state;
this class owns only the tensor.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from ..core.block_manager import BlockManager
from ..core.config import CacheConfig, ConfigError, ModelConfig

#: Byte alignment of the pool's first element (one cache line; the C++ kernels load unaligned anyway).
POOL_ALIGN = 64


def available_memory_bytes() -> int | None:
    """The host's available memory (``MemAvailable`` of ``/proc/meminfo``), bytes; None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def prefault_mode() -> bool:
    """``$LASER_KV_PREFAULT``: ``1`` (the default) takes the KV pool's pages at start, so that the memory is
    committed up front (a pool too large fails at start, not mid-serving) and no step pays first-touch
    page faults (~1-2 ms for a 325-token SmolLM2 prefill's 7.5 MB of new KV); ``0`` leaves them to the
    first write (:func:`lazy_zeros`): an instance then costs the memory its requests use. The test
    suite sets 0: its in-process clusters built many 1 GiB pools and were OOM-killed at 22 GB.
    Raises ValueError on another value."""
    mode = os.environ.get("LASER_KV_PREFAULT", "1")
    if mode not in ("0", "1"):
        raise ValueError(f"LASER_KV_PREFAULT={mode!r}: use 1 or 0")
    return mode == "1"


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor whose pages the OS provides on first touch.

    ``torch.zeros`` writes every byte, so a 1 GiB pool costs 1 GiB of resident memory and
    ~0.1-0.3 s at start whether or not a request ever uses it. numpy's zeros come from
    ``calloc``, which for large sizes maps fresh zero pages: a block takes memory when a
    request first writes it (vLLM's CPU backend pays for the whole pool up front instead).
    The result is aligned to :data:`POOL_ALIGN` bytes and contiguous; the numpy buffer lives
    as long as the tensor.
    """
    nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
    raw = torch.from_numpy(np.zeros(nbytes + POOL_ALIGN, dtype=np.uint8))
    skip = (-raw.data_ptr()) % POOL_ALIGN
    return raw[skip:skip + nbytes].view(dtype).view(shape)


class KVCache:
    """The paged K/V pool of one instance.

    Args:
        model: model shape (layers, kv heads, head dim).
        cache: sizing; ``cache.blocks_per_layer`` decides the pool size.
        dtype: K/V dtype (the model's dtype).
        cache_salt: what else changes the KV (model id, quantization): with ``dtype``, the root
            of the prefix cache's block hashes (:func:`laser.core.block_manager.prefix_root`).

    Raises:
        ConfigError: the pool is larger than the host's available memory (checked before any page
            is taken: with ``LASER_KV_PREFAULT=0`` they are only taken when written).
    """

    def __init__(self, model: ModelConfig, cache: CacheConfig, dtype: torch.dtype, cache_salt: str = ""):
        self.block_size = cache.block_size
        elem = torch.finfo(dtype).bits // 8  # bytes of one K/V element
        self.num_blocks = cache.blocks_per_layer(model, elem)
        self.num_layers = model.num_layers
        shape = (model.num_layers, 2, self.num_blocks * self.block_size, model.num_kv_heads, model.head_dim)
        nbytes = int(np.prod(shape, dtype=np.int64)) * elem
        avail = available_memory_bytes()
        if avail is not None and nbytes > avail:
            raise ConfigError(f"the KV pool needs {nbytes / (1 << 30):.2f} GiB but the host has "
                              f"{avail / (1 << 30):.2f} GiB available: lower --kv-cache-gib "
                              f"(CacheConfig.kv_cache_gib or num_blocks)")
        # every page taken now (no step pays a first-touch fault), or on first write (lazy_zeros)
        self.kv = torch.zeros(shape, dtype=dtype) if prefault_mode() else lazy_zeros(shape, dtype)
        self.block_manager = BlockManager(model.num_layers, self.num_blocks, self.block_size,
                                          enable_prefix_caching=cache.enable_prefix_caching,
                                          cache_salt=f"{cache_salt}|{dtype}")

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def slots(self, table: list[int], start: int, end: int) -> torch.Tensor:
        """Flat slot indices [end - start] (int64) of token positions ``start..end-1`` for a block table."""
        pos = torch.arange(start, end)
        blocks = torch.tensor(table, dtype=torch.long)[pos // self.block_size]
        return blocks * self.block_size + pos % self.block_size

    def export_layer(self, req_id: str, layer: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy one layer of one request's KV: (K, V), each ``[num_tokens, kv_heads, head_dim]``.

        Used for per-layer KV migration (prefill instance -> decode instance).
        """
        s = self.slots(self.block_manager.table(req_id, layer), 0, num_tokens)
        return self.kv[layer, 0, s].clone(), self.kv[layer, 1, s].clone()

    def import_layer(self, req_id: str, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Allocate ``req_id``'s blocks at ``layer`` and write K/V ``[num_tokens, kv_heads, head_dim]``.

        Raises OutOfBlocksError (nothing allocated) when the layer's pool is full.
        """
        self.block_manager.allocate(req_id, k.shape[0], range(layer, layer + 1))
        self.write_layer(req_id, layer, k, v)

    def write_layer(self, req_id: str, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K/V ``[num_tokens, kv_heads, head_dim]`` of positions ``0..num_tokens-1`` into
        the blocks ``req_id`` already holds at ``layer`` (a re-sent layer overwrites in place)."""
        s = self.slots(self.block_manager.table(req_id, layer), 0, k.shape[0])
        self.kv[layer, 0, s] = k.to(self.kv.dtype)
        self.kv[layer, 1, s] = v.to(self.kv.dtype)
