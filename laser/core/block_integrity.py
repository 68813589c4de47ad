"""The integrity check of the paged block allocator (:class:`~laser.core.block_manager.BlockManager`):
the simulator runs it at the end of every run, the tests after every scenario. Torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .block_manager import BlockManager


class BlockManagerIntegrityError(AssertionError):
    """``check_integrity`` found a leaked, double-owned or out-of-range block."""


def check_integrity(bm: "BlockManager", expect_empty: bool = False) -> None:
    """Verify, per layer, that every block is free, owned by exactly one request, or
    published (held by any number of requests, or evictable); that each published block's
    reference count is the number of requests holding it, it is evictable exactly when that
    is 0, and the hash map is a bijection. (mini-sglang ``scheduler/cache.py``'s check.)

    Raises BlockManagerIntegrityError. With ``expect_empty``, also that no request holds
    anything (evictable cached blocks may remain).
    """
    use = [0] * bm.num_blocks
    hash_of = bm._hash_of
    holders: dict[int, set[str]] = {b: set() for b in hash_of}
    for layer in range(bm.num_layers):
        owned: set[int] = set()
        for rid, rb in bm._reqs.items():
            tbl = bm.table(rid, layer)
            if len(tbl) != rb.count[layer]:
                raise BlockManagerIntegrityError(f"{rid} layer {layer}: table length != count")
            for bid in tbl:
                if not 0 <= bid < bm.num_blocks:
                    raise BlockManagerIntegrityError(f"block id {bid} out of range")
                if bid in hash_of:
                    holders[bid].add(rid)
                    continue
                if bid in owned:
                    raise BlockManagerIntegrityError(f"block {bid} owned twice at layer {layer}")
                owned.add(bid)
        owned.update(hash_of)  # a published block is in use at every layer
        # the layer's free blocks are _fully_free | _extra[layer] (disjoint), checked without
        # building their union (O(owned + extra) per layer, not O(num_blocks))
        extra = bm._extra[layer]
        if not extra.isdisjoint(bm._fully_free):
            raise BlockManagerIntegrityError(f"layer {layer}: a block both fully and partly free")
        if not (owned.isdisjoint(bm._fully_free) and owned.isdisjoint(extra)):
            raise BlockManagerIntegrityError(f"layer {layer}: blocks both free and owned")
        num_free = len(bm._fully_free) + len(extra)
        if len(owned) + num_free != bm.num_blocks:
            leaked = bm.num_blocks - len(owned) - num_free
            raise BlockManagerIntegrityError(f"layer {layer}: {leaked} blocks leaked")
        for bid in owned:
            use[bid] += 1
    if use != bm._use:
        raise BlockManagerIntegrityError("per-block use counts are inconsistent")
    if bm._fully_free != {b for b, u in enumerate(use) if u == 0}:
        raise BlockManagerIntegrityError("fully-free set is inconsistent")
    if bm._min_free is not None and bm._min_free + len(bm._evictable) != min(
            map(bm.num_free, range(bm.num_layers))):
        raise BlockManagerIntegrityError("cached min_free is inconsistent")
    # the prefix cache
    if len(bm._by_hash) != len(hash_of) or any(bm._by_hash.get(h) != b for b, h in hash_of.items()):
        raise BlockManagerIntegrityError("block hash map and its inverse disagree")
    if bm._ref.keys() != hash_of.keys():
        raise BlockManagerIntegrityError("reference counts kept for unpublished blocks (or missing)")
    for bid, who in holders.items():
        if bm._ref[bid] != len(who):
            raise BlockManagerIntegrityError(f"block {bid}: {bm._ref[bid]} references, {len(who)} holders")
        if (bid in bm._evictable) != (not who):
            raise BlockManagerIntegrityError(f"block {bid}: evictable with holders, or held and evictable")
    if not bm.enable_prefix_caching and hash_of:
        raise BlockManagerIntegrityError("blocks published with prefix caching off")
    for rid, rb in bm._reqs.items():
        if not any(rb.count):
            raise BlockManagerIntegrityError(f"{rid} holds no block but is still tracked")
    if expect_empty and bm._reqs:
        raise BlockManagerIntegrityError(f"blocks still held by: {sorted(bm._reqs)[:10]}")
