"""A steady decode batch derived in place (laser.model.attn_steady, AttnGroup.cols) gives the C++
decode kernel the same output bits as the builder's [B, C] batch, and an engine whose runner
derives in place decodes the very tokens of one that builds (or derives out of place)."""

from __future__ import annotations

import pytest
import torch

from laser.core.config import CacheConfig, SchedulerConfig
from laser.core.request import SamplingParams
from laser.frontend.engine import Engine
from laser.model import attn_steady
from laser.model.attn_kernel import decode_attention_kernel, load_kernel


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_reads_only_the_context_columns(dtype):
    kernel = load_kernel(dtype)
    assert kernel is not None
    gen = torch.Generator().manual_seed(3)
    kvh, g, d, slots = 3, 3, 64, 40 * 16
    kc = torch.randn(slots, kvh, d, generator=gen).to(dtype)
    vc = torch.randn(slots, kvh, d, generator=gen).to(dtype)
    lens, C, L = [37, 90, 5], 90, 160
    q = torch.randn(len(lens), kvh * g, d, generator=gen).to(dtype)
    idx = torch.randint(0, slots, (len(lens), C), generator=gen)
    mask = torch.zeros(len(lens), C).to(dtype)
    for b, n in enumerate(lens):
        mask[b, n:] = float("-inf")
    # spare columns: real slots, unmasked -- read, they would change every output
    wide_idx = torch.randint(0, slots, (len(lens), L), generator=gen)
    wide_idx[:, :C] = idx
    wide_mask = torch.zeros(len(lens), 1, 1, L).to(dtype)
    wide_mask[:, 0, 0, :C] = mask
    want = decode_attention_kernel(kernel, q, kc, vc, idx, mask)
    got = decode_attention_kernel(kernel, q, kc, vc, wide_idx, wide_mask, cols=C)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(got.view(bits), want.view(bits))


def _tokens(path, in_place: bool, dtype: str):
    e = Engine(str(path), policy="vllm", dtype=dtype, quantization="int4",
               cache=CacheConfig(num_blocks=96), scheduler=SchedulerConfig(policy="vllm"))
    run = e.runner
    assert run._steady.in_place  # an engine with the C++ decode kernel derives in place
    if not in_place:
        run._steady = attn_steady.SteadyDecode()
    reqs = [e.add_request([5 + 3 * i + j for j in range(7 + 5 * i)], SamplingParams(max_tokens=24 + 6 * i,
                                                                                   temperature=0))
            for i in range(3)]
    late = None
    for step in range(400):
        if not e.has_unfinished():
            break
        if step == 9:  # a join mid-decode: the batch is built anew, then derived again
            late = e.add_request(list(range(40, 71)), SamplingParams(max_tokens=20, temperature=0))
        e.step()
    return [r.output_token_ids for r in reqs + [late]]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_engine_tokens_do_not_depend_on_in_place_derivation(tiny_llama, monkeypatch, dtype):
    monkeypatch.setenv("LASER_FUSED_DECODE", "1")
    calls: list = []
    grow = attn_steady.SteadyDecode._grow_in_place
    monkeypatch.setattr(attn_steady.SteadyDecode, "_grow_in_place", lambda *a: calls.append(1) or grow(*a))
    assert _tokens(tiny_llama, True, dtype) == _tokens(tiny_llama, False, dtype)
    assert len(calls) >= 20  # steady steps derived in place
