"""Completion windows and predicted work of a batch job (torch-free; latency model only).

A job's work with the whole machine is its prefills run one after another plus its decode
tokens at the rate of a decode iteration of ``concurrency`` rows (the runner keeps that many
of its requests in flight), all priced by the fitted latency model (paper §5):

    work = Σ_i predict_prefill(p_i) + Σ_i m_i · predict_decode_iteration([p_i + m_i/2] · B) / B

where ``p_i`` is the prompt length, ``m_i`` the ``max_tokens`` of request ``i``, ``B`` the
concurrency. ``start_by = deadline - work(remaining)`` is the latest time the job can start its
next request and still finish (least-laxity first; Liu & Layland's EDF on the start-by time),
the queue key of its cold requests (:meth:`laser.scheduler.base.Scheduler.queue_key`).
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


def start_by(deadline: float, remaining_work_s: float, margin: float = 1.1) -> float:
    """Latest start time of the job's remaining work (same clock as ``deadline``), keeping
    ``margin`` x the predicted work as head room for interference."""
    return deadline - margin * remaining_work_s
