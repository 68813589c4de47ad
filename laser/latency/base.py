"""The latency model's interface (:class:`LatencyModel`), its error, and profile samples.

Torch-free, numpy-free: schedulers and the simulator price plans with it (see
:mod:`laser.latency` for the model itself, paper §5).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from laser.core.plan import LayerStep, StepPlan


class LatencyProfileError(Exception):
    """A latency profile file is missing, unreadable, corrupt, or for another setup."""


# --------------------------------------------------------------------------------------
# Profile samples: what the profiler produces (plain records, JSON-friendly).
# Each ``seconds`` is one layer's (or the embed/head's) wall time, ideally the median
# of a few repeats after warm-up; repeats may also be passed as separate samples.


@dataclass(frozen=True, slots=True)
class StatelessSample:
    """One layer's stateless modules (norms, QKV, RoPE, O, MLP, residuals) on ``n_tokens`` tokens."""

    n_tokens: int
    seconds: float


@dataclass(frozen=True, slots=True)
class AttentionSample:
    """One layer's attention core (KV-cache write + attention kernel) for a batch.

    Entry k has ``query_lens[k]`` new tokens attending to ``context_lens[k]`` tokens
    (cached context plus itself), as in :class:`laser.core.plan.LayerStep`.
    """

    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    seconds: float


@dataclass(frozen=True, slots=True)
class EmbedSample:
    """Token-embedding lookup of ``n_tokens`` tokens."""

    n_tokens: int
    seconds: float


@dataclass(frozen=True, slots=True)
class HeadSample:
    """Final norm + LM head + sampling on ``n_rows`` rows (one per finishing request)."""

    n_rows: int
    seconds: float


@dataclass(frozen=True, slots=True)
class LayerSample:
    """Optional: a whole layer call, end to end. Fits the fixed per-layer-call overhead
    (the median of what stateless + attention leave unexplained)."""

    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    seconds: float


@dataclass(frozen=True, slots=True)
class StepOverheadSample:
    """What a whole step (``ModelRunner.execute`` of a plan) costs beyond its layer calls, embedding
    and LM head: the runner's wall time minus the compute it times itself
    (``StepResult.compute_seconds``). ``compositions``: batches the walker composed (one per
    segment of layers with a constant batch: attention metadata built, rows joined / parked);
    ``composed_works``: works summed over those batches."""

    compositions: int
    composed_works: int
    seconds: float


@dataclass(frozen=True, slots=True)
class DecodeStepSample:
    """A whole decode step at full depth: one new token for each of ``len(context_lens)`` requests
    (``context_lens`` include it) through every layer, embedded and sampled. ``seconds``: the compute
    the runner times itself (``StepResult.compute_seconds``: the layer calls, the embedding and the
    LM head; not the step's overhead, a :class:`StepOverheadSample`). Prices decode layers as they
    run inside a step, where they cost less than the same layer call timed alone."""

    context_lens: tuple[int, ...]
    seconds: float


@dataclass(frozen=True, slots=True)
class WarmDecodeStepSample:
    """A :class:`DecodeStepSample`'s step timed as the ``streak``-th of the same step run back to back
    (``streak >= 1`` steps of it ran right before, as in an engine's steady decode). ``seconds``: its
    compute, as :class:`DecodeStepSample`'s. Prices a decode step that follows other decode steps
    (``FittedLatencyModel.decode_warm``: on an AMX Xeon, 1 thread, SmolLM2 int4 / int8, a batch-1 step ran
    ~0.93x its price right after a prefill step and fell to 0.76x over the next 7 decode steps; batch 4
    0.94x to 0.90x; 5+ rows, over dense bf16 copies of the weights, ~0.95x throughout)."""

    context_lens: tuple[int, ...]
    streak: int
    seconds: float


@dataclass(frozen=True, slots=True)
class PrefillStepSample:
    """A whole step at full depth holding a prefill chunk: works ``(query_lens[k], context_lens[k])``
    (decode rows among them: ``query_lens[k] == 1``) through every layer, embedded and sampled.
    ``seconds``: the compute the runner times itself (as :class:`DecodeStepSample`'s). Prices the
    layer calls of such a step as they run inside it, against the same call timed alone
    (``FittedLatencyModel.prefill_step_scale``)."""

    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    seconds: float


