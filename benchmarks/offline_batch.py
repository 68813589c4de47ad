"""The offline case of issue 16 on the real engine: one batch through ``LLM.generate`` per policy.

24 short prompts x 32 output tokens (``ignore_eos``), SLO classes chat / code / summarization
round-robin, all submitted at once, the paper's unscaled targets (the shipped classes). Prints,
per policy, the wall time of the batch, the engine steps, and per class how many requests met
their TTFT and their whole SLO (``laser.core.metrics``: finished, TTFT and P99 TBT within target). Each policy gets a fresh engine and a 2-prompt warm-up first.

Usage: python benchmarks/offline_batch.py [--threads 1] [--policies vllm,sarathi,laser] [--model PATH]
       [--prompts 24] [--max-tokens 32] [--repeats 1]

Real engine, real timing: say which CPU and whether the machine was quiet next to any figure.
"""

from __future__ import annotations

import argparse
import platform

from laser.bench.offline import CLASSES, run_offline_batch as run  # noqa: F401 (the batch run itself)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF checkpoint dir or GGUF file (default: the embedded SmolLM2)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: physical cores)")
    ap.add_argument("--policies", default="vllm,sarathi,laser", help="comma list of policies, run in this order")
    ap.add_argument("--prompts", type=int, default=24, help="prompts in the batch (default 24)")
    ap.add_argument("--max-tokens", type=int, default=32, help="output tokens per prompt (default 32)")
    ap.add_argument("--repeats", type=int, default=1, help="rounds over the policies, interleaved (default 1)")
    a = ap.parse_args()
    if a.prompts < 1 or a.max_tokens < 2 or a.repeats < 1:
        ap.error("--prompts and --repeats must be >= 1, --max-tokens >= 2")
    from laser.cli import set_threads

    n = set_threads(a.threads)
    prompts = [f"Write a short note number {i} about the sea and the sky." for i in range(a.prompts)]
    print(f"real engine, {a.model or 'embedded SmolLM2-135M'}, {n} thread(s), {platform.processor() or platform.machine()}; "
          f"{a.prompts} prompts x {a.max_tokens} tokens, classes {'/'.join(CLASSES)} round-robin, all at once")
    print(f"{'policy':>8} {'wall s':>7} {'steps':>6}  TTFT met / SLO met per class")
    for _ in range(a.repeats):
        for policy in a.policies.split(","):
            r = run(policy, prompts, a.max_tokens, a.model)
            per = ", ".join(f"{c} {r['ttft_met'][c]}/{r['slo_met'][c]}" for c in CLASSES)
            print(f"{policy:>8} {r['wall_s']:>7.2f} {r['steps']:>6}  {per}  (SLO met {sum(r['slo_met'].values())})",
                  flush=True)


if __name__ == "__main__":
    main()
