"""The executor's fast paths compute what their plain references compute (tiny Llama, fp32).

- LM head: one row reads the transposed copy, several rows the oneDNN-packed copy; both
  equal ``F.linear`` on the plain weight within fp32 rounding, and a row's logits do not
  depend on how many rows were computed with it.
- Attention: a group whose query rows are contiguous slices them (``q_start``); the
  gather path over ``q_index`` gives bit-identical outputs.
- The three pieces of a layer (qkv, attend, finish_layer) that the profiler times
  separately compose to exactly ``forward_layer``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from laser.core.config import CacheConfig
from laser.frontend.engine import Engine
from laser.core.plan import Work


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine(str(tiny_llama), policy="vllm", dtype="float32", cache=CacheConfig(num_blocks=256))


def test_lm_head_layouts_agree(engine):
    m = engine.model
    if torch.backends.mkldnn.is_available():
        assert m.lm_head_packed is not None  # the packed path is really taken here
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, m.config.hidden_size, generator=g)
    with torch.inference_mode():
        ref = F.linear(m._norm(hidden, m.norm_w), m.lm_head_w)
        batched = m.compute_logits(hidden)
        rows = torch.cat([m.compute_logits(hidden[i : i + 1]) for i in range(6)])
        pair = m.compute_logits(hidden[2:4])
    assert batched.dtype == torch.float32 and batched.shape == ref.shape
    assert torch.allclose(batched, ref, atol=1e-5, rtol=0), float((batched - ref).abs().max())
    assert torch.allclose(rows, ref, atol=1e-5, rtol=0), float((rows - ref).abs().max())
    assert torch.allclose(pair, batched[2:4], atol=1e-5, rtol=0)


def _metadata(engine, query_lens, context_lens):
    """Metadata for fake works (blocks allocated at layer 0, then freed; slots stay valid)."""
    bm, runner = engine.kv_cache.block_manager, engine.runner
    N = engine.model_config.num_layers
    works = []
    for k, (q, c) in enumerate(zip(query_lens, context_lens)):
        bm.allocate(f"fp{k}", c, range(0, N))
        works.append(Work(f"fp{k}", c - q, q, 0, N))
    works.sort(key=lambda w: (w.num_tokens > 1, w.context_len if w.num_tokens == 1 else 0))
    try:
        return runner._build_metadata(works, range(0, N))
    finally:
        for k in range(len(works)):
            bm.free(f"fp{k}")


@pytest.mark.parametrize(
    "query_lens,context_lens",
    [
        ([1, 1, 1], [5, 40, 17]),  # one decode group
        ([1, 1, 6, 6], [9, 30, 6, 20]),  # decode group + equal-length prefill chunks
        ([1, 4, 9], [12, 4, 25]),  # decode + padded prefill group (gather path only)
    ],
)
def test_sliced_query_rows_equal_gathered(engine, query_lens, context_lens):
    m, c = engine.model, engine.model_config
    meta = _metadata(engine, query_lens, context_lens)
    assert any(grp.q_start is not None for grp in meta.groups)
    gathered = dataclasses.replace(meta, groups=[dataclasses.replace(grp, q_start=None) for grp in meta.groups])
    T = sum(query_lens)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(T, c.hidden_size, generator=g)
    with torch.inference_mode():
        m.kv[0].normal_(generator=g)  # context K/V of every slot
        q, k, v = m.qkv(0, hidden, meta.cos, meta.sin)
        fast = m.attend(0, q, k, v, meta)
        slow = m.attend(0, q, k, v, gathered)
        whole = m.forward_layer(0, hidden, meta)
        parts = m.finish_layer(0, hidden, m.attend(0, *m.qkv(0, hidden, meta.cos, meta.sin), meta))
    assert fast.shape == (T, c.num_heads, c.head_dim)
    assert torch.isfinite(fast).all()
    assert torch.equal(fast, slow)
    assert torch.equal(whole, parts)
