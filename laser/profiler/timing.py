"""Robust timing on a shared machine: :class:`Case` (one thing to time) and :class:`Bench`.

Other processes come and go; with two threads one busy core can make a call 5x slower.
Every quantity is therefore measured by :class:`Bench`: a warm-up, then rounds in which
every case runs once, in a freshly shuffled order (repeats of one case are spread over
the whole run, not back to back), until the two fastest repeats of every case agree
within ``tol`` and one of them ran *clean* -- no task waited for a CPU meanwhile, per the
kernel's pressure counter ``/proc/pressure/cpu`` (at least ``min_rounds``, at most
``max_rounds``; past the time budget no new round starts, but every case gets at least
``min_repeats`` repeats -- two by default -- so a busy machine makes profiling slower rather
than wrong). A case's time
(:meth:`Case.estimate`) is the *median of its undisturbed repeats* (of the clean ones among
them, when at least three ran clean): the time a call
typically takes on this machine, which is what a scheduler planning real steps must
predict. The fastest repeats (:meth:`Case.best`) decide only when a case is settled: on a
VM the fastest call can be 15-20 % below the typical one with nothing else running
(SmolLM2 fp32, one AVX2 core: a 512-token prefill layer call 56 ms at best, 68 ms at the
median), and a profile of best times then plans every step that much too short.

The CPU-pressure counter sees a neighbour that takes a core, not one that takes memory
bandwidth (a neighbour streaming memory slows a bandwidth-bound decode layer by tens of
percent while no task ever waits for a CPU). So :class:`Bench` also re-times fixed
*reference* calls (``references``: e.g. one decode layer step at batch 8 and one
256-token prefill layer step) at the start and then interleaved with the cases, every
``ref_interval_s`` seconds and at the end of every round. A repeat whose surrounding
reference timings (the check before it and the check after it) drift more than
``ref_tol`` above the best time of that reference so far (or beyond the machine's own
jitter: ``Bench.effective_ref_tol``) is *disturbed*: it leaves
``Case.times`` for ``Case.disturbed`` and the case is measured again (in extra rounds
if needed, while the time budget lasts). Torch-free.
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
#: Clean repeats a case's estimate needs to use them alone (Case.estimate).
MIN_CLEAN = 3
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

    ``times`` are the undisturbed repeats (seconds per call); ``clean`` those of them
    during which no task waited for a CPU (nothing else competed with us), when the kernel
    reports CPU pressure; ``disturbed`` the repeats taken while the reference calls ran
    slower than their best (see :class:`Bench`), kept apart and used only when no
    undisturbed repeat is left.
    """

    key: object
    run: Callable[[], object]
    times: list[float] = field(default_factory=list)
    clean: list[float] = field(default_factory=list)
    # Calls per repeat (back to back; a repeat's time is their mean). 0 = not yet chosen:
    # :meth:`Bench.run` sizes it from one untimed call (see ``Bench.burst_s``).
    burst: int = 0
    disturbed: list[float] = field(default_factory=list)

    @property
    def repeats(self) -> int:
        """All repeats, disturbed ones included."""
        return len(self.times) + len(self.disturbed)

    def estimate(self) -> float:
        """The case's time (seconds per call): the median of its *clean* undisturbed repeats when
        at least :data:`MIN_CLEAN` ran clean, else of its undisturbed repeats (of the disturbed ones
        when there is no undisturbed one) -- the typical time on this machine once the repeats
        slowed by another process are set aside (see the module docstring). A repeat during which
        another task waited for a CPU shared the cores with it: with as many torch threads as
        vCPUs that costs the call a thread's share (issue 26 item 3, two threads on two busy vCPUs:
        the median 15 % above the two fastest repeats, two timings of a layer call agreeing 86 %),
        which an engine running alone on its cores never pays."""
        if len(self.clean) >= MIN_CLEAN:
            return float(np.median(self.clean))
        return self.median()

    def best(self) -> float:
        """Mean of the two fastest repeats (the fastest alone with one): the least disturbed
        time, a lower bound of what a call takes."""
        s = sorted(self.times or self.disturbed)
        return (s[0] + s[1]) / 2 if len(s) > 1 else s[0]

    def median(self) -> float:
        """Median of the undisturbed repeats (of the disturbed ones when none is left)."""
        return float(np.median(self.times or self.disturbed))

    def spread(self) -> float:
        """Relative gap between the two fastest repeats (0 with one repeat)."""
        s = sorted(self.times or self.disturbed)
        return (s[1] - s[0]) / s[0] if len(s) > 1 else 0.0

    def settled(self, tol: float) -> bool:
        """The two fastest repeats agree within ``tol`` and at least one of them was clean."""
        s = sorted(self.times)
        return len(s) > 1 and s[1] <= s[0] * (1 + tol) and (s[0] in self.clean or s[1] in self.clean)


