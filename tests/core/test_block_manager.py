"""The per-layer block manager against a simple reference model, and KV layer export/import.

The reference model is just "blocks held per (request, layer)"; everything the block
manager reports (free counts, held counts, table lengths, exhaustion) must agree with it
after every operation, and ``check_integrity`` must pass throughout.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from laser.core.block_manager import BlockManager, BlockManagerIntegrityError, OutOfBlocksError
from laser.core.config import CacheConfig, ConfigError, ModelConfig
from laser.model.kv_cache import KVCache

NUM_LAYERS = 4
NUM_BLOCKS = 12
BLOCK_SIZE = 4
REQ_IDS = [f"r{i}" for i in range(6)]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / free_layer / finish / abort sequences against a dict model."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE)
        # (req, layer) -> blocks held, per the reference model
        self.held: dict[tuple[str, int], int] = {}
        # (req, layer) -> table as last observed: growing must keep existing ids in place
        self.tables: dict[tuple[str, int], list[int]] = {}

    def model_free(self, layer: int) -> int:
        return NUM_BLOCKS - sum(n for (_, l), n in self.held.items() if l == layer)

    def model_held(self, req: str, layer: int) -> int:
        return self.held.get((req, layer), 0)

    def snapshot(self):
        return {(r, l): list(self.bm.table(r, l)) for r in REQ_IDS if self.bm.has(r) for l in range(NUM_LAYERS)}

    @rule(
        req=st.sampled_from(REQ_IDS),
        num_tokens=st.integers(1, NUM_BLOCKS * BLOCK_SIZE + 3),
        lo=st.integers(0, NUM_LAYERS - 1),
        width=st.integers(1, NUM_LAYERS),
    )
    def allocate(self, req, num_tokens, lo, width):
        layers = range(lo, min(NUM_LAYERS, lo + width))
        need = ceil_div(num_tokens, BLOCK_SIZE)
        fits = all(need - self.model_held(req, l) <= self.model_free(l) for l in layers)
        assert self.bm.can_allocate(req, num_tokens, layers) == fits
        before = self.snapshot()
        free_before = [self.bm.num_free(l) for l in range(NUM_LAYERS)]
        if not fits:
            with pytest.raises(OutOfBlocksError, match="KV cache exhausted"):
                self.bm.allocate(req, num_tokens, layers)
            # all-or-nothing: not a single block moved
            assert self.snapshot() == before
            assert [self.bm.num_free(l) for l in range(NUM_LAYERS)] == free_before
            assert self.bm.has(req) == any(self.model_held(req, l) for l in range(NUM_LAYERS))
            return
        self.bm.allocate(req, num_tokens, layers)
        for l in layers:
            self.held[(req, l)] = max(self.model_held(req, l), need)
        # growth keeps the blocks already held (their KV stays valid), at every layer
        after = self.snapshot()
        for key, old in before.items():
            assert after[key][: len(old)] == old, key

    @rule(req=st.sampled_from(REQ_IDS), layer=st.integers(0, NUM_LAYERS - 1))
    def free_layer(self, req, layer):
        before = self.snapshot()
        self.bm.free_layer(req, layer)
        self.held.pop((req, layer), None)
        after = self.snapshot()
        # other layers (and other requests) are untouched
        for key, old in before.items():
            if key != (req, layer) and key in after:
                assert after[key] == old, key

    @rule(req=st.sampled_from(REQ_IDS), num_tokens=st.integers(0, NUM_BLOCKS * BLOCK_SIZE))
    def trim(self, req, num_tokens):
        """Release the blocks beyond ``num_tokens`` tokens at every layer (rejected drafts)."""
        before = self.snapshot()
        self.bm.trim(req, num_tokens)
        need = ceil_div(num_tokens, BLOCK_SIZE)
        for l in range(NUM_LAYERS):
            if self.model_held(req, l) > need:
                self.held[(req, l)] = need
            if self.held.get((req, l)) == 0:
                del self.held[(req, l)]
        after = self.snapshot()
        for key, old in before.items():  # what is kept stays in place
            if key in after:
                assert after[key] == old[: len(after[key])], key

    @rule(req=st.sampled_from(REQ_IDS))
    def finish(self, req):
        self.bm.free(req)
        for l in range(NUM_LAYERS):
            self.held.pop((req, l), None)
        assert not self.bm.has(req)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def abort_holder(self, data):
        """Abort (free twice: idempotent) a request that currently holds blocks."""
        req = data.draw(st.sampled_from(sorted({r for r, _ in self.held})))
        self.bm.free(req)
        self.bm.free(req)
        for l in range(NUM_LAYERS):
            self.held.pop((req, l), None)

    @invariant()
    def agrees_with_model(self):
        self.bm.check_integrity()
        for l in range(NUM_LAYERS):
            assert self.bm.num_free(l) == self.model_free(l), l
        for r in REQ_IDS:
            assert self.bm.has(r) == any(self.model_held(r, l) for l in range(NUM_LAYERS))
            for l in range(NUM_LAYERS):
                # per-layer accounting: a layer never run/allocated holds nothing
                assert self.bm.num_held(r, l) == self.model_held(r, l), (r, l)
                if self.bm.has(r):
                    assert len(self.bm.table(r, l)) == self.model_held(r, l)

    def teardown(self):
        for r in REQ_IDS:
            self.bm.free(r)
        self.bm.check_integrity(expect_empty=True)
        assert all(self.bm.num_free(l) == NUM_BLOCKS for l in range(NUM_LAYERS))
        assert self.bm.usage() == 0.0


TestBlockManagerStateful = BlockManagerMachine.TestCase
TestBlockManagerStateful.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
)


def test_layer_prefix_request_holds_nothing_above():
    bm = BlockManager(NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE)
    bm.allocate("a", 9, range(0, 2))  # ran layers 0, 1 only (paused at layer 2)
    assert [bm.num_held("a", l) for l in range(NUM_LAYERS)] == [3, 3, 0, 0]
    assert bm.num_free(2) == bm.num_free(3) == NUM_BLOCKS
    assert bm.table("a", 3) == []
    bm.allocate("a", 9, range(2, NUM_LAYERS))  # resumed
    assert [bm.num_held("a", l) for l in range(NUM_LAYERS)] == [3] * NUM_LAYERS
    bm.check_integrity()
    # releasing migrated layers one at a time; the last one drops the request
    for l in range(NUM_LAYERS):
        assert bm.has("a")
        bm.free_layer("a", l)
        assert bm.num_held("a", l) == 0
        bm.check_integrity()
    assert not bm.has("a")
    bm.check_integrity(expect_empty=True)


def test_covers_a_request_allocated_layer_by_layer():
    """A request whose KV was imported one layer at a time (a hand-off) holds its blocks at every
    layer without the same-blocks fast path: ``covers`` says so (a dynamic-depth exit on a
    decode instance needs it), and not past what the emptiest layer holds."""
    bm = BlockManager(NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE)
    bm.allocate("x", 5, range(1, 2))  # another request's block at layer 1: ids differ there
    for layer in range(NUM_LAYERS):
        bm.allocate("a", 9, range(layer, layer + 1))
    assert bm.covers("a", 9) and bm.covers("a", 3 * BLOCK_SIZE)
    assert not bm.covers("a", 3 * BLOCK_SIZE + 1) and not bm.covers("b", 1)
    bm.allocate("a", 3 * BLOCK_SIZE + 1, range(0, NUM_LAYERS - 1))  # the last layer lags
    assert not bm.covers("a", 3 * BLOCK_SIZE + 1)
    bm.check_integrity()


def test_same_block_ids_across_layers_in_the_common_case():
    """Requests that always allocate over every layer never get per-layer override tables,
    even through random growth and frees; neither does one allocated in two layer ranges."""
    rng = random.Random(0)
    bm = BlockManager(NUM_LAYERS, 64, BLOCK_SIZE)
    tokens: dict[str, int] = {}
    for step in range(300):
        r = f"q{rng.randrange(8)}"
        if r in tokens and rng.random() < 0.2:
            bm.free(r)
            del tokens[r]
            continue
        n = tokens.get(r, 0) + rng.randint(1, 9)
        if not bm.can_allocate(r, n):
            continue
        bm.allocate(r, n)
        tokens[r] = n
        for q in tokens:
            assert bm.overridden_layers(q) == (), (step, q)
            canon = bm.canonical_table(q)
            assert len(canon) == ceil_div(tokens[q], BLOCK_SIZE)
            for l in range(NUM_LAYERS):
                assert bm.table(q, l) == canon
        bm.check_integrity()
    # a chunk paused at layer 2 then resumed: the second range reuses the canonical ids
    bm.allocate("paused", 10, range(0, 2))
    bm.allocate("paused", 10, range(2, NUM_LAYERS))
    assert bm.overridden_layers("paused") == ()
    assert all(bm.table("paused", l) == bm.canonical_table("paused") for l in range(NUM_LAYERS))
    for r in list(tokens) + ["paused"]:
        bm.free(r)
    bm.check_integrity(expect_empty=True)


def test_override_table_when_canonical_id_is_taken():
    """When a request's canonical id is owned at some layer by someone else, that layer
    gets its own table; the other layers keep the canonical ids."""
    bm = BlockManager(2, 2, BLOCK_SIZE)
    bm.allocate("a", BLOCK_SIZE, range(0, 1))  # a: layer 0 only
    (x,) = bm.canonical_table("a")
    bm.allocate("b", BLOCK_SIZE, range(1, 2))  # takes the fully free id
    bm.allocate("c", BLOCK_SIZE, range(1, 2))  # only x is left at layer 1
    assert bm.table("c", 1) == [x]
    bm.free_layer("b", 1)
    bm.allocate("a", BLOCK_SIZE, range(1, 2))  # x is c's at layer 1
    bm.check_integrity()
    assert bm.overridden_layers("a") == (1,)
    assert bm.table("a", 0) == bm.canonical_table("a") == [x]
    assert bm.table("a", 1) != [x] and len(bm.table("a", 1)) == 1
    bm.free("a")
    bm.free("c")
    bm.check_integrity(expect_empty=True)


def test_exhaustion_is_all_or_nothing_with_clear_message():
    bm = BlockManager(NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE)
    bm.allocate("big", (NUM_BLOCKS - 1) * BLOCK_SIZE, range(3, 4))  # layer 3 nearly full
    free = [bm.num_free(l) for l in range(NUM_LAYERS)]
    tables = {l: bm.table("big", l) for l in range(NUM_LAYERS)}
    with pytest.raises(OutOfBlocksError) as ei:
        bm.allocate("new", 2 * BLOCK_SIZE)  # fits in layers 0..2, not in layer 3
    msg = str(ei.value)
    assert "KV cache exhausted" in msg and "new" in msg and "2 blocks" in msg, msg
    assert not bm.has("new")
    assert [bm.num_held("new", l) for l in range(NUM_LAYERS)] == [0] * NUM_LAYERS
    assert [bm.num_free(l) for l in range(NUM_LAYERS)] == free
    assert {l: bm.table("big", l) for l in range(NUM_LAYERS)} == tables
    bm.check_integrity()
    # growing an existing request that does not fit leaves it as it was
    bm.allocate("small", BLOCK_SIZE)
    held = [bm.num_held("small", l) for l in range(NUM_LAYERS)]
    with pytest.raises(OutOfBlocksError):
        bm.allocate("small", 3 * BLOCK_SIZE)
    assert [bm.num_held("small", l) for l in range(NUM_LAYERS)] == held
    # exactly what is left still fits
    bm.free("small")
    bm.allocate("new", BLOCK_SIZE)
    bm.free("new")
    bm.free("big")
    bm.check_integrity(expect_empty=True)


def test_check_integrity_detects_corruption():
    """The checker itself can fail: a leaked block, a double-owned block, a block both owned and
    free, a block both fully and partly free are caught."""
    bm = BlockManager(2, 4, BLOCK_SIZE)
    bm.allocate("a", BLOCK_SIZE)
    bm._fully_free.discard(next(iter(bm._fully_free)))  # leak one free block
    with pytest.raises(BlockManagerIntegrityError, match="leaked"):
        bm.check_integrity()
    bm = BlockManager(2, 4, BLOCK_SIZE)
    bm.allocate("a", BLOCK_SIZE)
    bm.allocate("b", BLOCK_SIZE)
    bid = bm.table("a", 1)[0]
    bm._reqs["b"].overrides[1] = [bid]  # b claims a's block at layer 1
    with pytest.raises(BlockManagerIntegrityError):
        bm.check_integrity()
    bm = BlockManager(2, 4, BLOCK_SIZE)
    bm.allocate("a", BLOCK_SIZE)
    bm._extra[0].add(bm.table("a", 0)[0])  # a's block also listed free at layer 0
    with pytest.raises(BlockManagerIntegrityError, match="both free and owned"):
        bm.check_integrity()
    bm = BlockManager(2, 4, BLOCK_SIZE)
    bm.allocate("a", BLOCK_SIZE)
    bm._extra[1].add(next(iter(bm._fully_free)))  # a fully free block also listed as free at layer 1 only
    with pytest.raises(BlockManagerIntegrityError, match="both fully and partly free"):
        bm.check_integrity()
    bm = BlockManager(2, 4, BLOCK_SIZE)
    bm.allocate("a", BLOCK_SIZE)
    with pytest.raises(BlockManagerIntegrityError, match="still held"):
        bm.check_integrity(expect_empty=True)


# -- KVCache per-layer export / import ------------------------------------------------------------


def tiny_model_config(num_layers=3) -> ModelConfig:
    return ModelConfig(
        model_type="llama",
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-5,
        max_position=256,
        tie_word_embeddings=True,
        qkv_bias=False,
        qk_norm=False,
    )


def test_kv_export_import_round_trip_one_layer():
    mc = tiny_model_config()
    src = KVCache(mc, CacheConfig(block_size=4, num_blocks=8), torch.float32)
    dst = KVCache(mc, CacheConfig(block_size=4, num_blocks=8), torch.float32)
    assert src.kv.shape == (3, 2, 32, 2, 8)
    g = torch.Generator().manual_seed(0)
    src.kv.copy_(torch.randn(src.kv.shape, generator=g))
    n, layer = 10, 1  # 10 tokens: 3 blocks, the last one partly filled
    src.block_manager.allocate("other", 5)  # so the request's blocks are not simply 0..2
    src.block_manager.allocate("r", n)
    k, v = src.export_layer("r", layer, n)
    assert k.shape == v.shape == (n, 2, 8)
    # exported tokens are exactly the ones at the request's slots of that layer
    table = src.block_manager.table("r", layer)
    for pos in range(n):
        slot = table[pos // 4] * 4 + pos % 4
        assert torch.equal(k[pos], src.kv[layer, 0, slot])
        assert torch.equal(v[pos], src.kv[layer, 1, slot])
    assert not torch.equal(k, v)
    # the destination has other data at that layer, which the import must not clobber
    dst.block_manager.allocate("resident", 7, range(layer, layer + 1))
    dst.kv.copy_(torch.randn(dst.kv.shape, generator=g))
    resident = dst.export_layer("resident", layer, 7)
    before = dst.kv.clone()
    dst.import_layer("r", layer, k, v)
    bm = dst.block_manager
    assert [bm.num_held("r", l) for l in range(3)] == [0, 3, 0]  # only that layer
    k2, v2 = dst.export_layer("r", layer, n)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    r2 = dst.export_layer("resident", layer, 7)
    assert torch.equal(r2[0], resident[0]) and torch.equal(r2[1], resident[1])
    # nothing outside the imported slots changed (other layers included)
    changed = (dst.kv != before).any(dim=(-1, -2))  # [layers, 2, slots]
    imported = torch.zeros_like(changed)
    slots = dst.slots(bm.table("r", layer), 0, n)
    imported[layer, :, slots] = True
    assert not (changed & ~imported).any()
    bm.check_integrity()
    # the source still holds its copy; mutating the export does not touch the cache
    k.zero_()
    assert not torch.equal(src.export_layer("r", layer, n)[0], k)
    for c, ids in ((src, ("r", "other")), (dst, ("r", "resident"))):
        for rid in ids:
            c.block_manager.free(rid)
        c.block_manager.check_integrity(expect_empty=True)


def test_kv_import_into_full_layer_raises_and_keeps_nothing():
    mc = tiny_model_config()
    kv = KVCache(mc, CacheConfig(block_size=4, num_blocks=2), torch.float32)
    kv.block_manager.allocate("full", 8, range(0, 1))
    k = torch.ones(5, 2, 8)
    with pytest.raises(OutOfBlocksError):
        kv.import_layer("r", 0, k, k)
    assert not kv.block_manager.has("r")
    kv.import_layer("r", 1, k, k)  # another layer still has room
    assert kv.block_manager.num_held("r", 1) == 2
    kv.block_manager.free("r")
    kv.block_manager.free("full")
    kv.block_manager.check_integrity(expect_empty=True)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _resident_in_mapping(ptr: int) -> int:
    """Resident bytes of the memory mapping holding address ``ptr`` (``/proc/self/smaps``): the pages of
    that buffer taken, whatever the rest of the process did before (a whole-process RSS delta is 0 when the
    allocator hands back pages a freed buffer left resident)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    return 0


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads Linux's /proc")
def test_kv_pool_is_zero_aligned_and_takes_memory_only_where_written():
    """A 512 MiB pool reads as zeros, is contiguous and cache-line aligned, and costs resident
    memory for the pages written (a test suite of many instances once held 22 GB of untouched pools)."""
    mc = tiny_model_config(num_layers=4)
    before = _rss_bytes()
    kv = KVCache(mc, CacheConfig(block_size=16, kv_cache_gib=0.5), torch.float32)
    assert kv.nbytes == 4 * 2 * kv.num_blocks * 16 * 2 * 8 * 4 and kv.nbytes >= (1 << 29) - (1 << 20)
    assert kv.kv.is_contiguous() and kv.kv.data_ptr() % 64 == 0
    assert _rss_bytes() - before < (64 << 20)
    kv.kv[3, 1, -1] = 2.0  # the last slot is writable and nothing else moved
    assert kv.kv[3, 1, -1].sum().item() == 2.0 * 16 and kv.kv[0, 0, :4096].abs().sum().item() == 0.0
    kv.kv[1].fill_(1.0)  # a written layer takes its memory
    assert _rss_bytes() - before > kv.nbytes // 8


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc")
def test_kv_pool_takes_its_pages_at_start_by_default(monkeypatch):
    """Outside the test suite (``LASER_KV_PREFAULT`` unset: 1) the pool's pages are taken when it is
    built, as a server wants; the value is checked."""
    monkeypatch.delenv("LASER_KV_PREFAULT")
    mc = tiny_model_config(num_layers=4)
    kv = KVCache(mc, CacheConfig(block_size=16, kv_cache_gib=0.125), torch.float32)
    assert _resident_in_mapping(kv.kv.data_ptr()) > kv.nbytes * 3 // 4 and not kv.kv.any()
    monkeypatch.setenv("LASER_KV_PREFAULT", "yes")
    with pytest.raises(ValueError, match="LASER_KV_PREFAULT"):
        KVCache(mc, CacheConfig(block_size=16, num_blocks=4), torch.float32)


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="reads Linux's /proc")
def test_kv_pool_larger_than_the_host_memory_is_refused_up_front():
    mc = tiny_model_config()
    with pytest.raises(ConfigError, match="available: lower --kv-cache-gib"):
        KVCache(mc, CacheConfig(block_size=16, kv_cache_gib=1 << 20), torch.float32)
