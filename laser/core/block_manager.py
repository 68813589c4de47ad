"""Torch-free paged block allocator with per-layer accounting.

Each layer has its own pool of ``num_blocks`` blocks of ``block_size`` tokens. A
request holds, per layer, exactly the blocks covering the tokens it has written at
that layer: a request that has run only layers < l holds nothing at layers >= l,
and a single layer can be released (after its KV migrated) or imported alone.

To keep attention metadata cheap, allocation prefers the *same block id in every
layer*: each request has a canonical table (block ids by logical index), and layer l
takes the canonical id whenever that id is free at l. Only when it is not does layer
l get an override table. The model runner then builds one slot mapping per batch
composition and per-layer ones only for overridden layers (rare).

Compare vLLM ``BlockSpaceManager`` / mini-sglang ``scheduler/cache.py``; per-layer
pools are Laser's (PPoPP'26 §8, "KV cache allocated per layer").
"""

from __future__ import annotations

from dataclasses import dataclass, field


class OutOfBlocksError(RuntimeError):
    """The KV cache pool of some layer has no free block left. Nothing was allocated."""


class BlockManagerIntegrityError(AssertionError):
    """``check_integrity`` found a leaked, double-owned or out-of-range block."""


@dataclass
class _ReqBlocks:
    canon: list[int] = field(default_factory=list)
    # Number of blocks held at each layer (len == num_layers).
    count: list[int] = field(default_factory=list)
    # layer -> full table for layers whose ids differ from the canonical ones.
    overrides: dict[int, list[int]] = field(default_factory=dict)
    # Every layer holds exactly ``canon[:count[0]]`` (no override): allocate/free take the fast path.
    uniform: bool = True