class _Check:
    """One re-timing of the reference calls: seconds per call of each, and the repeats of
    cases timed since the previous check (the window it closes)."""

    __slots__ = ("ref_times", "window", "disturbed")

    def __init__(self, ref_times: list[float], window: list):
        self.ref_times, self.window, self.disturbed = ref_times, window, False


class Bench:
    """Interleaved, repeated timing of many cases (see the module docstring).

    A repeat counts as *clean* when the kernel's CPU-pressure counter (``/proc/pressure/cpu``)
    grew by less than 2% of its duration: no other task was waiting for a core, so none
    took one from us. Without that counter every repeat counts as clean.

    A repeat counts as *disturbed* when a reference call timed just before or just after
    it (see the module docstring) ran more than ``ref_tol`` slower than that reference's
    best time so far (or more than ``noise_factor`` times the median drift, on a machine
    whose timing jitters by itself: :meth:`effective_ref_tol`): the machine was slower then,
    whatever the pressure counter says (memory-bandwidth contention from a neighbour is
    invisible to it). Disturbed repeats are re-measured: a case is settled only on
    undisturbed repeats, and cases left with fewer than two undisturbed repeats get up to
    ``max_rounds`` extra rounds while the budget lasts. Every window is re-judged at every
    check against the newest best times and tolerance.

    A repeat of a short case is a *burst* of back-to-back calls (as many as fill
    ``burst_s``, at most ``max_burst``), timed together: the layers of an iteration run
    back to back too (calls rotate over the layers), and the mean of a burst is far less
    noisy than one sub-millisecond call.

    Args:
        min_rounds / max_rounds: repeats per case at least / at most (past ``budget_s``
            rounds stop early, but never below ``min_repeats`` repeats per case).
        min_repeats: repeats every case gets whatever the budget (at most ``max_rounds``;
            default 2, the fewest the estimator needs). One call on a VM jitters by ~10 %
            (SmolLM2 bf16, one AVX512 core: a decode layer call of 33 ms at the median
            ranged 25-55 ms over 20 repeats), so the median of 2 repeats -- their mean --
            is off by 3-7 %; the median of 5 by 1.5-4.7 % (``laser profile --evaluate``
            asks for 5: the held-out figures are only as good as the times they are
            scored against).
        tol: a case is settled once its two fastest repeats agree within this fraction (and
            one of them was clean).
        budget_s: no new repeat starts past this many seconds once every case has ``min_repeats``.
        seed: shuffling seed. progress: a tqdm bar (None: none).
        ref_tol: drift of a reference call over its best time beyond which the repeats
            around it are disturbed (fraction). ref_interval_s: seconds of case timing
            between two re-timings of the references. ref_initial: re-timings at the
            start (the first best times). ref_repeats: bursts of each reference per
            re-timing, the fastest counts (a single preemption does not flag a window;
            sustained contention slows them all). ref_burst_s: length of a reference burst
            (at most 8 x ``max_burst`` calls; longer than a case's: less noise).
        noise_factor: a check is slow only beyond this many times the median drift of all
            checks, when that exceeds ``ref_tol`` (the machine's own jitter).
        clock: seconds counter (``time.perf_counter``; tests inject a fake one).
        psi: cumulative CPU-stall microseconds counter; ``"auto"``: ``/proc/pressure/cpu``
            when readable; None: none (every repeat clean).
    """

    def __init__(self, min_rounds: int = 3, max_rounds: int = 6, tol: float = 0.03,
                 budget_s: float = math.inf, seed: int = 0, progress=None, burst_s: float = 0.008,
                 max_burst: int = 32, *, min_repeats: int = 2, ref_tol: float = 0.05, ref_interval_s: float = 0.5,
                 ref_initial: int = 3, ref_repeats: int = 2, ref_burst_s: float = 0.01, noise_factor: float = 2.0,
                 clock: Callable[[], float] = time.perf_counter, psi="auto"):
        if min_rounds < 1 or max_rounds < min_rounds:
            raise ValueError("need 1 <= min_rounds <= max_rounds")
        if min_repeats < 1:
            raise ValueError("need min_repeats >= 1")
        if not ref_tol > 0 or not ref_interval_s > 0 or ref_initial < 1:
            raise ValueError("need ref_tol > 0, ref_interval_s > 0 and ref_initial >= 1")
        self.burst_s, self.max_burst = burst_s, max(1, int(max_burst))
        self.min_rounds, self.max_rounds, self.tol = min_rounds, max_rounds, tol
        self.min_repeats = min(int(min_repeats), max_rounds)
        self.budget_s = budget_s
        self.rng = random.Random(seed)
        self.progress = progress
        self.clock = clock
        self.psi = _psi_reader() if psi == "auto" else psi
        self.ref_tol, self.ref_interval_s, self.ref_initial = ref_tol, ref_interval_s, ref_initial
        self.ref_repeats, self.ref_burst_s = max(1, int(ref_repeats)), ref_burst_s
        self.noise_factor = noise_factor
        self.references: list[Case] = []
        self.checks: list[_Check] = []
        self._window: list = []  # (case, seconds) timed since the last check
        self._last_check = 0.0
        self.repeats = 0
        self.clean_repeats = 0
        self.disturbed_repeats = 0
        self.out_of_time = False
        self.rounds = 0  # rounds started
        self.seconds = 0.0  # time spent in run()

    def _timed(self, case: Case) -> tuple[float, bool]:
        """One repeat of ``case`` (a burst): seconds per call, and whether it ran clean."""
        pc, psi = self.clock, self.psi
        run, k = case.run, max(1, case.burst)
        p0 = psi() if psi else 0
        t0 = pc()
        for _ in range(k):
            run()
        total = pc() - t0
        stall = (psi() - p0) * 1e-6 if psi else 0.0
        return total / k, stall <= 0.02 * total + 2e-5

    def time_once(self, case: Case) -> float:
        dt, clean = self._timed(case)
        case.times.append(dt)
        self.repeats += 1
        if clean:
            case.clean.append(dt)
            self.clean_repeats += 1
        self._window.append((case, dt, clean))
        return dt

    # -- reference re-timing ----------------------------------------------------------------
    def _size_burst(self, c: Case, burst_s: float | None = None, max_burst: int | None = None,
                    calls: int = 1) -> None:
        """Size ``c``'s burst from the fastest of ``calls`` untimed calls (the first may be cold)."""
        if c.burst <= 0:
            dt = math.inf
            for _ in range(calls):
                tc = self.clock()
                c.run()
                dt = min(dt, self.clock() - tc)
            c.burst = max(1, min(max_burst or self.max_burst, int((burst_s or self.burst_s) / max(dt, 1e-7))))

    def check(self) -> None:
        """Re-time every reference once, close the current window of repeats, and (re)judge
        every window against the best reference times so far. No-op without references."""
        if not self.references:
            return
        times = []
        for r in self.references:
            dt = min(self._timed(r)[0] for _ in range(self.ref_repeats))
            r.times.append(dt)
            times.append(dt)
        self.checks.append(_Check(times, self._window))
        self._window = []
        self._last_check = self.clock()
        self._judge()

    def _drifts(self) -> list[float]:
        """Per check, the largest drift of its reference re-timings over each reference's best."""
        best = [min(r.times) for r in self.references]
        return [max(t / b for t, b in zip(c.ref_times, best)) - 1.0 for c in self.checks]

    def effective_ref_tol(self, drifts: list[float] | None = None) -> float:
        """The drift beyond which a check counts as slow: ``ref_tol``, or ``noise_factor``
        times the median drift of all checks when that is larger. A machine whose own timing
        jitters (a VM: re-timings of a reference on a quiet host spread 10-15 % over their
        best, ~7 % at the median) would otherwise mark nearly every repeat disturbed, and the
        profile would lose the samples it drops; a neighbour that slows the machine for a
        minority of the run still lifts its checks far above the median. ``drifts``: those of
        :meth:`_drifts`, when the caller has them."""
        if drifts is None:
            drifts = self._drifts()
        if not drifts:
            return self.ref_tol
        return max(self.ref_tol, self.noise_factor * float(np.median(drifts)))

    def _judge(self) -> None:
        """(Re)judge every window against the best reference times and the effective
        tolerance so far: a window between two checks is disturbed when either is slow.
        The best times only fall and the tolerance follows the noise seen, so a window can
        change sides; its repeats move between ``Case.times`` and ``Case.disturbed``."""
        drifts = self._drifts()
        tol = self.effective_ref_tol(drifts)
        slow = [d > tol for d in drifts]
        for k, c in enumerate(self.checks):
            now = slow[k] or (k > 0 and slow[k - 1])
            if now == c.disturbed:
                continue
            c.disturbed = now
            for case, dt, clean in c.window:
                if now:
                    case.times.remove(dt)
                    case.disturbed.append(dt)
                    if clean:
                        case.clean.remove(dt)
                        self.clean_repeats -= 1
                    self.disturbed_repeats += 1
                else:
                    case.disturbed.remove(dt)
                    case.times.append(dt)
                    if clean:
                        case.clean.append(dt)
                        self.clean_repeats += 1
                    self.disturbed_repeats -= 1

    def reference_drift(self) -> float:
        """Largest drift of a reference re-timing over that reference's best (fraction; 0
        without references)."""
        if not self.references or not self.checks:
            return 0.0
        best = [min(r.times) for r in self.references]
        return max(max(t / b for t, b in zip(c.ref_times, best)) for c in self.checks) - 1.0

    # -- the rounds -------------------------------------------------------------------------
    def run(self, cases: list[Case], warmup: bool = False, references: list[Case] | None = None) -> list[Case]:
        """Time ``cases`` (``warmup``: one untimed call each first). Cases without a burst
        size get one from an untimed call (which also warms them up). ``references``: the
        reference calls re-timed between the cases (see the class docstring); once given
        they are kept for later runs of this bench."""
        t0 = self.clock()
        try:
            if warmup:
                for c in self._shuffled(cases):
                    c.run()
                    self._tick()
            if references:
                self.references = list(references)
                for r in self.references:
                    self._size_burst(r, self.ref_burst_s, 8 * self.max_burst, calls=3)
                for _ in range(self.ref_initial):
                    self.check()
            for c in cases:
                self._size_burst(c)
            need = self.min_repeats
            for r in range(2 * self.max_rounds):
                if r < max(self.min_rounds, need):
                    todo = cases
                elif r < self.max_rounds:
                    todo = [c for c in cases if not c.settled(self.tol)]
                else:  # extra rounds: re-measure cases that disturbance left short
                    todo = [c for c in cases if len(c.times) < need and c.disturbed]
                if not todo:
                    break
                self.rounds += 1
                timed = 0
                for c in self._shuffled(todo):
                    # the budget never cuts a case below min_repeats (the estimator needs two)
                    if self.clock() - t0 > self.budget_s and c.repeats >= need:
                        self.out_of_time = True
                        continue
                    self.time_once(c)
                    timed += 1
                    self._tick()
                    if self.references and self.clock() - self._last_check >= self.ref_interval_s:
                        self.check()
                if self._window:
                    self.check()
                if self.out_of_time and not timed:
                    break
            return cases
        finally:
            if self._window:
                self.check()
            self.seconds += self.clock() - t0

    @property
    def clean_fraction(self) -> float:
        """Repeats that ran clean and undisturbed, of all repeats."""
        return self.clean_repeats / self.repeats if self.repeats else 1.0

    @property
    def disturbed_fraction(self) -> float:
        """Repeats judged disturbed by the reference re-timing, of all repeats."""
        return self.disturbed_repeats / self.repeats if self.repeats else 0.0

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
