"""The offline case of issue 16 on the real engine: one batch through ``LLM.generate`` per policy,
counted per SLO class (``benchmarks/offline_batch.py`` prints the figures; the tests run it on a
tiny model)."""

from __future__ import annotations

import time

CLASSES = ("chat", "code", "summarization")


def run_offline_batch(policy: str, prompts: list[str], max_tokens: int, model: str | None = None) -> dict:
    """One batch on a fresh engine of ``model`` (default: the embedded SmolLM2); returns
    ``wall_s`` (seconds), ``steps`` and per-class ``ttft_met`` / ``slo_met`` counts."""
    from laser import LLM
    from laser.core.metrics import SLO_EPS, record_from_request
    from laser.core.request import SamplingParams

    llm = LLM(model=model, policy=policy)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    steps0 = llm.engine.core.step_stats.steps
    slos = [CLASSES[i % 3] for i in range(len(prompts))]
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0), slo=slos)
    wall = time.perf_counter() - t
    ttft_met = dict.fromkeys(CLASSES, 0)
    slo_met = dict.fromkeys(CLASSES, 0)
    for name, o in zip(slos, outs):
        rec = record_from_request(o.request)
        ttft_met[name] += rec.ttft <= rec.ttft_slo + SLO_EPS
        slo_met[name] += rec.slo_met
    return {"wall_s": wall, "steps": llm.engine.core.step_stats.steps - steps0, "ttft_met": ttft_met,
            "slo_met": slo_met}
