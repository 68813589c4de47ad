"""The names of the prefix cache's blocks: a hash chain over full blocks of token ids, and the
design of the cache that :class:`~laser.core.block_manager.BlockManager` keeps under them. Torch-free.

Automatic prefix caching (on by default; vLLM v1 ``kv_cache_manager.py`` /
``block_pool.py`` are the reference, read not copied). A *full* block is named by a hash
chained through the previous block's hash (:func:`hash_blocks`; the chain's root is a salt of
what changes the KV: model, dtype, quantization), so equal hashes mean equal token prefixes.
A block is *published* under its hash only once its tokens have KV at every layer -- the
request's ``num_computed_tokens`` covers it (:meth:`~laser.core.block_manager.BlockManager.cache_blocks`): a chunk paused
at layer k, a request holding different ids at some layers, or one that released a layer keeps
its blocks private. A published block holds the same id at every layer, is read-only (a
request writes only past its cached prefix) and reference-counted by the requests holding it;
when none does it stays cached but *evictable*, counted as free, and is reused
least-recently-freed first (the tail of a chain before its head, as vLLM frees in reverse).
A new request attaches the blocks of its longest cached prefix (:meth:`~laser.core.block_manager.BlockManager.allocate`
with ``prefix``) instead of computing them; a preempted request re-finds its own the same way.
SGLang's radix tree with ``lock_ref`` is the other design we compared: hash chains need no tree
walk and give the per-instance summaries the controller routes by (:meth:`~laser.core.block_manager.BlockManager.summary`).
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Sequence


def prefix_root(salt: str) -> bytes:
    """The root of the hash chain for KV that ``salt`` names (model id, dtype, quantization...):
    a 16-byte digest. Two engines share cached blocks (and routing summaries) only when their
    salts are equal."""
    return hashlib.blake2b(b"laser-prefix-cache\0" + salt.encode(), digest_size=16).digest()


def hash_blocks(hashes: list[bytes], token_ids: Sequence[int], block_size: int, root: bytes) -> list[bytes]:
    """Extend ``hashes`` (the chain of ``token_ids``' first ``len(hashes)`` full blocks) to every
    full block of ``token_ids``, in place, and return it.

    Block i's hash is ``blake2b(hash_{i-1} || tokens of block i)`` (16 bytes; ``hash_{-1}`` is
    ``root``, :func:`prefix_root`): a block's hash names its whole prefix, as vLLM v1's
    ``hash_block_tokens`` does. A stable digest, not Python's ``hash``: summaries cross processes.
    """
    parent = hashes[-1] if hashes else root
    for i in range(len(hashes), len(token_ids) // block_size):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes())
        parent = h.digest()
        hashes.append(parent)
    return hashes


def cache_summary(hash_of: dict[int, bytes], ref: dict[int, int], evictable, limit: int) -> frozenset[bytes]:
    """Hashes of the cached blocks (``hash_of``: block id -> hash; ``ref``: requests holding each;
    ``evictable``: the unheld ones, least recently released first), at most ``limit``: over it,
    the held ones and then the most recently released (the last to be evicted). What an instance
    report carries for cache-aware routing."""
    if len(hash_of) <= limit:
        return frozenset(hash_of.values())
    held = [h for b, h in hash_of.items() if ref[b] > 0][:limit]
    rest = (hash_of[b] for b in reversed(evictable))
    return frozenset(held + [h for h, _ in zip(rest, range(limit - len(held)))])