class BlockManager:
    """Per-layer paged block allocator.

    Args:
        num_layers: transformer layers (one pool each).
        num_blocks: blocks per layer pool.
        block_size: tokens per block.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int):
        if num_layers <= 0 or num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_layers, num_blocks and block_size must be positive")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        # The free blocks of layer l are ``_fully_free | _extra[l]`` (disjoint): ids free at every
        # layer are kept once, in ``_fully_free``, so a request holding the same blocks at every
        # layer allocates and frees them in O(blocks), not O(blocks x layers).
        self._extra: list[set[int]] = [set() for _ in range(num_layers)]
        # Number of layers in which each block id is in use; ids at 0 are fully free.
        self._use = [0] * num_blocks
        self._fully_free: set[int] = set(range(num_blocks))
        self._reqs: dict[str, _ReqBlocks] = {}
        self._min_free: int | None = num_blocks  # min(map(len, _free)); None = recompute

    # -- queries ----------------------------------------------------------------------
    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_free(self, layer: int) -> int:
        return len(self._fully_free) + len(self._extra[layer])

    def free_ids(self, layer: int) -> set[int]:
        """The free block ids of ``layer`` (a new set)."""
        return self._fully_free | self._extra[layer]

    def min_free(self) -> int:
        """Free blocks in the most-used layer (the binding constraint)."""
        m = self._min_free
        if m is None:
            m = self._min_free = len(self._fully_free) + min(map(len, self._extra))
        return m

    def usage(self) -> float:
        """Fraction of all blocks (over all layers) in use."""
        total = self.num_blocks * self.num_layers
        return 1.0 - sum(self.num_free(layer) for layer in range(self.num_layers)) / total

    def num_held(self, req_id: str, layer: int) -> int:
        rb = self._reqs.get(req_id)
        return rb.count[layer] if rb else 0

    def covers(self, req_id: str, num_tokens: int) -> bool:
        """Whether ``req_id`` already holds the blocks for ``num_tokens`` tokens at every layer
        (the same blocks at each: then allocating them is a no-op)."""
        rb = self._reqs.get(req_id)
        return rb is not None and rb.uniform and -(-num_tokens // self.block_size) <= rb.count[0]

    def has(self, req_id: str) -> bool:
        return req_id in self._reqs

    def can_allocate(self, req_id: str, num_tokens: int, layers: range | None = None) -> bool:
        """Whether every layer in ``layers`` can grow ``req_id`` to cover ``num_tokens`` tokens."""
        need = self.blocks_needed(num_tokens)
        rb = self._reqs.get(req_id)
        if rb is not None and rb.uniform and need <= rb.count[0]:
            return True  # holds them already at every layer
        if layers is None or (layers.start == 0 and layers.stop >= self.num_layers and layers.step == 1):
            if rb is None:
                return need <= self.min_free()
            if rb.uniform:
                return need - rb.count[0] <= self.min_free()
        for layer in layers if layers is not None else range(self.num_layers):
            held = rb.count[layer] if rb else 0
            if need - held > self.num_free(layer):
                return False
        return True

    def table(self, req_id: str, layer: int) -> list[int]:
        """Block ids of ``req_id`` at ``layer`` (logical order)."""
        rb = self._reqs[req_id]
        ov = rb.overrides.get(layer)
        return ov if ov is not None else rb.canon[: rb.count[layer]]

    def canonical_table(self, req_id: str) -> list[int]:
        return self._reqs[req_id].canon

    def overridden_layers(self, req_id: str) -> tuple[int, ...]:
        rb = self._reqs.get(req_id)
        return tuple(rb.overrides) if rb else ()

    # -- mutations ----------------------------------------------------------------------
    def allocate(self, req_id: str, num_tokens: int, layers: range | None = None) -> None:
        """Grow ``req_id``'s tables so each layer in ``layers`` covers ``num_tokens`` tokens.

        All-or-nothing: raises :class:`OutOfBlocksError` (allocating nothing) when a
        layer lacks blocks.
        """
        rb = self._reqs.get(req_id)
        if rb is not None and rb.uniform and layers is None and -(-num_tokens // self.block_size) <= rb.count[0]:
            return  # holds them already at every layer (every decode token but one a block)
        layers = layers if layers is not None else range(self.num_layers)
        if not self.can_allocate(req_id, num_tokens, layers):
            raise OutOfBlocksError(
                f"KV cache exhausted: request {req_id} needs {self.blocks_needed(num_tokens)} blocks "
                f"per layer in layers {layers.start}..{layers.stop - 1}; free in the fullest layer: {self.min_free()}"
            )
        need = self.blocks_needed(num_tokens)
        if rb is None:
            rb = self._reqs[req_id] = _ReqBlocks(count=[0] * self.num_layers)
        whole = layers.start == 0 and layers.stop >= self.num_layers and layers.step == 1
        if whole and rb.uniform and self._grow_all(rb, need):
            return
        for layer in layers:
            while rb.count[layer] < need:
                self._grow(rb, layer)
        rb.uniform = whole and rb.uniform and not rb.overrides

    def _grow_all(self, rb: _ReqBlocks, need: int) -> bool:
        """Fast path of :meth:`allocate` over every layer for a request holding the same
        canonical blocks at every layer: new blocks free in every layer extend the canonical
        table and are taken everywhere at once. The same ids, in the same order, as growing
        layer by layer would pick. False (nothing done) when it does not apply."""
        held = rb.count[0]
        if need <= held:
            return True
        if held != len(rb.canon) or len(self._fully_free) < need - held:
            return False
        ff = self._fully_free
        new = []
        for _ in range(need - held):
            bid = next(iter(ff))
            ff.discard(bid)
            new.append(bid)
        if self._min_free is not None:
            self._min_free -= len(new)  # every layer lost the same blocks
        use = self._use
        for bid in new:
            use[bid] = self.num_layers
        rb.canon.extend(new)
        rb.count = [need] * self.num_layers
        return True
    def _grow(self, rb: _ReqBlocks, layer: int) -> None:
        idx = rb.count[layer]
        extra, ff = self._extra[layer], self._fully_free
        ov = rb.overrides.get(layer)
        if idx < len(rb.canon):
            want = rb.canon[idx]
            if want in extra or want in ff:
                bid = want
            else:
                bid = next(iter(extra)) if extra else next(iter(ff))
        else:
            # Extend the canonical table with an id free in every layer when possible.
            bid = next(iter(ff)) if ff else next(iter(extra))
            rb.canon.append(bid)
        self._take(layer, bid)
        if ov is None and bid != rb.canon[idx]:
            ov = rb.overrides[layer] = rb.canon[:idx]
        if ov is not None:
            ov.append(bid)
        rb.count[layer] = idx + 1

    def _take(self, layer: int, bid: int) -> None:
        self._min_free = None
        if self._use[bid] == 0:  # fully free until now: still free at every other layer
            self._fully_free.remove(bid)
            for other, extra in enumerate(self._extra):
                if other != layer:
                    extra.add(bid)
        else:
            self._extra[layer].remove(bid)
        self._use[bid] += 1

    def _give(self, layer: int, bid: int) -> None:
        self._min_free = None
        self._use[bid] -= 1
        if self._use[bid] == 0:  # free at every layer again
            for other, extra in enumerate(self._extra):
                if other != layer:
                    extra.remove(bid)
            self._fully_free.add(bid)
        else:
            self._extra[layer].add(bid)

    def free_layer(self, req_id: str, layer: int) -> None:
        """Release ``req_id``'s blocks at one layer (e.g. after its KV migrated)."""
        rb = self._reqs.get(req_id)
        if rb is None or rb.count[layer] == 0:
            return
        rb.uniform = False
        for bid in self.table(req_id, layer):
            self._give(layer, bid)
        rb.count[layer] = 0
        rb.overrides.pop(layer, None)
        if not any(rb.count):
            del self._reqs[req_id]

    def free(self, req_id: str) -> None:
        """Release everything ``req_id`` holds (finish or abort). Idempotent."""
        rb = self._reqs.get(req_id)
        if rb is None:
            return
        if rb.uniform and rb.count[0] == len(rb.canon):  # the same blocks at every layer
            bids = rb.canon
            if self._min_free is not None:
                self._min_free += len(bids)  # every layer got the same blocks back
            use = self._use
            for bid in bids:
                use[bid] = 0  # held at every layer, by this request alone
            self._fully_free.update(bids)
            del self._reqs[req_id]
            return
        for layer in range(self.num_layers):
            if rb.count[layer]:
                for bid in self.table(req_id, layer):
                    self._give(layer, bid)
        del self._reqs[req_id]

    # -- integrity ----------------------------------------------------------------------
    def check_integrity(self, expect_empty: bool = False) -> None:
        """Verify every block is either free or owned by exactly one request, per layer.

        Raises BlockManagerIntegrityError. With ``expect_empty``, also that nothing is held.
        """
        use = [0] * self.num_blocks
        for layer in range(self.num_layers):
            owned: set[int] = set()
            for rid, rb in self._reqs.items():
                tbl = self.table(rid, layer)
                if len(tbl) != rb.count[layer]:
                    raise BlockManagerIntegrityError(f"{rid} layer {layer}: table length != count")
                for bid in tbl:
                    if not 0 <= bid < self.num_blocks:
                        raise BlockManagerIntegrityError(f"block id {bid} out of range")
                    if bid in owned:
                        raise BlockManagerIntegrityError(f"block {bid} owned twice at layer {layer}")
                    owned.add(bid)
            # the layer's free blocks are _fully_free | _extra[layer] (disjoint), checked without
            # building their union (O(owned + extra) per layer, not O(num_blocks))
            extra = self._extra[layer]
            if not extra.isdisjoint(self._fully_free):
                raise BlockManagerIntegrityError(f"layer {layer}: a block both fully and partly free")
            if not (owned.isdisjoint(self._fully_free) and owned.isdisjoint(extra)):
                raise BlockManagerIntegrityError(f"layer {layer}: blocks both free and owned")
            num_free = len(self._fully_free) + len(extra)
            if len(owned) + num_free != self.num_blocks:
                leaked = self.num_blocks - len(owned) - num_free
                raise BlockManagerIntegrityError(f"layer {layer}: {leaked} blocks leaked")
            for bid in owned:
                use[bid] += 1
        if use != self._use:
            raise BlockManagerIntegrityError("per-block use counts are inconsistent")
        if self._fully_free != {b for b, u in enumerate(use) if u == 0}:
            raise BlockManagerIntegrityError("fully-free set is inconsistent")
        if self._min_free is not None and self._min_free != min(map(self.num_free, range(self.num_layers))):
            raise BlockManagerIntegrityError("cached min_free is inconsistent")
        for rid, rb in self._reqs.items():
            if not any(rb.count):
                raise BlockManagerIntegrityError(f"{rid} holds no block but is still tracked")
        if expect_empty and self._reqs:
            raise BlockManagerIntegrityError(f"blocks still held by: {sorted(self._reqs)[:10]}")
