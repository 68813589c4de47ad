"""The batch-window benchmark's measures (``benchmarks/batch_window.py``, issue 14's done-when
run): hot attainment per phase, the requests an outage failed, and the run's command line."""

from __future__ import annotations

import argparse
import math

from laser.batch.estimate import parse_window
from laser.core.metrics import RequestRecord, summarize


def phase_stats(records: list[RequestRecord], leave_out: set[str] = frozenset()) -> dict:
    """Hot attainment (overall and per class) and mean TTFT (s) of ``records``, without the
    requests whose ids are in ``leave_out``."""
    recs = [r for r in records if r.req_id not in leave_out]
    s = summarize(recs)
    return {"requests": len(recs), "attainment": s.overall.attainment, "ttft_mean_s": s.overall.ttft_mean,
            "tpot_mean_s": s.overall.tpot_mean,
            "per_class": {c: v.attainment for c, v in s.per_class.items()},
            "unfinished": sum(not r.finished for r in recs)}


def outage_ids(records: list[RequestRecord], t_kill: float | None, t_ready: float | None) -> set[str]:
    """Requests the outage failed: unfinished ones in flight at ``t_kill`` or sent before ``t_ready``."""
    if t_kill is None:
        return set()
    end = t_ready if t_ready is not None else math.inf
    return {r.req_id for r in records if not r.finished and r.arrival_time < end
            and (not r.token_times or r.token_times[-1] >= t_kill - 1.0)}


def parse_args(argv=None, description: str | None = None) -> argparse.Namespace:
    """The command line of ``benchmarks/batch_window.py`` (``--quick`` and full-run defaults filled
    in); exits with a usage error on a bad value."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rate", type=float, default=None, help="interactive request rate, req/s (default 0.2)")
    p.add_argument("--duration", type=float, default=None, help="seconds of interactive arrivals per phase "
                                                                "(default 300; --quick 60)")
    p.add_argument("--batch-requests", type=int, default=None, help="lines of the batch job (default 200; --quick 20)")
    p.add_argument("--window", default=None, help="completion_window of the job (default 10m; --quick 2m)")
    p.add_argument("--kill-at", type=float, default=1 / 3, help="SIGKILL the server when this fraction of the job "
                                                                "is done (default 1/3)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the server (default 1)")
    p.add_argument("--slo-scale", type=float, default=10.0, help="multiply the paper's SLO targets (default 10)")
    p.add_argument("--policy", default="laser", help="the server's --policy (default laser)")
    p.add_argument("--batch-concurrency", type=int, default=8, help="the server's --batch-concurrency (default 8)")
    p.add_argument("--length-scale", type=float, default=0.1, help="interactive prompt/output length scale")
    p.add_argument("--job-length-scale", type=float, default=0.025,
                   help="job prompt length scale (of the paper's 2,085-token summarisation mean)")
    p.add_argument("--job-max-tokens", type=int, default=8, help="max_tokens of each job line")
    p.add_argument("--drain", type=float, default=120.0, help="seconds after the last arrival before unfinished "
                                                             "interactive requests are given up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smoke test: 20 lines, 2-minute window, 60 s phases")
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args(argv)
    quick = {"rate": 0.2, "duration": 60.0, "batch_requests": 20, "window": "2m"}
    full = {"rate": 0.2, "duration": 300.0, "batch_requests": 200, "window": "10m"}
    for k, v in (quick if a.quick else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if not 0 < a.kill_at < 1:
        p.error("--kill-at must be in (0, 1)")
    if a.batch_requests < 1 or a.rate <= 0 or a.duration <= 0:
        p.error("--batch-requests, --rate and --duration must be > 0")
    try:
        parse_window(a.window)
    except ValueError as e:
        p.error(str(e))
    return a
