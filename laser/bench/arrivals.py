"""Arrival processes and trace replay. Times in seconds from the start of a run.

Synthetic arrivals follow ``vllm bench serve``: inter-arrival gaps are Gamma(shape=b,
scale=1/(rate·b)) with b the burstiness, so the mean gap is 1/rate for any b and the
coefficient of variation (std/mean) of the gaps is 1/sqrt(b). b = 1 is a Poisson process
(exponential gaps; the paper's §9 setting); b < 1 is burstier, b > 1 more regular.
As in vLLM the first request arrives at t = 0 and request i at the sum of i gaps.

Trace formats read by :func:`read_trace` (CSV with a header row; detected by column names):

* Laser:      ``arrival_time,slo_class,prompt_len,output_len`` (seconds, tokens).
* Splitwise / Azure LLM inference 2023, as processed by vidur
  (``data/processed_traces/splitwise_{conv,code}.csv`` in the vidur 0.0.26 sdist):
  ``arrived_at,num_prefill_tokens,num_decode_tokens``. There is no class column: the class
  is the ``slo_class`` argument, else guessed from the file name (``conv`` → chat,
  ``code`` → code).
* Raw Azure LLM inference trace (AzurePublicDataset): ``TIMESTAMP,ContextTokens,
  GeneratedTokens`` with datetime timestamps, made relative to the first row.

The vidur data is not vendored here; tests write small fixtures in these layouts.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Sequence

import numpy as np

from laser.bench.workloads import WorkloadRequest, WorkloadSampler, scale_len


def inter_arrival_times(n: int, rate: float, burstiness: float = 1.0,
                        seed: int | np.random.Generator = 0) -> np.ndarray:
    """``n`` gaps (s) with mean 1/rate and CV 1/sqrt(burstiness); zeros if rate is inf."""
    if n < 0 or not rate > 0:
        raise ValueError(f"need n >= 0 and rate > 0, got n={n}, rate={rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return np.zeros(n)
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def arrival_times(n: int, rate: float, burstiness: float = 1.0,
                  seed: int | np.random.Generator = 0) -> np.ndarray:
    """Absolute arrival times (s) of ``n`` requests; the first at 0, all at 0 if rate is inf."""
    if n == 0:
        return np.zeros(0)
    gaps = inter_arrival_times(n - 1, rate, burstiness, seed)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def with_arrivals(requests: Sequence[WorkloadRequest], times: Sequence[float]) -> list[WorkloadRequest]:
    """Copies of ``requests`` with ``arrival_time`` set from ``times`` (same length)."""
    if len(requests) != len(times):
        raise ValueError(f"{len(requests)} requests but {len(times)} times")
    return [dataclasses.replace(r, arrival_time=float(t)) for r, t in zip(requests, times)]


# ----------------------------------------------------------------------------- traces


@dataclass(frozen=True, slots=True)
class TraceEntry:
    arrival_time: float  # seconds from the first request of the trace
    slo_class: str
    prompt_len: int  # tokens
    output_len: int  # tokens


_SPLITWISE_COLS = ("arrived_at", "num_prefill_tokens", "num_decode_tokens")
_AZURE_COLS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_LASER_COLS = ("arrival_time", "slo_class", "prompt_len", "output_len")


def _class_from_name(path: str) -> str:
    name = os.path.basename(path).lower()
    if "code" in name:
        return "code"
    if "conv" in name or "chat" in name:
        return "chat"
    raise ValueError(f"cannot tell the SLO class of {path}; pass slo_class=")


def _parse_datetime(s: str) -> float:
    """POSIX seconds of an ISO datetime; naive times are taken as UTC. Azure writes 7
    fractional digits ("2023-11-16 18:15:46.6805900"); datetime accepts at most 6."""
    m = re.match(r"^(.*?\.)(\d+)(.*)$", s.strip())
    s = f"{m[1]}{m[2][:6].ljust(6, '0')}{m[3]}" if m else s.strip()
    dt = datetime.fromisoformat(s)
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


def read_trace(path: str, slo_class: str | None = None) -> list[TraceEntry]:
    """Read a trace CSV (format detected from its header; see module doc), sorted by time.

    ``slo_class`` overrides/sets the class of every row (needed for class-less formats
    whose file name does not say). Times are shifted so the first arrival is at 0.
    """
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        cols = set(reader.fieldnames or ())
        rows = list(reader)
    if set(_LASER_COLS) <= cols:
        entries = [(float(r["arrival_time"]), slo_class or r["slo_class"], int(r["prompt_len"]),
                    int(r["output_len"])) for r in rows]
    elif set(_SPLITWISE_COLS) <= cols:
        cls = slo_class or _class_from_name(path)
        entries = [(float(r["arrived_at"]), cls, int(float(r["num_prefill_tokens"])),
                    int(float(r["num_decode_tokens"]))) for r in rows]
    elif set(_AZURE_COLS) <= cols:
        cls = slo_class or _class_from_name(path)
        entries = [(_parse_datetime(r["TIMESTAMP"]), cls, int(r["ContextTokens"]),
                    int(r["GeneratedTokens"])) for r in rows]
    else:
        raise ValueError(f"{path}: unknown trace columns {sorted(cols)}")
    entries.sort(key=lambda e: e[0])
    t0 = entries[0][0] if entries else 0.0
    return [TraceEntry(t - t0, c, max(1, p), max(1, o)) for t, c, p, o in entries]


def merge_traces(*traces: Sequence[TraceEntry]) -> list[TraceEntry]:
    """Interleave traces by arrival time (each already starts at 0)."""
    return sorted((e for t in traces for e in t), key=lambda e: e.arrival_time)


def rescale_trace(trace: Sequence[TraceEntry], rate: float) -> list[TraceEntry]:
    """Stretch/compress time so the trace's mean rate is ``rate`` req/s (shape kept)."""
    if len(trace) < 2:
        return list(trace)
    span = trace[-1].arrival_time - trace[0].arrival_time
    if span <= 0:
        return list(trace)
    factor = (len(trace) - 1) / span / rate
    return [dataclasses.replace(e, arrival_time=e.arrival_time * factor) for e in trace]


def write_trace(path: str, trace: Sequence[TraceEntry]) -> None:
    """Write ``trace`` in the Laser CSV layout."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(_LASER_COLS)
        for e in trace:
            w.writerow([repr(e.arrival_time), e.slo_class, e.prompt_len, e.output_len])


def requests_from_trace(trace: Sequence[TraceEntry], sampler: WorkloadSampler,
                        seed: int = 0) -> list[WorkloadRequest]:
    """WorkloadRequests with the trace's times, classes and lengths.

    Lengths are multiplied by the sampler's ``length_scale`` (min 1) and capped by its
    ``max_model_len``. Prompts are essay text cut to the input length
    (:meth:`WorkloadSampler.filler`), so ``prompt_len`` may differ from the trace by the
    few tokens a decode/re-encode round trip changes.
    """
    rng = np.random.default_rng(seed)
    out = []
    for e in trace:
        text, n = sampler.filler(scale_len(e.prompt_len, sampler.scale), rng)
        r = sampler.make_request(e.slo_class, text, n, scale_len(e.output_len, sampler.scale), "trace")
        r.arrival_time = e.arrival_time
        out.append(r)
    return out
