"""Issue 14's done-when run: a batch job with a completion window beside interactive traffic,
through the official ``openai`` client, surviving a server kill.

What it does, against a real ``laser serve`` of the embedded default model (SmolLM2-135M):

1. starts ``laser serve`` as a subprocess (its own temporary ``--data-dir``, a free port) and
   waits for ``/health``;
2. **phase A (alone)**: interactive Poisson traffic (classes ``chat`` and ``code``, both hot;
   :func:`laser.bench.workloads.sample_mix` + :mod:`laser.bench.arrivals`) at ``--rate`` req/s
   for ``--duration`` s through :class:`laser.bench.client.ClientTarget` (streaming, timed
   client-side); hot SLO attainment by the paper's rule (finished, TTFT <= target and P99 TBT <=
   target: :attr:`laser.core.metrics.RequestRecord.slo_met`) and mean TTFT;
3. **phase B (with the job)**: uploads a ``--batch-requests``-line JSONL of
   ``/v1/chat/completions`` bodies (short summarisation prompts, ``--job-max-tokens`` output
   tokens each) with ``client.files.create(purpose="batch")`` and creates the batch with
   ``client.batches.create(..., completion_window=--window)``
   (:class:`laser.bench.batchjob.ClientJob`), then runs the same interactive arrivals again. When
   ``--kill-at`` of the job's lines are done, the server is killed with SIGKILL and restarted on
   the same ``--data-dir`` and port; the interactive traffic keeps going (requests sent while the
   server is down, or in flight at the kill, fail and count as misses; they are also reported
   apart). The job is polled with ``client.batches.retrieve`` until it ends; its output and error
   files are downloaded with ``client.files.content`` and checked: exactly one result per
   ``custom_id``, none duplicated, none missing, error lines listed;
4. prints the comparison: attainment and mean TTFT alone vs with the job (and with the outage's
   requests left out), the job's completion time (the server's ``completed_at - created_at``)
   against its window, the lines re-run after the restart, and the server process's CPU use
   (CPU-seconds per wall-second, from ``/proc``: a proxy for the busy fraction, which a client
   cannot see; it includes the HTTP front end, not only engine steps).

Run from the repository root (``--quick``: a smoke test of a few minutes)::

    python benchmarks/batch_window.py                # 200 lines, 10-minute window (~12-15 min)
    python benchmarks/batch_window.py --quick        # 20 lines, 2-minute window, short phases

Defaults (chosen with the simulator on the shipped AVX2 fp32 profile of SmolLM2-135M, 1 thread,
``benchmarks/profiles/avx2-fp32-smollm2-135m.json``, before any real run): 0.2 req/s of chat and
code at length scale 0.1 (mean output ~20 tokens) with the paper's targets x 10 (chat 2.5 s / 1 s,
code 1.25 s / 0.5 s) is a rate where hot attainment alone is about 100% (0.3 req/s: 89%); job lines
of ~55-token prompts and 8 output tokens are ~1 s of whole-machine work each (200 lines: ~210 s),
leaving the 600 s window room for the kill, the restart and the interactive traffic.

Exit status: 0 when the job completed inside its window with every line exactly once and no
error line; 1 otherwise (the report says what went wrong).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from laser.batch.estimate import parse_window
from laser.bench.arrivals import arrival_times, with_arrivals
from laser.bench.batch_window import outage_ids, parse_args as _parse_args, phase_stats
from laser.bench.batchjob import ClientJob, batch_job_requests
from laser.bench.client import ClientTarget
from laser.bench.serve_proc import Server, free_port
from laser.bench.workloads import HFTokenizer, WorkloadRequest, sample_mix
from laser.core.slo import SLOClasses

ENDPOINT = "/v1/chat/completions"
INTERACTIVE_MIX = (1, 1, 0)  # chat : code : summarization -- the hot classes only
MAX_MODEL_LEN = 512  # prompt + output cap of the generated requests (tokens)


# ------------------------------------------------------------------------------------------- server


# ------------------------------------------------------------------------------------------ workload


def interactive_workload(tokenizer, rate: float, duration_s: float, seed: int,
                         length_scale: float) -> list[WorkloadRequest]:
    """Poisson arrivals at ``rate`` req/s over ``duration_s`` seconds, classes chat and code (1:1)."""
    n = max(1, round(rate * duration_s))
    reqs = sample_mix(INTERACTIVE_MIX, n, seed, length_scale, tokenizer, MAX_MODEL_LEN)
    return with_arrivals(reqs, arrival_times(n, rate, seed=seed))


def job_workload(tokenizer, n: int, seed: int, length_scale: float, max_tokens: int) -> list[WorkloadRequest]:
    """``n`` summarisation prompts (:func:`laser.bench.batchjob.batch_job_requests`, lengths times
    ``length_scale``), each asking for ``max_tokens`` output tokens."""
    reqs = batch_job_requests(tokenizer, n, seed, length_scale, MAX_MODEL_LEN)
    return [dataclasses.replace(r, output_len=max_tokens) for r in reqs]


# ------------------------------------------------------------------------------------- kill/restart


class KillAndRestart(threading.Thread):
    """Watches the job (``batches.retrieve``) and, once ``fraction`` of its lines are done, kills
    the server with SIGKILL and restarts it on the same data dir and port.

    After :meth:`join`: ``done_at_kill`` (lines the API reported done just before), ``committed``
    (lines whose results the SQLite store held when the process died), ``in_flight`` (lines the
    engine held at the kill, from ``/metrics``), ``t_kill`` / ``t_ready`` (``time.monotonic()``),
    ``restart_s``; ``error`` if the restart failed.
    """

    def __init__(self, server: Server, client, batch_id: str, total: int, fraction: float):
        super().__init__(name="kill-and-restart", daemon=True)
        self.server, self.client, self.batch_id = server, client, batch_id
        self.threshold = max(1, math.ceil(fraction * total))
        self.done_at_kill = self.committed = self.in_flight = None
        self.t_kill = self.t_ready = self.restart_s = None
        self.error: BaseException | None = None
        self.stop_event = threading.Event()

    def run(self) -> None:
        try:
            while not self.stop_event.is_set():
                b = self.client.batches.retrieve(self.batch_id)
                done = b.request_counts.completed + b.request_counts.failed
                if b.status not in ("validating", "in_progress"):
                    return  # ended before the threshold: nothing to kill
                if done >= self.threshold:
                    self.in_flight = self.server.batch_lines_in_flight()
                    self.done_at_kill = done
                    self.t_kill = time.monotonic()
                    self.server.kill()
                    self.committed = committed_lines(self.server.data_dir, self.batch_id)
                    self.restart_s = self.server.start()
                    self.t_ready = time.monotonic()
                    return
                time.sleep(0.25)
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            self.error = e


def committed_lines(data_dir: Path, batch_id: str) -> int:
    """Lines of ``batch_id`` with a committed result in the store (read while the server is down)."""
    import sqlite3

    db = sqlite3.connect(data_dir / "laser.sqlite3")
    try:
        return db.execute("SELECT COUNT(*) FROM requests WHERE batch_id = ? AND state != 'pending'",
                          (batch_id,)).fetchone()[0]
    finally:
        db.close()


def check_output(client, batch_id: str, n: int) -> dict:
    """Download the job's output and error files; count results per ``custom_id`` (``job-0`` ..
    ``job-{n-1}``): ``missing``, ``duplicated``, ``unexpected`` ids, ``error_lines`` (error file
    lines plus output lines whose status is not 200), and the batch object's final fields."""
    b = client.batches.retrieve(batch_id)
    seen: dict[str, int] = {}
    errors = []
    for fid, is_err in ((b.output_file_id, False), (b.error_file_id, True)):
        if not fid:
            continue
        for ln in client.files.content(fid).text.splitlines():
            if not ln.strip():
                continue
            rec = json.loads(ln)
            seen[rec["custom_id"]] = seen.get(rec["custom_id"], 0) + 1
            resp = rec.get("response") or {}
            if is_err or rec.get("error") or resp.get("status_code") != 200:
                errors.append({"custom_id": rec["custom_id"], "error": rec.get("error") or resp.get("body")})
    expected = {f"job-{i}" for i in range(n)}
    return {"status": b.status, "request_counts": b.request_counts.model_dump(),
            "completion_s": (b.completed_at - b.created_at) if b.completed_at else None,
            "results": sum(seen.values()), "missing": sorted(expected - set(seen)),
            "duplicated": sorted(c for c, k in seen.items() if k > 1),
            "unexpected": sorted(set(seen) - expected), "error_lines": errors}


