"""``sarathi``: Sarathi-Serve chunked prefill with decode-maximal hybrid batches.

Agrawal et al., OSDI'24; vLLM v1's default scheduler behaves the same way.
"""

from __future__ import annotations

from ..plan import StepPlan
from .base import Scheduler


class SarathiScheduler(Scheduler):
    name = "sarathi"

    def schedule(self, now: float) -> StepPlan:
        # Rule: every iteration runs all layers for (1) one token of every decoding request,
        # then (2) prefill chunks filling the rest of the token budget
        # (max_num_batched_tokens): ongoing prefills first, then waiting requests, each
        # in queue order; a chunk is min(remaining prompt, remaining budget).
        works = []
        decodes = self.preempt_for_decode(sorted(self.decoding(), key=self.queue_key))
        works.extend(self.full_work(r, 1) for r in decodes)
        budget = self.config.max_num_batched_tokens - len(works)
        for req in self.prefilling() + list(self.waiting):
            if budget <= 0:
                break
            n = min(self.prefill_remaining(req), budget)
            if req in self.waiting and len(self.running) >= self.config.max_num_seqs:
                break
            if not self.try_allocate(req, req.num_computed_tokens + n):
                break
            if req in self.waiting:
                self.admit(req)
            works.append(self.full_work(req, n))
            budget -= n
        self.relieve_deadlock(works)
        return StepPlan(self.num_layers, works)