Sample = (StatelessSample | AttentionSample | EmbedSample | HeadSample | LayerSample | StepOverheadSample
          | DecodeStepSample | PrefillStepSample | WarmDecodeStepSample)


def check_batch(q: Sequence[int], c: Sequence[int]) -> None:
    """Raise ``ValueError`` unless ``q``/``c`` are equally long, non-empty, and ``1 <= q_k <= c_k``."""
    if len(q) != len(c) or not q:
        raise ValueError(f"query_lens and context_lens must be non-empty and equally long, got {q!r}, {c!r}")
    for qi, ci in zip(q, c):
        if qi < 1 or ci < qi:
            raise ValueError(f"need 1 <= query_len <= context_len, got q={qi}, c={ci}")


def check_seconds(s: float) -> None:
    """Raise ``ValueError`` unless ``s`` is a positive finite number."""
    if not (isinstance(s, (int, float)) and math.isfinite(s) and s > 0):
        raise ValueError(f"seconds must be a positive finite number, got {s!r}")


def frontend_ttft(lm) -> float:
    """Seconds the HTTP front end adds to a served TTFT per latency model ``lm``
    (:attr:`LatencyModel.frontend_ttft_s`; 0.0 for None, a model without the field, or one never
    measured). The one reading of it for the simulator's served setups and the server's admission."""
    return float(getattr(lm, "frontend_ttft_s", 0.0) or 0.0)


# Sample kinds as named in profile files.
SAMPLE_TYPES = (StatelessSample, AttentionSample, EmbedSample, HeadSample, LayerSample, StepOverheadSample,
                DecodeStepSample, PrefillStepSample, WarmDecodeStepSample)
SAMPLE_KINDS = ("stateless", "attention", "embed", "head", "layer", "step_overhead", "decode_step", "prefill_step",
                "decode_step_warm")
TYPE_KIND = dict(zip(SAMPLE_TYPES, SAMPLE_KINDS))
KIND_TYPE = dict(zip(SAMPLE_KINDS, SAMPLE_TYPES))


# --------------------------------------------------------------------------------------
# Interface


