"""Self-speculative decoding as the schedulers see it: which requests speculate, how many
tokens a step drafts for one, and what a speculative step costs. Torch-free (the executor that
drafts and verifies is :class:`laser.spec.self_spec.SelfSpeculator`).

A speculating decode token (a work through all ``N`` layers of a request that :func:`speculates`)
does not run in the step's layer calls: after them, the executor runs ``g + 1`` draft passes of
one token per request over layers ``0..k-1`` (the exit head drafting after each of the first
``g``), then one verify chunk of ``g + 1`` tokens per request over layers ``k..N-1`` and the LM
head on every verified row (LayerSkip, Elhoushi et al. ACL'24 §4). :func:`spec_decode_time` prices
exactly those calls with the latency model, so the Laser scheduler's plans
(:class:`laser.core.pricing.PlanCost`) and Alg. 1 (:mod:`laser.scheduler.laser.decode`) are priced
as the step runs.
"""

from __future__ import annotations

from dataclasses import dataclass


def speculates(sp) -> bool:
    """Whether a request with sampling params ``sp`` is decoded self-speculatively: greedy with
    no logit processing (verification is an argmax), or sampled (the rejection rule,
    :mod:`laser.spec.rejection`) without logprobs and structured output (whose grammar state
    follows the request's own tokens). A request that opted into dynamic depth (lossy early exit,
    :mod:`laser.core.depth`) does not: its tokens leave the model at an exit, not at a verify."""
    if getattr(sp, "dynamic_depth", None) is not None:
        return False
    return sp.plain_greedy or (not sp.greedy and sp.logprobs is None and sp.structured_output is None)


@dataclass(frozen=True, slots=True)
class SpecShape:
    """An instance's self-speculation settings: ``exit_layer`` (k, layers before the exit, 1..N-1),
    ``draft_tokens`` (g, drafted per step, >= 1), ``max_model_len`` (drafts never write past it)."""

    exit_layer: int
    draft_tokens: int
    max_model_len: int

    def work_draft_len(self, w, req, num_layers: int) -> int:
        """:meth:`draft_len` of ``req`` for its work ``w`` (a :class:`laser.core.plan.Work`) in a
        plan of ``num_layers`` layers: only a decode token that samples through every layer is
        run speculatively (0 for any other work). The one rule of which works the executor
        speculates and the plans price as such."""
        if not (w.is_decode and w.sample and w.layer_start == 0 and w.layer_end == num_layers):
            return 0
        return self.draft_len(req)

    def draft_len(self, req) -> int:
        """Tokens a step may draft for ``req`` (its next token's work through every layer): ``g``,
        less what its ``max_tokens`` (emitted tokens <= drafts + 1) and the context limit (draft
        positions ``n-1 .. n-1+g``) leave; 0 when the request does not speculate. The executor
        drafts fewer when the KV pool has no free block for them."""
        if not speculates(req.sampling_params):
            return 0
        n = req.num_tokens
        return max(0, min(self.draft_tokens, req.sampling_params.max_tokens - req.num_output_tokens - 1,
                          self.max_model_len - n))


def spec_decode_time(lm, num_layers: int, exit_layer: int, rows: list[tuple[int, int]]) -> float:
    """Predicted seconds of one step's speculative part (module doc) for ``rows``: one
    ``(context_len, g)`` per speculating request (``context_len`` = its tokens, the pending one
    included; ``g >= 0`` its draft length), as the executor runs it: pass ``i = 0..max g`` feeds one
    token of every request with ``g >= i`` through ``exit_layer`` layers at context
    ``context_len + i`` (embedding included; the exit head on those with ``g > i``, priced as the
    full LM head on as many rows: an upper bound, the draft head's vocabulary is reduced), then
    a chunk of ``g + 1`` tokens per request through the other layers at context
    ``context_len + g``, and the LM head on all of them. ``lm``: a
    :class:`laser.latency.LatencyModel`. 0.0 for no rows."""
    if not rows:
        return 0.0
    k = exit_layer
    t = 0.0
    for i in range(max(g for _, g in rows) + 1):
        act = [(c, g) for c, g in rows if g >= i]
        b = len(act)
        t += k * lm.step_layer_time((1,) * b, tuple(c + i for c, _ in act)) + lm.embed_time(b)
        heads = sum(1 for _, g in act if g > i)
        if heads:
            t += lm.head_time(heads)
    q = tuple(g + 1 for _, g in rows)
    t += (num_layers - k) * lm.step_layer_time(q, tuple(c + g for c, g in rows)) + lm.head_time(sum(q))
    return t
