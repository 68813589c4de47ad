"""Robust timing on a shared machine: :class:`Case` (one thing to time) and :class:`Bench`.

Other processes come and go; with two threads one busy core can make a call 5x slower.
Every quantity is therefore measured by :class:`Bench`: a warm-up, then rounds in which
every case runs once, in a freshly shuffled order (repeats of one case are spread over
the whole run, not back to back), until the two fastest repeats of every case agree
within ``tol`` and one of them ran *clean* -- no task waited for a CPU meanwhile, per the
kernel's pressure counter ``/proc/pressure/cpu`` (at least ``min_rounds``, at most
``max_rounds``; past the time budget no new round starts, but every case gets at least
two repeats, so a busy machine makes profiling slower rather than wrong). A case's time
is the mean of its two fastest repeats: interference only adds time, so this estimates
the *undisturbed* time. Torch-free.
"""

from __future__ import annotations

import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

_PSI_PATH = "/proc/pressure/cpu"
_psi_file = None


def _psi_reader() -> Callable[[], int] | None:
    """Cumulative microseconds during which some task waited for a CPU (Linux PSI), or None."""
    global _psi_file
    try:
        if _psi_file is None:
            _psi_file = open(_PSI_PATH, "rb", buffering=0)  # kept open: one read per timed call
        f = _psi_file

        def read() -> int:
            f.seek(0)
            line = f.read(256).split(b"\n", 1)[0]
            return int(line.rsplit(b"total=", 1)[1])

        read()
        return read
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class Case:
    """One thing to time: ``run()`` does one call (its result is discarded).

    ``times`` are all repeats; ``clean`` those during which no task waited for a CPU
    (nothing else competed with us), when the kernel reports CPU pressure.
    """

    key: object
    run: Callable[[], object]
    times: list[float] = field(default_factory=list)
    clean: list[float] = field(default_factory=list)
    # Calls per repeat (back to back; a repeat's time is their mean). 0 = not yet chosen:
    # :meth:`Bench.run` sizes it from one untimed call (see ``Bench.burst_s``).
    burst: int = 0

    def estimate(self) -> float:
        """Mean of the two fastest repeats (the fastest alone with one repeat).

        Interference only ever adds time, so the fastest repeats are the least disturbed
        ones, whatever the pressure counter said about them.
        """
        s = sorted(self.times)
        return (s[0] + s[1]) / 2 if len(s) > 1 else s[0]

    def median(self) -> float:
        return float(np.median(self.times))

    def spread(self) -> float:
        """Relative gap between the two fastest repeats (0 with one repeat)."""
        s = sorted(self.times)
        return (s[1] - s[0]) / s[0] if len(s) > 1 else 0.0

    def settled(self, tol: float) -> bool:
        """The two fastest repeats agree within ``tol`` and at least one of them was clean."""
        s = sorted(self.times)
        return len(s) > 1 and s[1] <= s[0] * (1 + tol) and (s[0] in self.clean or s[1] in self.clean)


class Bench:
    """Interleaved, repeated timing of many cases (see the module docstring).

    A repeat counts as *clean* when the kernel's CPU-pressure counter (``/proc/pressure/cpu``)
    grew by less than 2% of its duration: no other task was waiting for a core, so none
    took one from us. Without that counter every repeat counts as clean.

    A repeat of a short case is a *burst* of back-to-back calls (as many as fill
    ``burst_s``, at most ``max_burst``), timed together: the layers of an iteration run
    back to back too (calls rotate over the layers), and the mean of a burst is far less
    noisy than one sub-millisecond call.

    Args:
        min_rounds / max_rounds: repeats per case at least / at most (past ``budget_s``
            rounds stop early, but never below two repeats per case).
        tol: a case is settled once its two fastest repeats agree within this fraction (and
            one of them was clean).
        budget_s: no new repeat starts past this many seconds once every case has two.
        seed: shuffling seed. progress: a tqdm bar (None: none).
    """

    def __init__(self, min_rounds: int = 3, max_rounds: int = 6, tol: float = 0.03,
                 budget_s: float = math.inf, seed: int = 0, progress=None, burst_s: float = 0.008,
                 max_burst: int = 32):
        if min_rounds < 1 or max_rounds < min_rounds:
            raise ValueError("need 1 <= min_rounds <= max_rounds")
        self.burst_s, self.max_burst = burst_s, max(1, int(max_burst))
        self.min_rounds, self.max_rounds, self.tol = min_rounds, max_rounds, tol
        self.budget_s = budget_s
        self.rng = random.Random(seed)
        self.progress = progress
        self.psi = _psi_reader()
        self.repeats = 0
        self.clean_repeats = 0
        self.out_of_time = False
        self.rounds = 0  # rounds started
        self.seconds = 0.0  # time spent in run()

    def time_once(self, case: Case) -> float:
        pc, psi = time.perf_counter, self.psi
        run, k = case.run, max(1, case.burst)
        p0 = psi() if psi else 0
        t0 = pc()
        for _ in range(k):
            run()
        total = pc() - t0
        stall = (psi() - p0) * 1e-6 if psi else 0.0
        dt = total / k
        case.times.append(dt)
        self.repeats += 1
        if stall <= 0.02 * total + 2e-5:
            case.clean.append(dt)
            self.clean_repeats += 1
        return dt

    def run(self, cases: list[Case], warmup: bool = False) -> list[Case]:
        """Time ``cases`` (``warmup``: one untimed call each first). Cases without a burst
        size get one from an untimed call (which also warms them up)."""
        t0 = time.perf_counter()
        try:
            if warmup:
                for c in self._shuffled(cases):
                    c.run()
                    self._tick()
            for c in cases:
                if c.burst <= 0:
                    tc = time.perf_counter()
                    c.run()
                    dt = time.perf_counter() - tc
                    c.burst = max(1, min(self.max_burst, int(self.burst_s / max(dt, 1e-7))))
            for r in range(self.max_rounds):
                todo = cases if r < self.min_rounds else [c for c in cases if not c.settled(self.tol)]
                if not todo:
                    break
                self.rounds += 1
                for c in self._shuffled(todo):
                    # the budget never cuts a case below two repeats (the estimator needs two)
                    if r >= min(2, self.max_rounds) and time.perf_counter() - t0 > self.budget_s:
                        self.out_of_time = True
                        return cases
                    self.time_once(c)
                    self._tick()
            return cases
        finally:
            self.seconds += time.perf_counter() - t0

    @property
    def clean_fraction(self) -> float:
        return self.clean_repeats / self.repeats if self.repeats else 1.0

    def _shuffled(self, cases):
        out = list(cases)
        self.rng.shuffle(out)
        return out

    def _tick(self):
        if self.progress is not None:
            self.progress.update(1)


def planned_calls(n_cases: int, bench: Bench, warmup: bool = False) -> int:
    """Calls :meth:`Bench.run` makes at most (for a progress bar's total)."""
    return n_cases * (bench.max_rounds + (1 if warmup else 0))


def progress_bar(total: int, desc: str, enabled: bool | None):
    """A tqdm bar on stderr; ``enabled=None``: only when stderr is a terminal."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="call", leave=False, dynamic_ncols=True)
