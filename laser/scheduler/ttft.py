"""The one TTFT predictor: when will each queued prefill -- and a newcomer -- finish on an
instance, from its :class:`~laser.scheduler.report.SchedulerReport`? Read by in-process
admission (:mod:`laser.frontend.admission`), cluster admission and the Laser controller's
prefill selection (:mod:`laser.controller.laser`). Torch-free; seconds throughout.

A request's first token comes after (1) the rest of the step the instance is running (the
caller's ``start``), (2) the prefill of every request ahead of it and (3) its own prefill.
Two queue-time models:

* ``chunked``: the requests ahead prefill one after another in the scheduler's queue order
  (:func:`~laser.scheduler.report.queue_key`; equal keys were queued first; under Laser prompts
  without a deadline of their own behind the rest, as its triage orders them), each in chunks of the
  token budget (whole prompts for vLLM), stretched by the share of the machine decoding takes
  meanwhile (:func:`decode_share`: the requests decoding now, plus each request ahead once its
  prefill is done).
* ``merged``: the queue drains as one batch growing in the scheduler's queue order (Laser's
  layer-level prefill, §6.1, merges queued work while deadlines hold): request q finishes when a
  merged batch of the first q entries would (``N`` layer calls of the batch, embedding, LM head)
  -- a later entry never delays an earlier one. The Laser controller's §7.1 estimate.

Which model fits which instance was measured against the simulator
(``benchmarks/ttft_predictors.py``; :func:`model_for`): ``merged`` on a prefill instance,
``chunked`` on a mixed one.

Sources: the work-ahead estimate follows the EDF feasibility test of deadline scheduling; the
decode share mirrors how each policy mixes decode with prefill (vLLM v0: prefill first,
Sarathi-Serve: decode tokens in every chunked iteration, Laser §6.2: decode groups planned
against T_g = the strictest TBT target, leaving up to ``prefill_share`` of it to prefill when a
queued deadline needs it).
"""

from __future__ import annotations

import math

from .report import QueueEntry, SchedulerReport

#: Decoding never takes more than this share in the prediction (the schedulers keep room for prefill).
MAX_DECODE_SHARE = 0.9

#: The queue-time models :func:`finish_times` knows.
MODELS = ("chunked", "merged")


def decode_share(report: SchedulerReport, latency_model, contexts: list[int], tbts: list[float | None]) -> float:
    """Share (0..MAX_DECODE_SHARE) of the machine that decoding ``contexts`` takes while prefill waits.

    vLLM (prefill first): 0. Laser: one decode iteration per T_g (the strictest TBT target,
    times its planning margin), capped to leave ``prefill_share``; no finite target: 0 (the
    whole prefill joins one iteration). Sarathi (and others): every iteration runs the decode
    tokens plus a prefill chunk of the rest of the token budget; the decode tokens cost their
    marginal time in that hybrid batch.
    """
    if not contexts or report.policy == "vllm":
        return 0.0
    c = latency_model.predict_decode_iteration(contexts)
    if report.prefill_share is not None:
        t_g = min((t for t in tbts if t is not None), default=math.inf)
        if t_g == math.inf:
            return 0.0
        share = min(c / (t_g * report.tg_margin), 1.0 - report.prefill_share)
    else:
        # hybrid batches: the decode tokens ride in the chunk's layer calls, so they cost only
        # their marginal time (the per-layer overhead is paid by the chunk anyway)
        k = max(1, report.chunk_tokens - len(contexts))
        lt = latency_model.step_layer_time
        marginal = latency_model.num_layers * (lt((k,) + (1,) * len(contexts), (k,) + tuple(contexts))
                                               - lt((k,), (k,))) + latency_model.head_time(len(contexts))
        marginal = min(max(marginal, 0.0), c)
        share = marginal / (marginal + latency_model.predict_prefill(k))
    return min(share, MAX_DECODE_SHARE)


def prefill_seconds(report: SchedulerReport, latency_model, tokens: int, context_start: int = 0) -> float:
    """Predicted time (seconds) to prefill ``tokens`` after ``context_start`` cached tokens as the
    policy runs it: whole prompts for vLLM, chunks of at most ``chunk_tokens`` otherwise (each
    chunk pays the per-layer overhead again)."""
    if report.policy == "vllm":
        return latency_model.predict_prefill(tokens, context_start=context_start)
    step = max(1, report.chunk_tokens)
    t, done = 0.0, 0
    while done < tokens:
        k = min(step, tokens - done)
        t += latency_model.predict_prefill(k, context_start=context_start + done)
        done += k
    return t


