"""Start-up warm-up of every row count (laser.model.warm_rows): which dtypes it runs for
(``LASER_WARM_ROWS``), that it runs layer 0's QKV and finishing parts on each row count 1..N and the
LM head on 1..M exactly once, that it writes no KV and changes no weight, that an engine built
with it logs it and generates the same greedy tokens as one built without it. No timing is
asserted."""

from __future__ import annotations

import logging

import pytest
import torch

from laser import LLM, SamplingParams
from laser.model import warm_rows
from laser.model.llama import LlamaModel
from laser.model.loader import load_config, load_weights


def test_mode_from_the_environment(monkeypatch):
    monkeypatch.delenv("LASER_WARM_ROWS", raising=False)
    assert warm_rows.warm_rows_mode(torch.bfloat16) and not warm_rows.warm_rows_mode(torch.float32)
    monkeypatch.setenv("LASER_WARM_ROWS", "1")
    assert warm_rows.warm_rows_mode(torch.float32)
    monkeypatch.setenv("LASER_WARM_ROWS", "0")
    assert not warm_rows.warm_rows_mode(torch.bfloat16)
    monkeypatch.setenv("LASER_WARM_ROWS", "yes")
    with pytest.raises(ValueError, match="LASER_WARM_ROWS"):
        warm_rows.warm_rows_mode(torch.bfloat16)


def test_every_row_count_once_and_nothing_written(tiny_llama, monkeypatch):
    model = LlamaModel(load_config(tiny_llama), load_weights(tiny_llama), torch.bfloat16)
    kv = torch.zeros(model.config.num_layers, 2, 8, model.config.num_kv_heads, model.config.head_dim,
                     dtype=torch.bfloat16)
    model.bind_kv_cache(kv)
    weights = [t.clone() for t in (model.embed_w, model.norm_w, model.layers[0].ln1, model.layers[0].ln2)]
    seen = {"qkv": [], "finish": [], "head": []}
    for name, key in (("qkv", "qkv"), ("finish_layer", "finish"), ("compute_logits", "head")):
        orig = getattr(model, name)

        def spy(*a, orig=orig, key=key):
            hidden = a[1] if key != "head" else a[0]
            seen[key].append((a[0] if key != "head" else 0, hidden.shape[0]))
            return orig(*a)
        monkeypatch.setattr(model, name, spy)
    msg = warm_rows.warm_row_counts(model, 37, 5)
    assert seen["qkv"] == seen["finish"] == [(0, m) for m in range(1, 38)]
    assert seen["head"] == [(0, m) for m in range(1, 6)]
    assert "1-37" in msg and "1-5" in msg
    assert not kv.any()  # no KV written
    after = (model.embed_w, model.norm_w, model.layers[0].ln1, model.layers[0].ln2)
    assert all(torch.equal(a, b) for a, b in zip(weights, after))
    with pytest.raises(ValueError):
        warm_rows.warm_row_counts(model, -1, 0)


def test_engine_warms_at_start_and_generates_the_same(tiny_llama, monkeypatch, caplog):
    prompts = [[5, 9, 13, 2, 7], list(range(20, 61))]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    out = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("LASER_WARM_ROWS", mode)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="laser.instance.model_instance"):
            llm = LLM(str(tiny_llama), policy="vllm", dtype="float32", max_model_len=128, max_num_batched_tokens=48)
        assert ("row counts 1-176 of a layer call" in caplog.text) == (mode == "1")  # 48 tokens + 128 decode rows
        out[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert out["0"] == out["1"]


def test_engine_warms_at_most_the_cap(tiny_llama, monkeypatch, caplog):
    """A step budget past :data:`~laser.model.warm_rows.WARM_MAX_ROWS` warms up to the cap only
    (engine_speed's 4,096-token engines warmed every count to 4,096 and ran out of memory)."""
    monkeypatch.setenv("LASER_WARM_ROWS", "1")
    monkeypatch.setattr(warm_rows, "WARM_MAX_ROWS", 40)
    with caplog.at_level(logging.INFO, logger="laser.instance.model_instance"):
        LLM(str(tiny_llama), policy="vllm", dtype="float32", max_model_len=128, max_num_batched_tokens=96,
            max_num_seqs=3)
    assert "row counts 1-40 of a layer call and 1-3 of the LM head" in caplog.text
    assert "counts 41-99 (this engine's token budget and decode rows) are set up at first use" in caplog.text


def test_layer_row_counts_cover_the_token_budget_and_decode_rows_up_to_the_cap():
    assert warm_rows.layer_row_counts(512, 256) == (640, 640)  # a 512-token chunk beside 128 decode rows
    assert warm_rows.layer_row_counts(512, 8) == (520, 520)  # no more decode rows than requests
    assert warm_rows.layer_row_counts(4096, 256) == (warm_rows.WARM_MAX_ROWS, 4224)  # the rest at first use
