"""``sarathi``: Sarathi-Serve chunked prefill with decode-maximal hybrid batches.

Agrawal et al., OSDI'24; vLLM v1's default scheduler behaves the same way.
"""

from __future__ import annotations

from ..core.plan import StepPlan
from .base import Scheduler


class SarathiScheduler(Scheduler):
    name = "sarathi"

    def schedule(self, now: float) -> StepPlan:
        # Rule: every iteration runs all layers for (1) one token of every decoding request,
        # then (2) prefill chunks filling the rest of the token budget
        # (max_num_batched_tokens): ongoing prefills first, then waiting requests, each
        # in queue order; a chunk is min(remaining prompt, remaining budget).
        # A waiting request blocked by max_num_seqs or the KV pool preempts running requests
        # of a less strict SLO class (make_room). A prompt's cached prefix is not computed
        # again and does not count against the budget (lookup_prefix).
        self.refresh_prefixes()
        self.preempt_for_stricter()
        works = []
        decodes = self.preempt_for_decode(sorted(self.decoding(), key=self.queue_key))
        works.extend(self.full_work(r, 1) for r in decodes)
        planned = {w.req_id for w in works}
        budget = self.config.max_num_batched_tokens - len(works)
        cap = self.config.max_num_seqs
        for req in self.prefilling() + list(self.waiting):
            if budget <= 0:
                break
            if req not in self.running and req not in self.waiting:  # preempted for an earlier one
                continue
            if req in self.waiting:
                self.lookup_prefix(req)
            n = min(self.prefill_remaining(req), budget)
            if req in self.waiting and not self.make_room(req, lambda: len(self.running) < cap, "running_cap", planned):
                break
            tokens = req.num_computed_tokens + n
            if not self.make_room(req, lambda: self.try_allocate(req, tokens), "slo", planned,
                                  self.bm.blocks_needed(tokens)):
                break
            planned.add(req.req_id)
            if req in self.waiting:
                self.admit(req)
            works.append(self.full_work(req, n))
            budget -= n
        self.relieve_deadlock(works)
        return StepPlan(self.num_layers, works)