# ------------------------------------------------------------------------------------------- report


def _pct(v) -> str:
    return "-" if v is None else f"{v:.1%}"


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1e3:.0f} ms"


def format_report(res: dict) -> str:
    """The comparison table of one run (``res`` as :func:`run` returns it)."""
    a, b, bx, job, k = res["alone"], res["with_job"], res["with_job_outage_left_out"], res["job"], res["kill"]
    cls = sorted(set(a["per_class"]) | set(b["per_class"]))
    rows = [("", "alone", "with job", "with job, outage left out"),
            ("interactive requests", str(a["requests"]), f"{b['requests']} ({res['outage_requests']} hit by the outage)",
             str(bx["requests"])),
            ("hot SLO attainment", _pct(a["attainment"]), _pct(b["attainment"]), _pct(bx["attainment"]))]
    rows += [(f"  {c}", _pct(a["per_class"].get(c)), _pct(b["per_class"].get(c)), _pct(bx["per_class"].get(c)))
             for c in cls]
    rows += [("mean TTFT", _ms(a["ttft_mean_s"]), _ms(b["ttft_mean_s"]), _ms(bx["ttft_mean_s"])),
             ("mean TPOT", _ms(a["tpot_mean_s"]), _ms(b["tpot_mean_s"]), _ms(bx["tpot_mean_s"])),
             ("unfinished", str(a["unfinished"]), str(b["unfinished"]), str(bx["unfinished"])),
             ("server CPU (cores busy)", _num(res["cpu_alone"]), _num(res["cpu_with_job"]), "")]
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip() for r in rows]
    comp = job["completion_s"]
    lines.append("")
    lines.append(f"batch job: {res['batch_requests']} lines, completion_window {res['window']!r} ({res['window_s']:g} s), "
                 f"status {job['status']}, request_counts {job['request_counts']}")
    pred = res.get("predicted_work_s")
    lines.append(f"  completed in {'-' if comp is None else f'{comp:.0f} s'} of its {res['window_s']:g} s window "
                 f"({'MET' if res['met_window'] else 'MISSED'})"
                 + (f"; latency model's whole-machine work {pred:.0f} s" if pred is not None else ""))
    if k["t_kill"] is None:
        lines.append("  kill: not done (the job ended before the threshold)" + (f": {k['error']}" if k["error"] else ""))
    else:
        lines.append(f"  SIGKILL at {k['done_at_kill']}/{res['batch_requests']} lines done ({k['committed']} committed "
                     f"in SQLite), {k['in_flight']} lines in the engine at the kill (run again after the restart), "
                     f"{res['batch_requests'] - k['committed']} lines run by the restarted server; restart took "
                     f"{k['restart_s']:.1f} s")
    lines.append(f"  output check: {job['results']} results, missing {len(job['missing'])}, duplicated "
                 f"{len(job['duplicated'])}, unexpected {len(job['unexpected'])}, error lines {len(job['error_lines'])}")
    for e in job["error_lines"][:5]:
        lines.append(f"    error: {json.dumps(e)[:300]}")
    return "\n".join(lines)


