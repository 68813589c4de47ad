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

Automatic prefix caching (on by default): full blocks published under the hash of their whole
prefix (:mod:`laser.core.prefix_hash`, whose docstring states the design) are shared, read-only
and reference-counted; a new request attaches its longest cached prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

from .block_integrity import BlockManagerIntegrityError  # noqa: F401 (re-exported)
from .prefix_hash import cache_summary, hash_blocks, prefix_root  # noqa: F401 (the last two re-exported)


class OutOfBlocksError(RuntimeError):
    """The KV cache pool of some layer has no free block left. Nothing was allocated."""


_NEVER = 1 << 62  # _ReqBlocks.num_offered of a request whose blocks are never published


@dataclass
class _ReqBlocks:
    canon: list[int] = field(default_factory=list)
    # Number of blocks held at each layer (len == num_layers).
    count: list[int] = field(default_factory=list)
    # layer -> full table for layers whose ids differ from the canonical ones.
    overrides: dict[int, list[int]] = field(default_factory=dict)
    # Every layer holds exactly ``canon[:count[0]]`` (no override): allocate/free take the fast path.
    uniform: bool = True
    # Leading logical blocks already offered to the prefix cache (:meth:`BlockManager.cache_blocks`).
    num_offered: int = 0


class BlockManager:
    """Per-layer paged block allocator.

    Args:
        num_layers: transformer layers (one pool each).
        num_blocks: blocks per layer pool.
        block_size: tokens per block.
        enable_prefix_caching: publish computed full blocks and let new requests attach them
            (see the module docstring). Off: nothing is ever cached or shared. An engine turns it
            on by default (``CacheConfig.enable_prefix_caching``); the simulator only when asked,
            since its requests carry dummy token ids unless the workload gives real ones.
        cache_salt: what changes the KV besides the tokens (model id, dtype, quantization), the
            root of every hash chain (:func:`prefix_root`).
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 cache_salt: str = ""):
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
        # min over layers of len(_fully_free) + len(_extra[l]) (evictable cached blocks not
        # included); None = recompute
        self._min_free: int | None = num_blocks
        # -- the prefix cache: published blocks, in use at every layer, never in a free set --
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_root = prefix_root(cache_salt)
        self._by_hash: dict[bytes, int] = {}  # block hash -> published block id
        self._hash_of: dict[int, bytes] = {}  # published block id -> its hash
        self._ref: dict[int, int] = {}  # published block id -> requests holding it (at any layer)
        # published blocks no request holds, least recently released first (evicted in this order)
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.num_evictions = 0  # published blocks evicted for reuse (total)
        self.cache_version = 0  # grows whenever a block is published or evicted
        self._summary: tuple | None = None  # (cache_version, limit) -> summary()

    # -- queries ----------------------------------------------------------------------
    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_free(self, layer: int) -> int:
        """Blocks of ``layer`` a request may take: free ones plus evictable cached ones."""
        return len(self._fully_free) + len(self._extra[layer]) + len(self._evictable)

    def min_free(self) -> int:
        """Free blocks (evictable cached ones included) in the most-used layer (the binding constraint)."""
        m = self._min_free
        if m is None:
            m = self._min_free = len(self._fully_free) + min(map(len, self._extra))
        return m + len(self._evictable)

    # -- the prefix cache: queries -----------------------------------------------------------------
    def block_hashes(self, hashes: list[bytes], token_ids: Sequence[int]) -> list[bytes]:
        """:func:`hash_blocks` with this manager's block size and salt (``hashes`` is extended in
        place: keep it with the request, it only ever grows)."""
        return hash_blocks(hashes, token_ids, self.block_size, self.prefix_root)

    def cached_prefix_blocks(self, block_hashes: Sequence[bytes], max_tokens: int) -> int:
        """Number of leading blocks of ``block_hashes`` that are cached, covering at most
        ``max_tokens`` tokens (0 with caching off). Read-only: safe to call from another thread
        for an estimate (single dict reads)."""
        if not self.enable_prefix_caching:
            return 0
        k, get = 0, self._by_hash.get
        for h in block_hashes[: max(0, max_tokens) // self.block_size]:
            if get(h) is None:
                break
            k += 1
        return k

    @property
    def num_cached_blocks(self) -> int:
        """Published blocks (held or evictable)."""
        return len(self._hash_of)

    @property
    def num_evictable(self) -> int:
        """Published blocks no request holds (counted as free)."""
        return len(self._evictable)

    #: Most block hashes an instance report carries (:meth:`summary`): 64 KiB of 16-byte digests.
    SUMMARY_LIMIT = 4096

    def summary(self, limit: int | None = None) -> frozenset[bytes]:
        """:func:`~laser.core.prefix_hash.cache_summary` of this cache, at most ``limit`` hashes
        (default :attr:`SUMMARY_LIMIT`); rebuilt only when a block was published or evicted since
        the last call."""
        limit = self.SUMMARY_LIMIT if limit is None else limit
        memo = self._summary
        if memo is None or memo[0] != (self.cache_version, limit):
            memo = self._summary = ((self.cache_version, limit),
                                    cache_summary(self._hash_of, self._ref, self._evictable, limit))
        return memo[1]

    def usage(self) -> float:
        """Fraction of all blocks (over all layers) in use."""
        total = self.num_blocks * self.num_layers
        return 1.0 - sum(self.num_free(layer) for layer in range(self.num_layers)) / total

    def num_held(self, req_id: str, layer: int) -> int:
        rb = self._reqs.get(req_id)
        return rb.count[layer] if rb else 0

    def covers(self, req_id: str, num_tokens: int) -> bool:
        """Whether ``req_id`` already holds the blocks for ``num_tokens`` tokens at every layer
        (then allocating them is a no-op) -- the same blocks at each, or not (a request whose KV
        was imported layer by layer: a hand-off's)."""
        rb = self._reqs.get(req_id)
        if rb is None:
            return False
        need = -(-num_tokens // self.block_size)
        return need <= rb.count[0] if rb.uniform else need <= min(rb.count)

    def has(self, req_id: str) -> bool:
        return req_id in self._reqs

    def can_allocate(self, req_id: str, num_tokens: int, layers: range | None = None,
                     prefix: Sequence[bytes] = ()) -> bool:
        """Whether every layer in ``layers`` can grow ``req_id`` to cover ``num_tokens`` tokens.

        ``prefix``: block hashes a request not held yet would attach (:meth:`allocate`); False
        when any of them is no longer cached. Its evictable blocks stop counting as free."""
        need = self.blocks_needed(num_tokens)
        rb = self._reqs.get(req_id)
        if rb is None and prefix:
            blocks = self._match(prefix)
            if len(blocks) < len(prefix):
                return False
            ev = self._evictable
            taken = sum(1 for b in blocks if b in ev)
            grow = max(0, need - len(blocks))
            if layers is None or (layers.start == 0 and layers.stop >= self.num_layers and layers.step == 1):
                return grow <= self.min_free() - taken
            return all(grow <= self.num_free(layer) - taken for layer in layers)
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
    def allocate(self, req_id: str, num_tokens: int, layers: range | None = None,
                 prefix: Sequence[bytes] = ()) -> None:
        """Grow ``req_id``'s tables so each layer in ``layers`` covers ``num_tokens`` tokens.

        ``prefix``: for a request not held yet, the hashes of its cached leading blocks
        (:meth:`cached_prefix_blocks`): it first takes those blocks at every layer (a reference
        each, out of the evictable set), then grows past them. All-or-nothing: raises
        :class:`OutOfBlocksError` (allocating nothing) when a layer lacks blocks or a prefix
        block is no longer cached.
        """
        rb = self._reqs.get(req_id)
        if rb is not None and rb.uniform and layers is None and -(-num_tokens // self.block_size) <= rb.count[0]:
            return  # holds them already at every layer (every decode token but one a block)
        layers = layers if layers is not None else range(self.num_layers)
        if not self.can_allocate(req_id, num_tokens, layers, () if rb is not None else prefix):
            raise OutOfBlocksError(
                f"KV cache exhausted: request {req_id} needs {self.blocks_needed(num_tokens)} blocks "
                f"per layer in layers {layers.start}..{layers.stop - 1}; free in the fullest layer: {self.min_free()}"
            )
        need = self.blocks_needed(num_tokens)
        if rb is None:
            rb = self._reqs[req_id] = _ReqBlocks(count=[0] * self.num_layers)
            if prefix:
                self._attach(rb, self._match(prefix))
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
        if held != len(rb.canon):
            return False
        ff = self._fully_free
        short = need - held - len(ff)
        if short > 0:
            # evict only where growing layer by layer would (no layer has a partly free block)
            if short > len(self._evictable) or any(self._extra):
                return False
            for _ in range(short):
                self._evict()
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
                bid = next(iter(extra)) if extra else (next(iter(ff)) if ff else self._evict())
        else:
            # Extend the canonical table with an id free in every layer when possible.
            bid = next(iter(ff)) if ff else (next(iter(extra)) if extra else self._evict())
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

    # -- the prefix cache: mutations ---------------------------------------------------------------
    def _match(self, block_hashes: Sequence[bytes]) -> list[int]:
        """Published block ids of the longest cached prefix of ``block_hashes``."""
        out, get = [], self._by_hash.get
        for h in block_hashes:
            b = get(h)
            if b is None:
                break
            out.append(b)
        return out

    def _attach(self, rb: _ReqBlocks, blocks: list[int]) -> None:
        """A new request takes published ``blocks`` (a reference each) at every layer."""
        ref, ev = self._ref, self._evictable
        for b in blocks:
            if ref[b] == 0:
                del ev[b]
            ref[b] += 1
        rb.canon = list(blocks)
        rb.count = [len(blocks)] * self.num_layers
        rb.num_offered = len(blocks)

    def _release(self, blocks) -> None:
        """Drop one reference to each published block of ``blocks`` (logical order): a block no
        request holds becomes evictable, the tail of the chain first in line for eviction."""
        ref, ev = self._ref, self._evictable
        for b in reversed(blocks):
            ref[b] -= 1
            if ref[b] == 0:
                ev[b] = None

    def _evict(self) -> int:
        """Evict the least recently released published block; it is now free at every layer."""
        bid, _ = self._evictable.popitem(last=False)
        del self._by_hash[self._hash_of.pop(bid)]
        del self._ref[bid]
        self._use[bid] = 0
        self._fully_free.add(bid)
        if self._min_free is not None:
            self._min_free += 1
        self.num_evictions += 1
        self.cache_version += 1
        return bid

    def cache_blocks(self, req_id: str, block_hashes: Sequence[bytes], num_computed_tokens: int) -> None:
        """Publish ``req_id``'s full blocks within its first ``num_computed_tokens`` tokens (KV
        written at *every* layer: the request's ``num_computed_tokens``, never a paused chunk's
        tokens) under their hashes (``block_hashes``, :meth:`block_hashes`), so later requests
        can attach them. A block is published only when the request holds the same id for it at
        every layer and no other block has that hash yet (a twin computed beside it stays
        private); once a block is not publishable the rest of the request's blocks are not
        offered either (a lookup stops at the first miss). No-op with caching off."""
        rb = self._reqs.get(req_id)
        if rb is None or not self.enable_prefix_caching:
            return
        full = min(num_computed_tokens // self.block_size, len(block_hashes))
        if full <= rb.num_offered:
            return
        by_hash, hash_of, ref = self._by_hash, self._hash_of, self._ref
        for i in range(rb.num_offered, full):
            bid = rb.canon[i] if i < len(rb.canon) else None
            if bid is None or not self._held_everywhere(rb, i, bid):
                rb.num_offered = _NEVER  # ids differ per layer, or a layer was released: stays private
                return
            h = block_hashes[i]
            if bid in hash_of or h in by_hash:
                continue  # attached from the cache, or a twin published first
            by_hash[h] = bid
            hash_of[bid] = h
            ref[bid] = 1
            self.cache_version += 1
        rb.num_offered = full

    def _held_everywhere(self, rb: _ReqBlocks, idx: int, bid: int) -> bool:
        if rb.uniform:
            return idx < rb.count[0]
        return all(rb.count[layer] > idx and (rb.overrides[layer][idx] if layer in rb.overrides else bid) == bid
                   for layer in range(self.num_layers))

    def reset_prefix_cache(self) -> int:
        """Evict every published block no request holds; returns how many (vLLM's
        ``reset_prefix_cache``, minus the all-or-nothing rule: held blocks stay)."""
        n = len(self._evictable)
        for _ in range(n):
            self._evict()
        self.num_evictions -= n
        return n

    def free_layer(self, req_id: str, layer: int) -> None:
        """Release ``req_id``'s blocks at one layer (e.g. after its KV migrated). Published
        blocks stay cached at every layer; the request's reference goes once it holds them at
        no layer."""
        rb = self._reqs.get(req_id)
        if rb is None or rb.count[layer] == 0:
            return
        rb.uniform = False
        hash_of = self._hash_of
        shared = []
        for bid in self.table(req_id, layer):
            if bid in hash_of:
                shared.append(bid)
            else:
                self._give(layer, bid)
        rb.count[layer] = 0
        rb.overrides.pop(layer, None)
        if shared:
            still = {b for lay in range(self.num_layers) if rb.count[lay] for b in self.table(req_id, lay)}
            self._release([b for b in shared if b not in still])
        if not any(rb.count):
            del self._reqs[req_id]

    def trim(self, req_id: str, num_tokens: int) -> None:
        """Release ``req_id``'s blocks beyond those covering ``num_tokens`` tokens, at every layer
        (a self-speculative step's rejected draft positions; laser.spec). Keeps the same-blocks-
        at-every-layer fast path of a uniform request."""
        rb = self._reqs.get(req_id)
        if rb is None:
            return
        need = self.blocks_needed(num_tokens)
        if max(rb.count) <= need:
            return
        for layer in range(self.num_layers):
            if rb.count[layer] <= need:
                continue
            ov = rb.overrides.get(layer)
            for bid in (ov if ov is not None else rb.canon)[need : rb.count[layer]]:
                self._give(layer, bid)
            if ov is not None:
                del ov[need:]
            rb.count[layer] = need
        del rb.canon[need:]  # no layer holds more than ``need`` blocks now
        if not need:
            del self._reqs[req_id]

    def free(self, req_id: str) -> None:
        """Release everything ``req_id`` holds (finish, abort or preemption). Idempotent. Its
        published blocks stay cached (evictable once nobody holds them)."""
        rb = self._reqs.get(req_id)
        if rb is None:
            return
        del self._reqs[req_id]
        hash_of = self._hash_of
        if rb.uniform and rb.count[0] == len(rb.canon):  # the same blocks at every layer
            bids = rb.canon
            shared = [b for b in bids if b in hash_of] if hash_of else ()
            if shared:
                self._release(shared)
                bids = [b for b in bids if b not in hash_of]
            if self._min_free is not None:
                self._min_free += len(bids)  # every layer got the same blocks back
            use = self._use
            for bid in bids:
                use[bid] = 0  # held at every layer, by this request alone
            self._fully_free.update(bids)
            return
        shared = {}
        for layer in range(self.num_layers):
            if rb.count[layer]:
                tbl = rb.overrides.get(layer) or rb.canon[: rb.count[layer]]
                for i, bid in enumerate(tbl):
                    if bid in hash_of:
                        shared.setdefault(bid, i)
                    else:
                        self._give(layer, bid)
        if shared:
            self._release(sorted(shared, key=shared.get))

    def check_integrity(self, expect_empty: bool = False) -> None:
        """:func:`laser.core.block_integrity.check_integrity` (raises BlockManagerIntegrityError)."""
        from .block_integrity import check_integrity

        check_integrity(self, expect_empty)
