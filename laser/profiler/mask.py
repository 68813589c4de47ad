"""The grammar mask's share of the sampling term (structured output, issue 30).

A request with structured output pays, per sampled token, llguidance's next-token mask: the
matcher walks the tokenizer's trie to fill a bitmask over the vocabulary, which is then applied
to the logits row (:meth:`laser.model.structured.GrammarBackend.mask`). The profiler's LM-head
samples are plain rows, so the latency model prices the mask apart: ``mask_row_s`` seconds per
masked row (:meth:`laser.latency.LatencyModel.mask_time`), measured here on the model's own
tokenizer, or estimated from the vocabulary size where no measurement exists (a profile made
before it was measured, the roofline model).
"""

from __future__ import annotations

import json
import statistics
import time

import torch

#: Seconds of one grammar mask per vocabulary entry: measured with :func:`measure_mask_row_s`
#: (the JSON schema of :data:`SCHEMA`, the embedded SmolLM2's tokenizer, 49152 entries) on an
#: AVX2 AMD EPYC, 1 thread, shared with other jobs (load ~2.5): medians 0.77-1.18 ms per row
#: over 3 runs, the best 0.77 ms = 15.6 ns per entry (``benchmarks/sampling_cost.py`` prints
#: it; docs/benchmarks.md). The mask walks the token trie: its cost grows with the vocabulary.
MASK_S_PER_VOCAB_ENTRY = 1.56e-8

#: The grammar :func:`measure_mask_row_s` times: a JSON object with a free string and an array of
#: strings (both wide: most tokens are allowed inside a string, the mask's costly case).
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 400},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "tags"]}


def estimate_mask_row_s(vocab_size: int) -> float:
    """Seconds of one grammar mask on a ``vocab_size`` row, without a measurement
    (:data:`MASK_S_PER_VOCAB_ENTRY` x the vocabulary)."""
    return MASK_S_PER_VOCAB_ENTRY * vocab_size


def measure_mask_row_s(tokenizer, vocab_size: int, eos_ids=(), steps: int = 48, seed: int = 0) -> float:
    """Median seconds of one grammar mask of one row (fill + apply, :meth:`GrammarBackend.mask`)
    over ``steps`` tokens of a JSON document following :data:`SCHEMA`, the matcher advanced by
    the most likely allowed token of random logits each step (untimed). The llguidance
    tokenizer is built first (seconds; not timed).

    Args:
        tokenizer: a Hugging Face tokenizer, or the model directory to load it from.
        vocab_size: the logits row length. eos_ids: end-of-sequence ids.
    Raises:
        ValueError: ``steps`` below 1.
    """
    from ..core.request import Request, SamplingParams
    from ..model.structured import GrammarBackend

    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    backend = GrammarBackend(tokenizer, vocab_size, eos_ids)
    backend.ll_tokenizer  # noqa: B018 - built once per engine; not part of a step
    req = Request([1], SamplingParams(max_tokens=steps + 1, structured_output=("json", json.dumps(SCHEMA))),
                  req_id="profile-mask")
    g = torch.Generator().manual_seed(seed)
    times, state = [], None
    for _ in range(steps + 1):  # the first (matcher built) is not timed
        row = torch.randn(vocab_size, generator=g)
        t0 = time.perf_counter()
        state = backend.mask(row, req, state)
        times.append(time.perf_counter() - t0)
        tok = int(row.argmax())
        if tok in backend.eos_ids:
            break
        req.output_token_ids.append(tok)
    return statistics.median(times[1:] or times)
