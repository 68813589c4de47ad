"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

A seeded request owns a ``torch.Generator`` (created on its first sample, dropped when it
finishes), so its draws do not depend on what it is batched with. Unseeded requests share
one generator. Semantics follow vLLM's ``SamplingParams``.
"""

from __future__ import annotations

import torch

from ..core.request import Request


class Sampler:
    def __init__(self, seed: int = 0):
        self._shared = torch.Generator().manual_seed(seed)
        self._gens: dict[str, torch.Generator] = {}

    def release(self, req_id: str) -> None:
        self._gens.pop(req_id, None)

    def export_state(self, req_id: str) -> bytes | None:
        """The seeded request's generator state (``torch.Generator.get_state`` as bytes), or
        None when it has drawn nothing yet / is unseeded (a fresh generator from the seed is
        then exact)."""
        g = self._gens.get(req_id)
        return None if g is None else g.get_state().numpy().tobytes()

    def import_state(self, req_id: str, state: bytes | None) -> None:
        """Continue ``req_id``'s generator from :meth:`export_state`'s bytes (None: nothing)."""
        if state is not None:
            g = torch.Generator()
            g.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
            self._gens[req_id] = g

    def sample(self, logits: torch.Tensor, reqs: list[Request]) -> list[int]:
        """logits [R, V] float32 (row r belongs to reqs[r]) -> R token ids."""
        out = logits.argmax(dim=-1).tolist()
        for r, req in enumerate(reqs):
            sp = req.sampling_params
            if sp.greedy:
                continue
            row = logits[r] / sp.temperature
            if sp.top_k > 0 and sp.top_k < row.shape[0]:
                kth = torch.topk(row, sp.top_k).values[-1]
                row = row.masked_fill(row < kth, float("-inf"))
            if sp.top_p < 1.0:
                # stable: equal logits keep index order, so the first kept token is exactly
                # row.argmax() (the first maximum), the greedy token when temperature is 1
                sorted_logits, idx = torch.sort(row, descending=True, stable=True)
                probs = sorted_logits.softmax(-1)
                # keep the smallest prefix whose mass reaches top_p, and always the top-1 token
                # (its exclusive cumulative mass is 0, but a top_p below float32's range, e.g.
                # 1e-300, compares as 0 >= 0: without this, every token would be masked)
                drop = probs.cumsum(-1) - probs >= sp.top_p
                drop[0] = False
                sorted_logits[drop] = float("-inf")
                row = torch.full_like(row, float("-inf")).scatter(0, idx, sorted_logits)
            gen = self._generator(req)
            out[r] = int(torch.multinomial(row.softmax(-1), 1, generator=gen))
        return out

    def _generator(self, req: Request) -> torch.Generator:
        seed = req.sampling_params.seed
        if seed is None:
            return self._shared
        g = self._gens.get(req.req_id)
        if g is None:
            g = self._gens[req.req_id] = torch.Generator().manual_seed(seed)
        return g
