"""The sampler's cost per token of each logits control, beside plain sampling (issue 30).

Times :meth:`laser.sampler.Sampler.sample` on rows of the embedded SmolLM2's vocabulary
(49152) at batch 1 and 32, interleaved round by round so a busy machine disturbs every variant
alike, and prints the best (min) time per step, its ratio to plain greedy sampling, and the
median:

* ``plain``: greedy, no controls (the path every request without these fields takes);
* ``penalties``: presence + frequency + repetition penalties over a 2000-token context;
* ``logprobs``: top-5 raw logprobs of the sampled token;
* ``grammar``: a JSON-schema mask (llguidance) at each step, the matcher advanced by the
  sampled token (the grammar's per-token cost);
* ``allowed``: 100 ``allowed_token_ids``; ``bad_words``: 10 bad words of 1 to 3 tokens;

then the grammar mask alone per sampled row, as ``laser profile`` measures it for the latency
model's sampling term (:func:`laser.profiler.mask.measure_mask_row_s`), and that per vocabulary
entry (the figure :data:`laser.profiler.mask.MASK_S_PER_VOCAB_ENTRY` is set from).

Run from the repository root::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/sampling_cost.py [--rounds 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from laser.model.loader import load_tokenizer, resolve_model
from laser.core.request import Request, SamplingParams
from laser.model.sampler import Sampler
from laser.model.structured import GrammarBackend
from laser.profiler.mask import MASK_S_PER_VOCAB_ENTRY, SCHEMA, measure_mask_row_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20, help="timed steps per variant and batch size (default 20)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2, as the engine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = load_tokenizer(resolve_model(None))
    V = 49152
    eos = {tok.eos_token_id}
    sampler = Sampler(0, eos)
    sampler.grammars = GrammarBackend(tok, V, eos)
    t0 = time.perf_counter()
    sampler.grammars.ll_tokenizer  # noqa: B018 - built once per engine, on the first structured request
    build_s = time.perf_counter() - t0
    variants = {
        "plain": dict(),
        "penalties": dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2),
        "logprobs": dict(logprobs=5),
        "grammar": dict(structured_output=("json", json.dumps(SCHEMA))),
        # vLLM's token lists (session 24): 100 allowed ids; 10 bad words of 1-3 tokens (ids as the
        # input path would set them)
        "allowed": dict(allowed_token_ids=list(range(0, V, V // 100))),
        "bad_words": dict(bad_words=["w"] * 10, bad_words_token_ids=tuple(
            tuple(range(1000 + 7 * i, 1000 + 7 * i + 1 + i % 3)) for i in range(10))),
    }
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, V, (2000,), generator=g).tolist()
    print(f"llguidance tokenizer built in {build_s:.2f} s (once per engine)")
    print(f"{'batch':>5} {'variant':>10} {'min ms':>9} {'x plain':>8} {'median ms':>10}")
    for batch in (1, 32):
        reqs = {name: [Request(prompt, SamplingParams(max_tokens=4096, temperature=0.0, **kw)) for _ in range(batch)]
                for name, kw in variants.items()}
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            logits = torch.randn(batch, V, generator=g) * 3
            for name, rs in reqs.items():
                lp = {} if name == "logprobs" else None
                t = time.perf_counter()
                toks = sampler.sample(logits, rs, lp)
                times[name].append(time.perf_counter() - t)
                if name == "grammar":  # the grammar's sampled token, so the matcher advances
                    for r, tk in zip(rs, toks):
                        r.output_token_ids.append(tk)
        base = min(times["plain"])
        for name, ts in times.items():  # min: a busy machine only adds time; the median shows how much
            print(f"{batch:>5} {name:>10} {min(ts) * 1e3:>9.3f} {min(ts) / base:>8.2f} {statistics.median(ts) * 1e3:>10.3f}")
    # the latency model's grammar term: what `laser profile` measures (laser.profiler.mask), and the
    # per-vocabulary-entry figure its estimate uses where no profile measured it
    mask_s = min(measure_mask_row_s(tok, V, eos, seed=r) for r in range(3))
    print(f"grammar mask per sampled row (laser.profiler.mask.measure_mask_row_s, best of 3 medians): "
          f"{mask_s * 1e3:.3f} ms = {mask_s / V * 1e9:.1f} ns per vocabulary entry "
          f"(MASK_S_PER_VOCAB_ENTRY = {MASK_S_PER_VOCAB_ENTRY * 1e9:.1f} ns)")


if __name__ == "__main__":
    main()
