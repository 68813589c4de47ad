"""What the HTTP front end adds to a served request's TTFT, measured against a running server.

A served request's TTFT, as its client sees it, is the engine's own TTFT (from the moment the engine
took the request to the end of the step that made its first token) plus the front end: the HTTP
request read and parsed, the prompt tokenized, admission, the hop to the engine thread, and the
answer back (event loop, detokenize, the response written and read). Laser's server reports the
engine's part of each request in its ``slo`` note (``engine_ttft_ms``: first token minus the
engine's add, engine clock); the rest is the front end's.

:func:`measure_frontend_ttft` sends ``n`` one-token, non-streamed completions one after another to
an idle server and returns the median of (client wall time - ``engine_ttft_ms``): the value a
latency model keeps as ``frontend_ttft_s`` (:class:`laser.latency.base.LatencyModel`) for the
simulator's served setups (``SimTarget(served=True)``) and the server's admission.

Measured on an AMD EPYC (AVX512-BF16, 2 vCPUs; bf16 SmolLM2, 1 thread, idle server, instrumented
per request): client send -> handler 3.8 ms, tokenize + admission 1.1 ms, hop to the engine
< 0.1 ms, step end -> event loop 0.7 ms, event loop -> client's first chunk 1.0 ms; client TPOT =
server TPOT (per-token SSE adds no gap).
"""

from __future__ import annotations

import statistics
import time

PROMPT = "Measure the front end of this server with a short prompt, please."


def frontend_sample(client, base_url: str, model: str, prompt: str = PROMPT, headers: dict | None = None) -> float | None:
    """One one-token completion through ``client`` (an ``httpx.Client``): client wall seconds
    minus the engine's TTFT the server reported; None when the server reports none (not Laser, or
    an older one). Raises ``httpx.HTTPError`` / ``ValueError`` for a failed request."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "ignore_eos": True}
    t0 = time.monotonic()
    r = client.post(base_url.rstrip("/") + "/v1/completions", json=body, headers=headers or {})
    wall = time.monotonic() - t0
    if r.status_code != 200:
        raise ValueError(f"front-end probe answered HTTP {r.status_code}: {r.text[:200]}")
    eng = (r.json().get("slo") or {}).get("engine_ttft_ms")
    return None if eng is None else wall - float(eng) / 1e3


def measure_frontend_ttft(base_url: str, model: str, n: int = 9, headers: dict | None = None) -> float | None:
    """Median front-end seconds of ``n`` sequential probes (:func:`frontend_sample`) after one
    unmeasured warm-up probe, on a server nothing else is using; None when the server does not
    report the engine's TTFT. Never negative."""
    import httpx

    if n < 1:
        raise ValueError(f"need n >= 1 probes, got {n}")
    with httpx.Client(timeout=120) as client:
        frontend_sample(client, base_url, model, headers=headers)
        xs = [frontend_sample(client, base_url, model, headers=headers) for _ in range(n)]
    xs = [x for x in xs if x is not None]
    return max(0.0, statistics.median(xs)) if xs else None
