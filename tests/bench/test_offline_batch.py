"""laser.bench.offline (issue 16's offline case, benchmarks/offline_batch.py): one real batch per
policy on a tiny random-weight model, counted per class (the figures themselves are a benchmark)."""

from laser.bench.offline import CLASSES, run_offline_batch


def test_a_batch_is_counted_per_class_for_every_policy(tiny_llama):
    prompts = [f"note {i} about the sea" for i in range(6)]
    for policy in ("sarathi", "laser"):
        r = run_offline_batch(policy, prompts, 3, model=str(tiny_llama))
        assert r["wall_s"] > 0 and r["steps"] >= 3  # at least one step per output token
        assert sum(r["ttft_met"].values()) <= len(prompts) and set(r["ttft_met"]) == set(CLASSES)
        for c in CLASSES:  # an SLO met needs its TTFT met
            assert 0 <= r["slo_met"][c] <= r["ttft_met"][c] <= 2
