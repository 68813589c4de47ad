"""The speculative-sampling rejection rule: which drafted tokens a sampled request keeps, so that
its output is distributed exactly as plain sampling from the full model.

Leviathan, Kalman and Matias, "Fast Inference from Transformers via Speculative Decoding"
(ICML'23, Alg. 1 and Appendix A.1), and Chen et al., "Accelerating Large Language Model Decoding
with Speculative Sampling" (2023, Alg. 2); vLLM's equivalent is ``RejectionSampler``
(``vllm/v1/sample/rejection_sampler.py``). For positions ``i = 0 .. g-1`` in order, with draft
token ``d_i`` drawn from the draft distribution ``q_i`` and the target distribution ``p_i`` (the
full model's, given the tokens before ``d_i``, drafts included):

* accept ``d_i`` with probability ``min(1, p_i(d_i) / q_i(d_i))`` (a uniform ``u < p/q``);
* on the first rejection emit a token drawn from ``norm(max(0, p_i - q_i))`` and stop;
* when all ``g`` are accepted emit a bonus token drawn from ``p_g``.

Each emitted token is then distributed as ``p`` at its position, whatever ``q`` is (a token
``q`` cannot draft is only ever rejected into). Greedy decoding is the special case of one-hot
``p`` and ``q``: accept iff ``d_i`` is the target's argmax, else emit that argmax.
"""

from __future__ import annotations

from typing import Sequence

import torch


def rejection_sample(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                     generators: Sequence[torch.Generator | None]) -> list[int]:
    """Run the rejection rule over one request's ``g`` drafted tokens (module doc).

    Args:
        draft_tokens: [g] int64, the drafted tokens ``d_0..d_{g-1}`` (``g >= 0``), each drawn
            from its row of ``draft_probs``.
        draft_probs: [g, V] float32, the draft distributions ``q_i`` (rows sum to 1).
        target_probs: [g + 1, V] float32, the target distributions ``p_0..p_g`` (row ``g``: the
            bonus position's).
        generators: ``g + 1`` generators (None: torch's default), ``generators[i]`` drawing
            position ``i``'s uniform and its residual or bonus token; the same object may repeat.
    Returns:
        The emitted tokens: ``a`` accepted drafts then one token drawn from the residual
        (a rejection) or from ``p_g`` (all accepted, ``a == g``); ``a + 1`` ints in all.
    Raises:
        ValueError: shapes that do not match.
    """
    g = draft_tokens.shape[0]
    if draft_probs.shape[0] != g or target_probs.shape[0] != g + 1 or len(generators) != g + 1 \
            or (g and draft_probs.shape[1] != target_probs.shape[1]):
        raise ValueError(f"rejection_sample: {g} drafts need draft_probs [{g}, V], target_probs [{g + 1}, V] and "
                         f"{g + 1} generators; got {tuple(draft_probs.shape)}, {tuple(target_probs.shape)}, "
                         f"{len(generators)}")
    out: list[int] = []
    for i, d in enumerate(draft_tokens.tolist()):
        p, q = target_probs[i], draft_probs[i]
        u = float(torch.rand((), generator=generators[i], dtype=torch.float64))
        if u * float(q[d]) < float(p[d]):
            out.append(d)
            continue
        residual = (p - q).clamp_min_(0.0)
        if not float(residual.sum()) > 0.0:  # p <= q everywhere, i.e. p == q: a rejection has probability 0
            residual = p
        out.append(int(torch.multinomial(residual, 1, generator=generators[i])))
        return out
    out.append(int(torch.multinomial(target_probs[g], 1, generator=generators[g])))
    return out
