"""Completion windows and predicted work of a batch job (torch-free; latency model only).

A job's work with the whole machine is its prefills run one after another plus its decode
tokens at the rate of a decode iteration of ``concurrency`` rows (the runner keeps that many
of its requests in flight), all priced by the fitted latency model (paper §5):

    work = Σ_i predict_prefill(p_i) + Σ_i m_i · predict_decode_iteration([p_i + m_i/2] · B) / B

where ``p_i`` is the prompt length, ``m_i`` the ``max_tokens`` of request ``i``, ``B`` the
concurrency. ``start_by = deadline - work(remaining)`` is the latest time the job can start its
next request and still finish (least-laxity first; Liu & Layland's EDF on the start-by time),
the queue key of its cold requests (:meth:`laser.scheduler.base.Scheduler.queue_key`) while the
job is on time.

Urgency (issue 14 item 4): a job is *urgent* when its remaining work, at the share of the machine
it has been getting (:func:`progress_share`: predicted work done / time since it started; idle
capacity is what it gets while not urgent), would end after its deadline (:func:`is_urgent`). An
urgent job starts requests even while hot or warm prompts wait (:func:`may_start`) and its
requests get the key ``min(start_by, now + hot TTFT)`` (:func:`cold_key`): ahead of warm and
best-effort work, behind hot prompts already waiting -- and ahead of everything once even the
whole machine would barely make it (``start_by`` passed) -- and it may run more requests side by
side (:func:`job_concurrency`).
"""

from __future__ import annotations

import math
import re

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_WINDOW = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd])\s*$")
MAX_WINDOW_S = 30 * 86400.0


class WindowError(ValueError):
    """A completion window that is not a positive duration such as ``24h``, ``30m`` or ``90s``."""


def parse_window(text) -> float:
    """Seconds of a completion window: a number and a unit (s, m, h, d), e.g. ``24h``, ``30m``.

    Raises WindowError for anything else, for zero, and for more than 30 days.
    """
    if not isinstance(text, str):
        raise WindowError(f"completion_window must be a string such as '24h' or '30m', got {text!r}")
    m = _WINDOW.match(text)
    if m is None:
        raise WindowError(f"completion_window {text!r} is not a duration such as '24h', '4h', '30m' or '90s'")
    s = float(m.group(1)) * _UNITS[m.group(2)]
    if not (0 < s <= MAX_WINDOW_S):
        raise WindowError(f"completion_window {text!r} must be more than 0 s and at most 30 days")
    return s


def request_seconds(latency_model, prompt_tokens: int, max_tokens: int, concurrency: int) -> float:
    """Predicted machine time of one request's prefill plus its share of batched decode (seconds)."""
    b = max(1, concurrency)
    prefill = latency_model.predict_prefill(max(1, prompt_tokens))
    if max_tokens <= 1:
        return prefill
    ctx = prompt_tokens + max(1, max_tokens // 2)
    step = latency_model.predict_decode_iteration([ctx] * b)
    return prefill + (max_tokens - 1) * step / b


def job_seconds(latency_model, sizes, concurrency: int) -> float:
    """Predicted seconds to run requests ``sizes`` = [(prompt_tokens, max_tokens), ...] with the
    whole machine (nothing else running)."""
    return math.fsum(request_seconds(latency_model, p, m, concurrency) for p, m in sizes)


def may_start(*, urgent: bool, interactive_waiting: bool, queued: int, max_waiting: int, inflight: int,
              concurrency: int, cold_queued: int = 0, max_cold_queued: int = 2) -> bool:
    """Whether a batch job may start one more of its requests now (the cold tier's admission rule,
    shared by the server's :class:`laser.batch.manager.BatchManager` and ``laser bench``'s
    background job): fewer than ``concurrency`` of the job runner's requests in flight, the
    engine's queue of requests without a first token (``queued``) under half of ``max_waiting``,
    and no hot or warm prompt waiting for its first token (``interactive_waiting``) unless the
    job is ``urgent`` (:func:`is_urgent`), and then only while fewer than ``max_cold_queued`` of
    its requests wait for their first token (``cold_queued``): an urgent request's queue key is
    fixed when it starts, so a deep queue of them would go ahead of hot prompts that arrive
    later; a short one costs a hot prompt at most that many cold prefill chunks. Cold work fills
    the capacity hot and warm targets leave; an urgent job takes its share regardless.
    """
    if inflight >= concurrency or queued >= max(1, max_waiting // 2):
        return False
    if not interactive_waiting:
        return True
    return urgent and cold_queued < max_cold_queued


def progress_share(done_work_s: float, elapsed_s: float, window_s: float, grace: float = 0.05) -> float:
    """The share of the machine a job has been getting: predicted seconds of its finished work per
    second since it started (1.0 = the whole machine). During the first ``grace`` of its window it
    is taken as 1.0 (too early to judge: its first requests have not had time to finish)."""
    if elapsed_s < grace * window_s or elapsed_s <= 0:
        return 1.0
    return done_work_s / elapsed_s


def is_urgent(now: float, deadline: float, remaining_work_s: float, share: float, margin: float = 1.1) -> bool:
    """Whether a job would miss ``deadline`` if its ``remaining_work_s`` (whole-machine seconds) ran
    at ``share`` of the machine (:func:`progress_share`), with ``margin`` head room; always True
    once its start-by time has passed."""
    if remaining_work_s <= 0:
        return False
    return now + margin * remaining_work_s / max(share, 1e-6) >= deadline or start_by(deadline, remaining_work_s,
                                                                                      margin) <= now


def cold_key(now: float, deadline: float, remaining_work_s: float, urgent: bool, hot_ttft_s: float,
             margin: float = 1.1) -> float:
    """The queue key (``SLO.deadline``) of a batch job's next request (same clock as ``now``):
    its start-by time while on time; ``min(start_by, now + hot_ttft_s)`` when urgent, which sorts it
    ahead of warm and best-effort work but behind hot prompts already waiting (``hot_ttft_s``: the
    loosest hot TTFT target)."""
    sb = start_by(deadline, remaining_work_s, margin)
    return min(sb, now + hot_ttft_s) if urgent else sb


def job_concurrency(base: int, urgent: bool, remaining_requests: int, mean_latency_s: float | None,
                    time_left_s: float, max_factor: int = 4, margin: float = 1.1) -> int:
    """How many of a job's requests may be in flight. ``base`` normally; an urgent job gets what
    Little's law says its deadline needs -- ``margin x remaining_requests x mean_latency_s /
    time_left_s`` (``mean_latency_s``: start to finish of its requests so far) -- between ``base``
    and ``max_factor x base``. Under interactive load a request's decode advances one token per
    iteration whatever the batch, so a job speeds up by running more requests side by side (a decode
    row costs little in an iteration that runs anyway), not by running each one faster."""
    if not urgent or not mean_latency_s or remaining_requests <= 0:
        return base
    cap = max_factor * base
    if time_left_s <= 0:
        return cap
    return max(base, min(cap, math.ceil(margin * remaining_requests * mean_latency_s / time_left_s)))


def start_by(deadline: float, remaining_work_s: float, margin: float = 1.1) -> float:
    """Latest start time of the job's remaining work (same clock as ``deadline``), keeping
    ``margin`` x the predicted work as head room for interference."""
    return deadline - margin * remaining_work_s
