"""Server subprocesses for end-to-end benchmarks (``benchmarks/batch_window.py``,
``benchmarks/cluster_goodput.py``, ``benchmarks/llamacpp_compare.py``): start, wait for ``/health``,
SIGKILL, restart, CPU use. :class:`Server` is ``laser serve``; :class:`ServerProcess` any command."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from laser.bench.goodput import display_goodput_json

REPO = Path(__file__).resolve().parent.parent.parent


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (all its threads), from ``/proc/<pid>/stat``;
    None where ``/proc`` is not there or the process is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


class ServerProcess:
    """One HTTP server subprocess running ``cmd`` that listens on 127.0.0.1:``port`` and answers
    ``GET /health`` with 200 once ready (``laser serve``; llama.cpp's ``llama-server`` answers 503
    while it loads the model). Restartable on the same ``port``; its output goes to ``log_path``
    (appended); ``name`` labels its errors.

    :meth:`cpu_seconds` accumulates the CPU time of every process it ran, counted from when each
    became ready (model loading and warm-up are left out). :meth:`start` raises RuntimeError when
    the server exits or is not ready within ``start_timeout_s``.
    """

    def __init__(self, cmd: list[str], port: int, log_path: Path, start_timeout_s: float = 300.0,
                 name: str = "server"):
        self.cmd, self.port, self.log_path, self.name = list(cmd), port, log_path, name
        self.base_url = f"http://127.0.0.1:{port}"
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self._cpu_done = 0.0  # CPU seconds of processes that are gone
        self._cpu_base = 0.0  # CPU seconds of the current process when it became ready

    def start(self) -> float:
        """Start the process and wait for ``/health``; returns the seconds it took."""
        t0 = time.monotonic()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               "TOKENIZERS_PARALLELISM": "false"}
        log = open(self.log_path, "a")
        log.write(f"--- start {time.strftime('%H:%M:%S')}: {' '.join(self.cmd)}\n")
        log.flush()
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; log:\n{self.log_tail()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > self.start_timeout_s:
                self.stop()
                raise RuntimeError(f"{self.name} not ready after {self.start_timeout_s:.0f} s; log:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.25)
        self._cpu_base = proc_cpu_seconds(self.proc.pid) or 0.0
        return time.monotonic() - t0

    def cpu_seconds(self) -> float | None:
        """CPU seconds the server processes used while ready (None without ``/proc``)."""
        now = proc_cpu_seconds(self.proc.pid) if self.proc is not None and self.proc.poll() is None else None
        return None if now is None else self._cpu_done + now - self._cpu_base

    def kill(self) -> None:
        """SIGKILL the process (no shutdown of any kind) and reap it."""
        cpu = proc_cpu_seconds(self.proc.pid)
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        if cpu is not None:
            self._cpu_done += cpu - self._cpu_base

    def stop(self) -> None:
        """Stop the process (SIGTERM, then SIGKILL after 30 s)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