class LatencyModel:
    """Predicts wall time (seconds) of the executor's work.

    Subclasses provide the primitives ``stateless_time``, ``attention_time``,
    ``embed_time``, ``head_time`` and the attributes ``num_layers`` (layers of the
    model) and ``layer_overhead_s`` (fixed cost of one layer call). Everything else is
    derived here. Predictions are never negative, and non-decreasing in token counts and
    context lengths, with three measured exceptions in :class:`FittedLatencyModel`: the LM
    head at the smallest row counts, decode attention where a longer context makes
    the runner split a decode batch into less padded groups, and a causal prefill chunk just past
    a query length where the flash kernel's query block grows (``features.CAUSAL_Q_TILES``:
    192 tokens ran 1.4 ms against 2.3 ms for 191, 768 16.2 ms against 18.0 for 767, bf16 SmolLM2 on
    an AVX512 EPYC). Inputs are not validated on the hot path: query and
    context lengths must satisfy ``1 <= q <= c``.
    """

    num_layers: int
    layer_overhead_s: float = 0.0
    #: What a step costs beyond its layer calls, embedding and LM head (seconds; 0.0: not
    #: measured): once per step, once per batch composition (a segment of layers with the same
    #: batch: the runner builds its attention metadata and joins / parks rows), and once per work
    #: of each composition. Fitted from :class:`StepOverheadSample` s; :meth:`step_overhead_time`.
    step_overhead_s: float = 0.0
    compose_overhead_s: float = 0.0
    compose_work_s: float = 0.0
    #: Seconds one grammar mask adds to sampling one row (structured output: llguidance's
    #: next-token mask filled and applied to a [vocab] row); 0.0: not measured. Measured by the
    #: profiler (:func:`laser.profiler.mask.measure_mask_row_s`) or estimated from the vocabulary
    #: (:func:`laser.profiler.mask.estimate_mask_row_s`).
    mask_row_s: float = 0.0
    #: What the HTTP front end adds to a served request's TTFT beyond the engine's own (seconds;
    #: 0.0: in process or not measured): the client's TTFT minus the engine's (first token - the
    #: engine's add) on an idle server -- HTTP parse, tokenization, admission, the hop to the engine
    #: thread, the first chunk's detokenize / SSE / client read. Measured against a running server
    #: (:func:`laser.bench.frontend_cost.measure_frontend_ttft`) and kept in the profile; added by the
    #: simulator to a served setup's token times (``SimTarget(served=True)``) and by the server's
    #: admission to its TTFT predictions, never by the in-process path. Per-token delivery (SSE) was
    #: measured not to lengthen TBT (client TPOT = server TPOT within 0.1 ms), so it has no term.
    frontend_ttft_s: float = 0.0
    #: Dynamic depth's exit checks and K/V fill (:class:`laser.core.depth.ExitCost`) of the
    #: exit heads the instance serves with (set by it: ``ModelInstance.enable_dynamic_depth``,
    #: ``SimInstance(depth_model=...)``); None: a plan prices none.
    exit_cost = None

    def timing_spread(self) -> float:
        """How much longer than predicted a step may run in the worst few percent of steps
        (dimensionless, >= 1): planning margins are divided by it. 1.0 for a model whose
        predictions are the clock itself (the simulator's); a model calibrated on a real
        machine measures it when asked to (``--jitter-margin``:
        :meth:`~laser.latency.calibrated.CalibratedLatencyModel.timing_spread`)."""
        return 1.0

    # -- primitives (override) --------------------------------------------------------
    def stateless_time(self, n_tokens: int) -> float:
        """One layer's stateless modules on ``n_tokens`` tokens."""
        raise NotImplementedError

    def attention_time(self, query_lens: Sequence[int], context_lens: Sequence[int]) -> float:
        """One layer's attention for a batch (see :class:`AttentionSample`)."""
        raise NotImplementedError

    def embed_time(self, n_tokens: int) -> float:
        """Embedding lookup of ``n_tokens`` tokens (0 for 0 tokens)."""
        raise NotImplementedError

    def head_time(self, n_rows: int) -> float:
        """Final norm + LM head + sampling on ``n_rows`` rows (0 for 0 rows)."""
        raise NotImplementedError

    def mask_time(self, n_rows: int) -> float:
        """Grammar masks of ``n_rows`` sampled rows (``n_rows`` x :attr:`mask_row_s`; 0.0 for
        none): the sampling term's share of structured output, which the LM head's fit does not
        see (the profiler samples plain rows). vLLM applies the same bitmask per row before its
        sampler (``apply_grammar_bitmask``)."""
        return n_rows * self.mask_row_s if n_rows else 0.0

    def step_overhead_time(self, compositions: int, composed_works: int) -> float:
        """What a step with ``compositions`` batch compositions holding ``composed_works`` works in
        all costs beyond its layer calls, embedding and LM head (seconds; 0.0 for no composition):
        ``step_overhead_s + compose_overhead_s · compositions + compose_work_s · composed_works``.
        The per-call overhead a per-layer fit cannot see: metadata, joins and parks happen once
        per batch, not once per layer (vLLM's equivalent is the CPU time of its
        ``prepare_inputs`` per step)."""
        if compositions <= 0:
            return 0.0
        return self.step_overhead_s + self.compose_overhead_s * compositions + self.compose_work_s * composed_works

    def decode_warm_factor(self, n_rows: int, streak: int = 1) -> float:
        """The share of its price that a decode step at full depth of ``n_rows`` rows takes as the
        ``streak``-th step in a row without prefill work (``StepPlan.warm``, counted by the instance core:
        :func:`laser.core.pricing.warm_streak`): the CPU runs a stream of small decode steps faster than
        one right after other work, which is how the profiler times every case. 1.0 for ``streak <= 0``, and
        unless the profile measured such streaks (``FittedLatencyModel.decode_warm``, from
        :class:`WarmDecodeStepSample` s). Dimensionless."""
        return 1.0

    # -- derived ----------------------------------------------------------------------
    def layer_time(self, query_lens: Sequence[int], context_lens: Sequence[int]) -> float:
        """One layer call on the batch ``(query_lens[k], context_lens[k])``, timed on its own (as the
        profiler times one; seconds); 0 if empty."""
        if not query_lens:
            return 0.0
        return self.stateless_time(sum(query_lens)) + self.attention_time(query_lens, context_lens) + self.layer_overhead_s

    def step_layer_time(self, query_lens: Sequence[int], context_lens: Sequence[int]) -> float:
        """One layer call on the batch as it runs inside a whole step, among the step's other layer calls
        (seconds; 0 if empty): what plans, schedulers and the simulator price a layer with. Here
        :meth:`layer_time`; a fitted model prices it from whole steps (``FittedLatencyModel``: on an AMX
        Xeon a layer holding a prefill chunk cost ~0.9 of the call timed alone)."""
        return self.layer_time(query_lens, context_lens)

    def step_compute_time(self, query_lens: Sequence[int], context_lens: Sequence[int]) -> float:
        """A whole step at full depth of the batch ``(query_lens[k], context_lens[k])``, its compute only:
        every layer as :meth:`step_layer_time`, the embedding of its tokens and the LM head of its rows; not
        the step's own overhead (seconds). What the profiler's whole-step samples measure
        (``DecodeStepSample``, ``WarmDecodeStepSample`` before its factor, ``PrefillStepSample``)."""
        return (self.num_layers * self.step_layer_time(query_lens, context_lens) + self.embed_time(sum(query_lens))
                + self.head_time(len(query_lens)))

    def predict_layer(self, step: LayerStep) -> float:
        """Seconds for one layer call of a step (:meth:`step_layer_time`; all layers cost the same,
        ``step.layer`` is unused)."""
        return self.step_layer_time(step.query_lens, step.context_lens)

    def predict_iteration(self, plan: StepPlan) -> float:
        """Seconds for a whole plan: its layer calls + embedding of works starting at
        layer 0 + LM head for ``plan.num_final()`` rows + the step's overhead
        (:meth:`step_overhead_time` of its batch compositions); times :meth:`decode_warm_factor` when the
        plan is a decode step in a streak of them (``plan.warm``). A plan this model priced when it was built
        (``plan.predicted``, its price as a step after other work) is not priced again (the same number)."""
        p = plan.predicted
        if p is not None and p[0] is self:
            t = p[1]
        else:
            from laser.core.pricing import PlanCost

            t = PlanCost(self, plan.num_layers, plan.works, *(plan.speculative or ())).total if plan.works else 0.0
        return t * self.decode_warm_factor(len(plan.works), plan.warm) if plan.warm else t

    def predict_prefill(self, prompt_len: int, layers: int | None = None, context_start: int = 0) -> float:
        """A prefill chunk of ``prompt_len`` tokens after ``context_start`` cached tokens, alone.

        ``layers=None``: a full pass (embedding, every layer, LM head for one row).
        ``layers=k``: only ``k`` layer calls (no embedding, no head).
        """
        if prompt_len <= 0:
            return 0.0
        t = self.step_layer_time((prompt_len,), (context_start + prompt_len,))
        if layers is not None:
            return layers * t
        return self.num_layers * t + self.embed_time(prompt_len) + self.head_time(1) + self.step_overhead_time(1, 1)

    def predict_decode_iteration(self, context_lens: Sequence[int]) -> float:
        """One decode token for each request (``context_lens`` include the new token)
        through every layer, plus embedding and LM head."""
        b = len(context_lens)
        if not b:
            return 0.0
        return self.step_compute_time((1,) * b, context_lens) + self.step_overhead_time(1, b)

    def max_tokens_within(
        self,
        budget_s: float,
        layers: int = 1,
        context_start: int = 0,
        query_lens: Sequence[int] = (),
        context_lens: Sequence[int] = (),
        limit: int = 1 << 20,
    ) -> int:
        """Largest chunk ``k <= limit`` (tokens, after ``context_start`` cached tokens)
        such that ``layers`` layer calls of the batch ``query_lens + (k,)`` take at most
        ``budget_s``; 0 if not even one token fits. Binary search (predictions are
        monotone; where they are not, the chunk found fits the budget but may not be the largest
        that does). Embedding and LM head are not included."""
        base_q, base_c = tuple(query_lens), tuple(context_lens)

        def cost(k: int) -> float:
            return layers * self.step_layer_time(base_q + (k,), base_c + (context_start + k,))

        if limit < 1 or cost(1) > budget_s:
            return 0
        lo, hi = 1, 2
        while hi <= limit and cost(hi) <= budget_s:
            lo, hi = hi, hi * 2
        hi = min(hi, limit + 1)  # cost(lo) fits; hi does not fit or is past the limit
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if cost(mid) <= budget_s:
                lo = mid
            else:
                hi = mid
        return lo