def _num(v) -> str:
    return "-" if v is None else f"{v:.2f}"


# ---------------------------------------------------------------------------------------------- run


def run(args) -> dict:
    """Both phases on one server; returns the results (json-able)."""
    from laser.model.loader import load_tokenizer, resolve_model

    window_s = parse_window(args.window)
    tokenizer = HFTokenizer(load_tokenizer(resolve_model(None)))
    slos = SLOClasses.load(None, scale=args.slo_scale)
    interactive = interactive_workload(tokenizer, args.rate, args.duration, args.seed, args.length_scale)
    job_reqs = job_workload(tokenizer, args.batch_requests, args.seed, args.job_length_scale, args.job_max_tokens)
    print(f"interactive: {len(interactive)} requests (chat+code, {args.rate:g} req/s over {args.duration:g} s, "
          f"mean prompt {sum(r.prompt_len for r in interactive) / len(interactive):.0f} tokens, mean output "
          f"{sum(r.output_len for r in interactive) / len(interactive):.0f}); SLO scale {args.slo_scale:g}: "
          + ", ".join(f"{c} TTFT {slos.get(c).ttft:g} s / TBT {slos.get(c).tbt:g} s" for c in ("chat", "code")))
    print(f"batch job: {len(job_reqs)} lines to {ENDPOINT} (mean prompt "
          f"{sum(r.prompt_len for r in job_reqs) / len(job_reqs):.0f} tokens, {args.job_max_tokens} output tokens "
          f"each), completion_window {args.window!r}, kill at {args.kill_at:.0%} of the job", flush=True)
    timeout = args.duration + args.drain
    with tempfile.TemporaryDirectory(prefix="laser-batch-window-") as tmp:
        server = Server(Path(tmp) / "data", free_port(),
                        ["--threads", str(args.threads), "--slo-scale", f"{args.slo_scale:g}", "--policy", args.policy,
                         "--batch-concurrency", str(args.batch_concurrency), "--log-level", "warning"])
        try:
            print(f"server ready in {server.start():.1f} s at {server.base_url}", flush=True)
            target = ClientTarget(server.base_url, endpoint=ENDPOINT, label="interactive")
            target.warmup()
            # phase A: alone
            cpu0, t0 = server.cpu_seconds(), time.monotonic()
            out_a = target.run(interactive, slos, timeout_s=timeout)
            cpu_alone = _rate(cpu0, server.cpu_seconds(), time.monotonic() - t0)
            alone = phase_stats(out_a.records)
            print(f"phase A (alone): attainment {_pct(alone['attainment'])}, mean TTFT {_ms(alone['ttft_mean_s'])}",
                  flush=True)
            # phase B: with the job, the server killed and restarted mid-job
            job = ClientJob(server.base_url, None, target.resolve_model(), ENDPOINT, job_reqs, window_s,
                            poll_s=1.0, completion_window=args.window)
            cpu0, t0 = server.cpu_seconds(), time.monotonic()
            job.start()
            killer = KillAndRestart(server, job.client, job.batch_id, len(job_reqs), args.kill_at)
            killer.start()
            target.errors.clear()
            out_b = target.run(interactive, slos, timeout_s=timeout)
            t_interactive_end = time.monotonic()
            try:
                job.join()
            except RuntimeError as e:  # duplicated ids: check_output says which
                print(f"job: {e}")
            killer.stop_event.set()
            killer.join()
            outage_s = (killer.t_ready - killer.t_kill) if killer.t_ready is not None else 0.0
            cpu_with = _rate(cpu0, server.cpu_seconds(), t_interactive_end - t0 - outage_s)
            checked = check_output(job.client, job.batch_id, len(job_reqs))
        finally:
            server.stop()
    hit = outage_ids(out_b.records, killer.t_kill, killer.t_ready)
    res = {
        "benchmark": "batch_window (issue 14 done-when)", "rate_rps": args.rate, "duration_s": args.duration,
        "seed": args.seed, "slo_scale": args.slo_scale, "threads": args.threads, "policy": args.policy,
        "batch_requests": len(job_reqs), "window": args.window, "window_s": window_s,
        "job_max_tokens": args.job_max_tokens, "kill_at": args.kill_at,
        "alone": alone, "with_job": phase_stats(out_b.records), "with_job_outage_left_out": phase_stats(out_b.records, hit),
        "outage_requests": len(hit), "cpu_alone": cpu_alone, "cpu_with_job": cpu_with,
        "predicted_work_s": getattr(job, "predicted_work_s", None), "job": checked,
        "kill": {"done_at_kill": killer.done_at_kill, "committed": killer.committed, "in_flight": killer.in_flight,
                 "restart_s": killer.restart_s, "t_kill": killer.t_kill,
                 "error": None if killer.error is None else repr(killer.error)},
        "interactive_errors": target.errors[:20],
    }
    res["met_window"] = checked["status"] == "completed" and checked["completion_s"] is not None \
        and checked["completion_s"] <= window_s
    res["ok"] = res["met_window"] and not (checked["missing"] or checked["duplicated"] or checked["unexpected"]
                                           or checked["error_lines"]) and killer.error is None
    return res


def _rate(cpu0: float | None, cpu1: float | None, wall_s: float) -> float | None:
    if cpu0 is None or cpu1 is None or wall_s <= 0:
        return None
    return (cpu1 - cpu0) / wall_s


def parse_args(argv=None) -> argparse.Namespace:
    return _parse_args(argv, __doc__.split("\n\n")[0])


def main(argv=None) -> int:
    args = parse_args(argv)
    print(f"CPU: {os.cpu_count()} cores; server threads {args.threads}, policy {args.policy}", flush=True)
    res = run(args)
    print()
    print(format_report(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2, default=str))
        print(f"results written to {args.json}")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