class Server(ServerProcess):
    """One ``laser serve`` subprocess (``serve_args``: its flags after ``--port`` and
    ``--data-dir``), restartable on the same ``data_dir`` and ``port``. Its output goes to
    ``data_dir/../server.log``. See :class:`ServerProcess`.
    """

    def __init__(self, data_dir: Path, port: int, serve_args: list[str], start_timeout_s: float = 300.0):
        self.data_dir = data_dir
        super().__init__([sys.executable, "-m", "laser.cli", "serve", "--port", str(port), "--data-dir",
                          str(data_dir), *serve_args], port, data_dir.parent / "server.log", start_timeout_s,
                         "laser serve")

    def metric(self, names: tuple[str, ...], **labels: str) -> float | None:
        """Sum of the ``/metrics`` samples of the families ``names`` (e.g. ``laser:instance_failures``)
        whose labels include ``labels``; None when the scrape fails."""
        from prometheus_client.parser import text_string_to_metric_families

        try:
            text = httpx.get(self.base_url + "/metrics", timeout=5).text
        except httpx.HTTPError:
            return None
        return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                   if (s.name in names or s.name.removesuffix("_total") in names)  # (a counter's sample)
                   and all(s.labels.get(k) == v for k, v in labels.items()))

    def engine_steps(self, since: int | None = None) -> dict:
        """``GET /engine/steps`` (a server started with ``--step-log N``): the engine's logged steps
        numbered ``since`` or later that ran their plans to the end, as (plan, seconds) under
        ``"steps"`` (plans rebuilt: :meth:`laser.core.plan.StepPlan.from_json`), and every logged
        step, cut ones too, as (ended, seconds, predicted) under ``"timed"`` (the engine's clock
        when it ended, s; the scheduler's price, s, None for a cut step or an unpriced plan);
        ``since`` None: none, only the counters (``total``, ``step_stats``, ``engine_thread``,
        ``gc``). Raises httpx.HTTPError when the request fails (404: no step log)."""
        from laser.core.plan import StepPlan

        r = httpx.get(self.base_url + "/engine/steps", params={"since": (1 << 62) if since is None else since},
                      timeout=120)
        r.raise_for_status()
        d = r.json()
        d["timed"] = [(end, s, None if cut is not None else pred) for _, s, _, end, pred, cut in d["steps"]]
        d["steps"] = [(StepPlan.from_json(plan), s) for _, s, plan, _, _, cut in d["steps"] if cut is None]
        return d

    def batch_lines_in_flight(self) -> int | None:
        """Lines of batch jobs the engine holds now (``laser:num_requests_running`` + ``_waiting`` of
        the ``batch`` class on ``/metrics``); None when the scrape fails."""
        n = self.metric(("laser:num_requests_running", "laser:num_requests_waiting"), slo_class="batch")
        return None if n is None else int(n)


def add_goodput_args(p, log_dir: str, **defaults) -> None:
    """Add the workload and search flags of :func:`run_goodput_search` to argparse parser ``p``
    (``defaults``: overrides by dest, e.g. ``slo_scale=10.0``), so that scripts comparing servers
    give every server the same arrivals, mix and SLO targets; also ``--json`` (where to write the
    blocks) and ``--log-dir`` (default ``log_dir``: where :func:`keep_log` copies server logs)."""
    d = {"num_prompts": 16, "length_scale": 0.25, "mix": "1:1:1", "seed": 0, "slo_scale": 10.0,
         "rate_range": "0.1,0.5", "grid_points": 3, "bisect_steps": 1, "time_cap": 900.0, "max_doublings": 1,
         **defaults}
    p.add_argument("--num-prompts", type=int, default=d["num_prompts"])
    p.add_argument("--length-scale", type=float, default=d["length_scale"])
    p.add_argument("--mix", default=d["mix"])
    p.add_argument("--seed", type=int, default=d["seed"])
    p.add_argument("--slo-scale", type=float, default=d["slo_scale"], help="the paper's SLO targets times this")
    p.add_argument("--rate-range", default=d["rate_range"], help="LO,HI req/s of the search grid")
    p.add_argument("--grid-points", type=int, default=d["grid_points"])
    p.add_argument("--bisect-steps", type=int, default=d["bisect_steps"])
    p.add_argument("--time-cap", type=float, default=d["time_cap"], help="seconds of goodput search per server")
    p.add_argument("--max-doublings", type=int, default=d["max_doublings"],
                   help="doublings (halvings) of the rate past the grid (each halving doubles a probe's length)")
    p.add_argument("--json", default=None, help="write every server's block here")
    p.add_argument("--log-dir", default=log_dir, help="copy each server's log here ('' to drop them)")


def keep_log(log_path: Path, log_dir: str, name: str) -> None:
    """Copy server log ``log_path`` to ``<log_dir>/<name>-server.log`` (nothing when ``log_dir`` is
    empty or the log does not exist): a server that stalls is diagnosed from it."""
    if log_dir and log_path.exists():
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        shutil.copy(log_path, Path(log_dir) / f"{name}-server.log")


