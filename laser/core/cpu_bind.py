"""CPU binding: the engine thread and its torch (OpenMP) threads on chosen cores, the front end on the rest.

``--cpu-bind`` (``laser serve | generate | bench | profile``; ``LLM(cpu_bind=...)``) takes

* ``none`` (default): nothing is bound; the OS places every thread;
* ``auto``: the engine gets one logical CPU on each of ``threads`` physical cores (the last cores of
  the process's allowed set, so CPU 0, where Linux often handles interrupts, stays with the front
  end); the front end (event loop, tokenizer and HTTP threads) gets the allowed CPUs left over;
* a list such as ``0-3,6``: the engine's CPUs; the front end gets the allowed CPUs not listed.

With nothing left over the front end is not bound (it shares the engine's CPUs). The same
conventions as vLLM's CPU backend (``VLLM_CPU_OMP_THREADS_BIND``: ``auto``, ``nobind`` or a list;
one logical CPU per physical core, and CPUs reserved for its front-end process) and SGLang's
(``SGLANG_CPU_OMP_THREADS_BIND``); here the engine and the front end are threads of one process.

How it binds: Linux ``sched_setaffinity`` is per thread (``os.sched_setaffinity(tid, cpus)``),
and a new thread starts with the mask of the thread that creates it. libgomp (torch's OpenMP
runtime here) keeps one team of worker threads per thread that runs parallel regions, created at
its first parallel region with more than one thread (:mod:`laser.core.owner_thread`). So binding
the engine's thread *before* its first torch op puts its team on the same CPUs; a team that
already exists (torch work done on that thread before binding: ``LLM`` after other torch code) is
rebound by binding every thread of the process (``whole_process``: the in-process commands, which
have no front end of their own). ``laser serve`` binds every thread of the process to the front
end's CPUs first, then starts the engine's owner thread, which binds itself to the engine's CPUs
before it builds the engine (its team is made after). Ray instance actors are processes Ray starts
(their masks are Ray's): ``--cpu-bind`` is refused with instances.

Errors: :class:`~laser.core.config.ConfigError` for a malformed list, CPUs outside the process's
allowed set (``os.sched_getaffinity(0)``), more torch threads than bound CPUs, or a host without
``sched_setaffinity``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from .config import ConfigError

log = logging.getLogger(__name__)

#: the values of ``--cpu-bind`` besides a CPU list
MODES = ("none", "auto")


@dataclass(frozen=True)
class CpuBinding:
    """A planned binding: ``engine`` (sorted logical CPU ids: the engine thread and its torch
    threads), ``front`` (the front end's CPUs; empty: not bound, shares the engine's), ``spec``
    (what was asked: ``auto`` or the list as given)."""

    spec: str
    engine: tuple[int, ...]
    front: tuple[int, ...]

    def describe(self) -> str:
        """One line for the startup log, e.g. ``engine CPUs 1, front end 0 (auto)``."""
        front = format_cpus(self.front) if self.front else "not bound (no CPU left over)"
        return f"engine CPUs {format_cpus(self.engine)}, front end {front} ({self.spec})"


def format_cpus(cpus) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (the list syntax :func:`parse_cpu_list` reads)."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """Logical CPU ids of a list like ``0-3,6`` (comma-separated ids and inclusive ranges ``a-b``,
    as ``taskset -c`` and ``VLLM_CPU_OMP_THREADS_BIND`` write them), sorted, each once.
    Raises ConfigError for an empty list, a negative or non-integer id, or a range ``a-b`` with a > b."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise ConfigError(f"--cpu-bind {text!r}: {part!r} is not a CPU id or range a-b "
                              f"(expected 'auto', 'none' or a list like 0-3,6)") from None
        if a < 0 or b < a:
            raise ConfigError(f"--cpu-bind {text!r}: bad range {part!r} (CPU ids are >= 0, a-b needs a <= b)")
        cpus.update(range(a, b + 1))
    return tuple(sorted(cpus))


def allowed_cpus() -> tuple[int, ...]:
    """The CPUs the calling thread may run on (``os.sched_getaffinity(0)``), sorted. Raises
    ConfigError where the OS has no affinity calls (not Linux)."""
    if not hasattr(os, "sched_getaffinity") or not hasattr(os, "sched_setaffinity"):
        raise ConfigError("--cpu-bind needs sched_setaffinity (Linux); use --cpu-bind none here")
    return tuple(sorted(os.sched_getaffinity(0)))


def core_of(cpu: int) -> tuple[str, str]:
    """(package id, core id) of logical CPU ``cpu`` from sysfs; SMT siblings share it. Where sysfs
    does not say, each CPU is its own core."""
    top = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
    try:
        return (top / "physical_package_id").read_text().strip(), (top / "core_id").read_text().strip()
    except OSError:
        return ("?", str(cpu))


