"""Bounded cache of paused hidden states (Laser PPoPP'26 §6.1, "intermediate cache").

A chunk paused at a layer boundary keeps its residual stream ``[num_tokens, H]`` here
until it resumes. Torch-free: payloads are opaque to this class (the model runner stores
tensors; the simulator stores ``None``), so schedulers can do the accounting.

Capacity is in tokens (paper: 16,384 on prefill instances, 2,048 on decode instances).
The runner may overfill it transiently within one step; after the step the scheduler
brings it back under capacity by evicting the least strict requests
(:meth:`evict`): an evicted chunk loses its hidden state and is recomputed from layer
0 later, rewriting identical KV. A request is never dropped.
"""

from __future__ import annotations

from typing import Any


class IntermediateCacheError(KeyError):
    """Lookup of a request that has no paused state (a scheduler bug)."""


class IntermediateCache:
    def __init__(self, capacity_tokens: int):
        if capacity_tokens <= 0:
            raise ValueError("intermediate cache capacity must be positive")
        self.capacity_tokens = capacity_tokens
        self._entries: dict[str, tuple[Any, int]] = {}
        self.used_tokens = 0
        self.num_evictions = 0

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def over_capacity(self) -> int:
        """Tokens above capacity (0 when within)."""
        return max(0, self.used_tokens - self.capacity_tokens)

    def put(self, req_id: str, payload: Any, num_tokens: int) -> None:
        """Store (or replace) the paused state of ``req_id``."""
        self.discard(req_id)
        self._entries[req_id] = (payload, num_tokens)
        self.used_tokens += num_tokens

    def pop(self, req_id: str) -> Any:
        """Remove and return the paused state. Raises IntermediateCacheError when absent."""
        try:
            payload, n = self._entries.pop(req_id)
        except KeyError:
            raise IntermediateCacheError(f"no paused hidden state for {req_id}") from None
        self.used_tokens -= n
        return payload

    def discard(self, req_id: str) -> None:
        """Drop the state of ``req_id`` if present (finish/abort)."""
        entry = self._entries.pop(req_id, None)
        if entry is not None:
            self.used_tokens -= entry[1]

    def evict(self, req_id: str) -> None:
        """Drop the state to make room; the caller resets the request to recompute it."""
        self.discard(req_id)
        self.num_evictions += 1

    def ids(self) -> list[str]:
        return list(self._entries)

    def check_integrity(self, expect_empty: bool = False) -> None:
        if self.used_tokens != sum(n for _, n in self._entries.values()):
            raise AssertionError("intermediate cache token count is inconsistent")
        if expect_empty and self._entries:
            raise AssertionError(f"intermediate cache still holds {sorted(self._entries)[:10]}")