def goodput_search_cmd(base_url: str, label: str, args, out: Path, extra_body: dict | None = None,
                       slo_config: Path | None = None) -> list[str]:
    """The ``laser bench --base-url`` command of :func:`run_goodput_search`: the paper's targets x
    ``args.slo_scale``, or, with ``slo_config``, that file's targets as they are (``--slo-scale 1``)."""
    scale = ["--slo-scale", f"{args.slo_scale:g}"] if slo_config is None else \
        ["--slo-config", str(slo_config), "--slo-scale", "1"]
    cmd = [sys.executable, "-m", "laser.cli", "bench", "--base-url", base_url, "--label", label,
           "--slo-base", "paper", *scale, "--num-prompts", str(args.num_prompts),
           "--length-scale", f"{args.length_scale:g}", "--seed", str(args.seed), "--mix", args.mix,
           "--rate-range", args.rate_range, "--grid-points", str(args.grid_points),
           "--bisect-steps", str(args.bisect_steps), "--search-time-cap", f"{args.time_cap:g}",
           "--max-doublings", str(args.max_doublings), "--json", str(out)]
    return cmd + (["--extra-body", json.dumps(extra_body)] if extra_body else [])


def run_goodput_search(base_url: str, label: str, args, out: Path, extra_body: dict | None = None,
                       slo_config: Path | None = None) -> dict:
    """Run ``laser bench --base-url`` (goodput search, ``--slo-base paper``) against ``base_url``
    with the flags of :func:`add_goodput_args` in ``args`` (and ``--extra-body`` when
    ``extra_body`` is given; the targets of ``slo_config`` when given), writing its JSON to ``out``;
    returns the target's block (``goodput_rps``, ``probes``, ...). Raises CalledProcessError when
    the bench fails."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    subprocess.run(goodput_search_cmd(base_url, label, args, out, extra_body, slo_config), cwd=REPO, env=env,
                   check=True)
    return json.loads(out.read_text())["policies"][label]


def _probe_at(block: dict, rate: float) -> dict | None:
    """The probe at ``rate``: the last complete one (the search re-runs its reference rate in full
    after probes that stopped early, whose attainment is only a lower bound and whose TTFT covers
    the requests that started), else the last one."""
    at = [p for p in block.get("probes", []) if p["rate_rps"] is not None and abs(p["rate_rps"] - rate) < 1e-9]
    full = [p for p in at if not p.get("early_stopped")]
    return (full or at or [None])[-1]


def goodput_table(blocks: dict[str, dict], first_col: str = "layout") -> str:
    """Markdown table of :func:`run_goodput_search` blocks by name: goodput (as
    :func:`~laser.bench.goodput.display_goodput_json` writes it), then attainment /
    mean TTFT / P99 TBT at the highest rate every server was probed at not above the lowest
    goodput (the common reference rate)."""
    common = set.intersection(*({p["rate_rps"] for p in b.get("probes", []) if p["rate_rps"] is not None}
                                for b in blocks.values()))
    floor = min((b["goodput_rps"] or 0.0) for b in blocks.values())
    ref = max((r for r in common if r <= max(floor, min(common, default=0.0))), default=None)
    lines = [f"| {first_col} | goodput (req/s) | attainment @ {ref} req/s | mean TTFT | P99 TBT |",
             "|---|---|---|---|---|"]
    for name, b in blocks.items():
        gs = display_goodput_json(b)
        p = _probe_at(b, ref) if ref is not None else None
        p = p or {}
        cells = [_fmt(p.get("attainment"), "{:.2f}"), _fmt(p.get("mean_ttft_s"), "{:.2f} s"),
                 _fmt(p.get("p99_tbt_s"), "{:.2f} s")]
        lines.append(f"| {name} | {gs} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else spec.format(x)  # None: no probe, or a probe that streamed no token