def plan_cpu_bind(spec: str | None, threads: int | None, allowed=None, core=core_of) -> CpuBinding | None:
    """The binding ``spec`` asks for (None for ``none``/None: bind nothing).

    Args:
        spec: ``none``, ``auto`` or a CPU list (:func:`parse_cpu_list`).
        threads: torch threads the engine will run (None: one per physical core of the engine's
            CPUs for a list; for ``auto``, every physical core allowed).
        allowed: the CPUs the process may use (default :func:`allowed_cpus`).
        core: logical CPU -> physical core key (default :func:`core_of`; tests pass their own).
    Raises:
        ConfigError: a malformed list, CPUs outside ``allowed`` (named, with the allowed set),
            ``threads`` above the bound CPUs (each thread would wait for a CPU), or above the
            allowed CPUs for ``auto``.
    """
    spec = "none" if spec is None else spec.strip()
    if spec == "none":
        return None
    allowed = tuple(sorted(allowed if allowed is not None else allowed_cpus()))
    if spec == "auto":
        engine = _auto_cpus(allowed, threads, core)
    else:
        engine = parse_cpu_list(spec)
        missing = sorted(set(engine) - set(allowed))
        if missing:
            raise ConfigError(f"--cpu-bind {spec}: CPUs {format_cpus(missing)} are not in this process's allowed "
                              f"set {format_cpus(allowed)} (os.sched_getaffinity; taskset, cgroups)")
        if threads and threads > len(engine):
            raise ConfigError(f"--cpu-bind {spec}: {len(engine)} CPU(s) for --threads {threads}; more threads than "
                              f"bound CPUs only wait for one: bind at least {threads} CPUs or lower --threads")
    front = tuple(c for c in allowed if c not in engine)
    return CpuBinding(spec, tuple(engine), front)


def _auto_cpus(allowed: tuple[int, ...], threads: int | None, core) -> tuple[int, ...]:
    """``auto``'s engine CPUs: one logical CPU on each of ``threads`` physical cores taken from the
    end of ``allowed`` (first logical CPU of each core), SMT siblings only past the physical cores."""
    firsts: dict = {}
    for c in allowed:
        firsts.setdefault(core(c), c)
    primary = sorted(firsts.values())
    n = threads or len(primary)
    if n > len(allowed):
        raise ConfigError(f"--cpu-bind auto: --threads {n} above the {len(allowed)} CPUs this process may run on")
    if n <= len(primary):
        return tuple(primary[-n:])
    rest = [c for c in allowed if c not in primary]
    return tuple(sorted(primary + rest[len(rest) - (n - len(primary)):]))


def engine_threads(binding: CpuBinding | None, threads: int | None, core=core_of) -> int | None:
    """The torch thread count to use with ``binding``: ``threads`` when given; else, for a CPU list,
    one per physical core among its CPUs (instead of the machine's physical cores); else None."""
    if threads or binding is None or binding.spec == "auto":
        return threads
    return len({core(c) for c in binding.engine})


def thread_ids() -> list[int]:
    """Kernel thread ids of every thread of this process (``/proc/self/task``); [] where unreadable."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return []


def bind_threads(cpus, tids=None) -> int:
    """Set the CPU mask of threads ``tids`` of this process (default: every thread, :func:`thread_ids`)
    to ``cpus``; a thread that ended meanwhile is skipped. Returns how many were set."""
    n = 0
    for tid in thread_ids() if tids is None else tids:
        try:
            os.sched_setaffinity(tid, cpus)
            n += 1
        except (ProcessLookupError, PermissionError):  # the thread ended meanwhile / not ours to move
            pass
    return n


def bind_engine(binding: CpuBinding | None, whole_process: bool) -> None:
    """Bind the calling thread (the engine's; its torch team, made afterwards, inherits it) to
    ``binding.engine``; with ``whole_process`` every thread of the process too (an OpenMP team that
    already exists, other threads of an in-process run). Nothing for None. Logs what was bound."""
    if binding is None:
        return
    os.sched_setaffinity(0, binding.engine)
    others = bind_threads(binding.engine, [t for t in thread_ids() if t != _own_tid()]) if whole_process else 0
    what = f"this process's {others + 1} threads" if whole_process else "the engine thread"
    log.info("cpu bind: %s and its torch threads on CPUs %s (%s)", what, format_cpus(binding.engine), binding.spec)


def bind_front_end(binding: CpuBinding | None) -> None:
    """Bind every thread of the process (the event loop's, which then starts the engine thread and
    the server's threads: they inherit the mask) to ``binding.front``. Nothing for None or an empty
    front (no CPU left over). Call before the engine's thread exists: it binds itself afterwards."""
    if binding is None or not binding.front:
        return
    n = bind_threads(binding.front)
    log.info("cpu bind: front end (%d threads: event loop, server) on CPUs %s", n, format_cpus(binding.front))


def _own_tid() -> int:
    import threading

    return threading.get_native_id()  # the kernel's thread id on Linux (os.gettid is Python >= 3.12)


def bind_in_process(spec: str | None) -> CpuBinding | None:
    """``LLM(cpu_bind=spec)``: plan with torch's threads left to the binding, bind every thread of
    the process (a torch team made before included) to the engine's CPUs, and set torch's threads
    to one per physical core bound. Returns the binding (None for ``none``). Raises ConfigError
    as :func:`plan_cpu_bind`."""
    binding = plan_cpu_bind(spec, None)
    if binding is not None:
        import torch

        bind_engine(binding, whole_process=True)
        torch.set_num_threads(engine_threads(binding, None) or len(binding.engine))
    return binding
