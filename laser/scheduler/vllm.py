"""``vllm``: iteration-level continuous batching, prefill first (Orca / vLLM v0)."""

from __future__ import annotations

from ..core.plan import StepPlan
from .base import Scheduler


class VLLMScheduler(Scheduler):
    name = "vllm"

    def schedule(self, now: float) -> StepPlan:
        # Rule: when waiting requests fit (KV blocks, max_num_seqs and the token budget
        # max_num_batched_tokens), run a prefill-only batch of whole prompts in queue order
        # (the first one even if it alone exceeds the budget); otherwise run one decode
        # token for every running request through every layer.
        # A waiting request blocked by max_num_seqs or the KV pool preempts running requests
        # of a less strict SLO class (make_room). A prompt's cached prefix is not computed
        # again and does not count against the budget (lookup_prefix).
        self.refresh_prefixes()
        self.preempt_for_stricter()
        works = []
        budget = self.config.max_num_batched_tokens
        cap = self.config.max_num_seqs
        planned: set[str] = set()
        for req in list(self.waiting):
            self.lookup_prefix(req)
            n = self.prefill_remaining(req)
            if works and n > budget:
                break
            if not self.make_room(req, lambda: len(self.running) < cap, "running_cap", planned):
                break
            total = req.num_tokens
            if not self.make_room(req, lambda: self.try_allocate(req, total), "slo", planned,
                                  self.bm.blocks_needed(total)):
                break
            planned.add(req.req_id)
            self.admit(req)
            works.append(self.full_work(req, n))
            budget -= n
        if not works:
            for req in self.preempt_for_decode(sorted(self.decoding(), key=self.queue_key)):
                works.append(self.full_work(req, 1))
            self.relieve_deadlock(works)
        return StepPlan(self.num_layers, works)