def _order(report: SchedulerReport, entries: list[QueueEntry], extra: QueueEntry | None) -> list[QueueEntry]:
    """``entries`` (and ``extra``, after the entries with an equal order) in the order the
    scheduler of ``report`` prefills them: its queue key, and under Laser's triage the prompts
    without a deadline of their own (``QueueEntry.best_effort``) behind the rest, whatever their
    aging deadline (:func:`~laser.scheduler.report.yields_prefill`)."""
    layer_level = report.policy == "laser"
    # a stable sort: equal keys keep their queue order, the newcomer (appended last) after them
    return sorted(entries + ([extra] if extra is not None else []),
                  key=lambda e: (layer_level and e.best_effort, *e.key))


def _chunked(report: SchedulerReport, lm, start: float, extra: QueueEntry | None) -> list[tuple[QueueEntry, float]]:
    queue = _order(report, list(report.queue), extra)
    t = start
    contexts = list(report.decode_contexts)
    tbts = list(report.decode_tbts)
    out = []
    for e in queue:
        if e.prefill_tokens <= 0 and e is not extra:  # nothing left to prefill (its last chunk is done)
            out.append((e, t))
            continue
        work = prefill_seconds(report, lm, e.prefill_tokens, e.context_len - e.prefill_tokens)
        t += work / (1.0 - decode_share(report, lm, contexts, tbts))
        contexts.append(e.context_len)
        tbts.append(e.tbt)
        out.append((e, t))
    return out


def _merged(report: SchedulerReport, lm, num_layers: int, start: float,
            extra: QueueEntry | None) -> list[tuple[QueueEntry, float]]:
    entries = _order(report, list(report.queue), extra)  # the scheduler's order; equal keys: the newcomer last
    out = []
    tokens = 0
    attn = 0.0
    for k, e in enumerate(entries, 1):
        rem = e.prefill_tokens
        if rem <= 0:
            out.append((e, start))
            continue
        tokens += rem
        attn += lm.attention_time((rem,), (e.prompt_tokens,))
        per_layer = lm.stateless_time(tokens) + attn + lm.layer_overhead_s
        out.append((e, start + num_layers * per_layer + lm.embed_time(tokens) + lm.head_time(k)))
    return out


def model_for(report: SchedulerReport) -> str:
    """The queue-time model of the instance of ``report``: ``merged`` on a prefill instance
    (nothing competes with its queued prompts, which it batches layer call by layer call),
    ``chunked`` on a mixed one (decode iterations interleave with the prefill chunks). Chosen by
    measurement against the simulator (``benchmarks/ttft_predictors.py``, docs/benchmarks.md):
    on mixed instances ``chunked`` is best or tied in 9 of 12 settings (``merged`` under-predicts
    a burst of 40 prompts by 0.69 s), on prefill instances ``merged`` in 8 of 10."""
    return "merged" if report.role == "prefill" else "chunked"


def finish_times(report: SchedulerReport, latency_model, start: float, extra: QueueEntry | None = None,
                 model: str | None = None, num_layers: int | None = None) -> list[tuple[QueueEntry, float]]:
    """Predicted prefill finish (absolute seconds) of every entry of ``report.queue`` -- with
    ``extra`` (a newcomer, :meth:`SchedulerReport.entry`) inserted -- in the order the model
    drains them: ``[(entry, finish)]``. ``start``: when the instance starts on the queue (the end
    of the step it is running). ``model``: one of :data:`MODELS` (see the module docstring;
    default :func:`model_for` the report's policy); ``num_layers``: the instance's depth (default
    the latency model's). Raises ValueError for an unknown model."""
    model = model or model_for(report)
    if model == "chunked":
        return _chunked(report, latency_model, start, extra)
    if model == "merged":
        return _merged(report, latency_model, num_layers or latency_model.num_layers, start, extra)
    raise ValueError(f"model must be one of {MODELS}, got {model!r}")


def predict_ttft(report: SchedulerReport, entry: QueueEntry, latency_model, start: float,
                 arrival: float | None = None, model: str | None = None, num_layers: int | None = None) -> float:
    """Predicted TTFT (seconds, from ``arrival``; default ``start``) of a new request ``entry``
    queued on the instance of ``report`` (:func:`finish_times`)."""
    for e, f in finish_times(report, latency_model, start, entry, model, num_layers):
        if e is entry:
            return f - (start if arrival is None else arrival)
    raise AssertionError("the newcomer is not in its own queue")
