"""A ``laser serve`` subprocess for end-to-end benchmarks (``benchmarks/batch_window.py``,
``benchmarks/cluster_goodput.py``): start, wait for ``/health``, SIGKILL, restart, CPU use."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

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


class Server:
    """One ``laser serve`` subprocess (``serve_args``: its flags after ``--port`` and
    ``--data-dir``), restartable on the same ``data_dir`` and ``port``. Its output goes to
    ``data_dir/../server.log``.

    :meth:`cpu_seconds` accumulates the CPU time of every process it ran, counted from when each
    became ready (model loading and warm-up are left out). Raises RuntimeError when the server
    exits or is not ready within ``start_timeout_s``.
    """

    def __init__(self, data_dir: Path, port: int, serve_args: list[str], start_timeout_s: float = 300.0):
        self.data_dir, self.port = data_dir, port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = data_dir.parent / "server.log"
        self.cmd = [sys.executable, "-m", "laser.cli", "serve", "--port", str(port), "--data-dir", str(data_dir),
                    *serve_args]
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
                raise RuntimeError(f"laser serve exited with {self.proc.returncode}; log:\n{self.log_tail()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > self.start_timeout_s:
                self.stop()
                raise RuntimeError(f"laser serve not ready after {self.start_timeout_s:.0f} s; log:\n"
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

    def batch_lines_in_flight(self) -> int | None:
        """Lines of batch jobs the engine holds now (``laser:num_requests_running`` + ``_waiting`` of
        the ``batch`` class on ``/metrics``); None when the scrape fails."""
        from prometheus_client.parser import text_string_to_metric_families

        try:
            text = httpx.get(self.base_url + "/metrics", timeout=5).text
        except httpx.HTTPError:
            return None
        n = 0.0
        for fam in text_string_to_metric_families(text):
            if fam.name in ("laser:num_requests_running", "laser:num_requests_waiting"):
                n += sum(s.value for s in fam.samples if s.labels.get("slo_class") == "batch")
        return int(n)
