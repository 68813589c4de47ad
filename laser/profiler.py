"""Latency profiler: time the real executor's pieces, fit the latency model, keep profile files.

What is timed is what the engine runs (``LlamaModel`` and ``ModelRunner``), on the
engine's own weights, KV pool and block manager:

* **stateless** ``n``: one layer's op sequence of :meth:`LlamaModel.forward_layer`
  without the attention core (RMSNorms, QKV projection, QK-norm, RoPE, O projection,
  SwiGLU MLP, residual adds), replicated op by op with the model's weights and helpers;
* **attention** ``(q, c)``: the KV-cache write plus :meth:`LlamaModel._attention`, on
  :class:`AttnMetadata` built by :meth:`ModelRunner._build_metadata` for fake works whose
  blocks are allocated in the block manager (and freed again);
* **layer**: whole ``forward_layer`` calls, whose residual over stateless + attention is
  fitted as a per-layer-call overhead plus a scale on attention (it absorbs anything the
  replica misses, and the cache interference between the two parts);
* **embed** / **head**: what ``ModelRunner._join`` and ``_finish`` run (token-id tensor +
  embedding lookup; row gather + final norm + LM head + sampling).

Calls rotate over the layers (as in a real pass, weights are not cache-hot).

Measurement on a shared machine
-------------------------------
Other processes come and go; with two threads one busy core can make a call 5x slower.
Every quantity is therefore measured by :class:`Bench`: a warm-up, then rounds in which
every case runs once, in a freshly shuffled order (repeats of one case are spread over
the whole run, not back to back), until the two fastest repeats of every case agree
within ``tol`` and one of them ran *clean* -- no task waited for a CPU meanwhile, per the
kernel's pressure counter ``/proc/pressure/cpu`` (at least ``min_rounds``, at most
``max_rounds``; past the time budget no new round starts, but every case gets at least
two repeats, so a busy machine makes profiling slower rather than wrong). A case's time is the mean of its two fastest
repeats: interference only adds time, so this estimates the *undisturbed* time. The
accuracy report measures its ground truth the same way, in the same interleaved rounds
as the profile (:func:`profile_and_evaluate`), and also records medians and the spread
of the two fastest repeats, to show how noisy the machine was.

``load_or_create`` keeps one profile file per (model, dtype, hardware, threads).
``evaluate`` is the accuracy report of ``laser profile --evaluate``.
"""

from __future__ import annotations

import logging
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from .config import SchedulerConfig
from .intermediate_cache import IntermediateCache
from .latency import (
    AttentionSample,
    EmbedSample,
    FittedLatencyModel,
    HeadSample,
    LatencyModel,
    LatencyProfileError,
    LayerSample,
    StatelessSample,
    cpu_hardware_string,
    default_profile_path,
    fit,
)
from .model.llama import _rope
from .model_runner import ModelRunner
from .plan import StepPlan, Work
from .request import SLO, Request, SamplingParams
from .sampler import Sampler

log = logging.getLogger(__name__)

# Bump when what is measured, or how, changes: older profile files are then re-made.
PROFILER_VERSION = 2
_REQ_PREFIX = "__profile"
GREEDY = SamplingParams(temperature=0.0)
# Candidate segment widths for the stateless / LM-head fits. On CPUs a single row runs a
# matrix-vector kernel (one decode token: ~25% cheaper than two), so widths down to 1
# are offered; cross-validation picks one.
PROFILE_WIDTHS = (1, 2, 4, 8, 16, 32, 64, 128)


# --------------------------------------------------------------------------------------
# Robust timing


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


def _bar(total: int, desc: str, enabled: bool | None):
    """A tqdm bar on stderr; ``enabled=None``: only when stderr is a terminal."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="call", leave=False, dynamic_ncols=True)


# --------------------------------------------------------------------------------------
# The sample grid


def fit_to_pool(query_lens, context_lens, pool_tokens: int, block_size: int = 16):
    """The batch, shrunk (contexts proportionally, then query lengths) so that its KV blocks
    fit in one layer's pool of ``pool_tokens`` slots; unchanged when it fits."""
    q, c = [int(x) for x in query_lens], [int(x) for x in context_lens]
    cap = max(1, pool_tokens // block_size)  # blocks per layer
    if len(c) > cap:
        q, c = q[:cap], c[:cap]

    def blocks():
        return sum(-(-ci // block_size) for ci in c)

    while blocks() > cap:
        f = 0.98 * (cap - len(c)) * block_size / max(1, sum(c))
        c = [max(1, int(ci * f)) for ci in c]
        q = [max(1, min(qi, ci)) for qi, ci in zip(q, c)]
    return tuple(q), tuple(c)


@dataclass
class ProfileGrid:
    """What the profiler samples. Batches are ``(query_lens, context_lens)`` tuples."""

    stateless_tokens: list[int]
    attention_batches: list[tuple[tuple[int, ...], tuple[int, ...]]]
    layer_batches: list[tuple[tuple[int, ...], tuple[int, ...]]]
    embed_tokens: list[int]
    head_rows: list[int]
    min_rounds: int = 3
    max_rounds: int = 10
    tol: float = 0.03
    warmup_s: float = 1.0  # spin-up before timing

    @classmethod
    def default(cls, max_tokens: int = 2048, max_context: int = 4096, pool_tokens: int = 1 << 30,
                max_batch: int = 64, block_size: int = 16, seed: int = 0) -> "ProfileGrid":
        """A grid that takes well under a minute for SmolLM2-size models on two CPU cores.

        ``max_tokens``: largest chunk; ``max_context``: longest sequence; ``pool_tokens``:
        KV slots per layer (Σc of a batch stays within it); ``max_batch``: decode batch.
        """
        rng = np.random.default_rng(seed)
        # Stateless: dense for small n (decode batches), log-spaced up to max_tokens, plus
        # a few random counts so tile effects are seen off the round numbers.
        base = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256,
                320, 384, 512, 640, 768, 1024, 1280, 1536, 2048]
        st = {n for n in base if n <= max_tokens}
        # (many points: the fit's cross-validation needs them to resolve kernel steps)
        st |= {int(x) for x in rng.integers(2, max(3, min(max_tokens, 64)), 8)}
        st |= {int(x) for x in rng.integers(64, max(65, min(max_tokens, 640)), 16)}
        st |= {int(x) for x in rng.integers(640, max(641, max_tokens), 4)}
        st.add(max_tokens)
        ctx_cap = max(1, min(max_context, pool_tokens))

        def clip_batch(q, c):
            return fit_to_pool(q, c, pool_tokens, block_size)

        def decode(b, mean_ctx):
            c = rng.integers(max(2, mean_ctx // 4), max(3, mean_ctx * 7 // 4), b)
            return clip_batch([1] * b, [min(int(x), ctx_cap) for x in c])

        attn = []
        for b in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128):
            if b > max_batch:
                continue
            for mc in (64, 512, 2048):
                attn.append(decode(b, min(mc, ctx_cap)))
        for b in (3, 8, 16, 32, 48, 64):  # skewed: a few long contexts among short ones
            if b > max_batch:
                continue
            nlong = 1 + b // 16
            long = rng.integers(max(2, ctx_cap // 2), ctx_cap + 1, nlong)
            short = rng.integers(2, max(3, min(512, ctx_cap)), b - nlong)
            attn.append(clip_batch([1] * b, [int(x) for x in (*long, *short)]))
        for q in (16, 32, 64, 128, 256, 512, 1024, 2048):
            q = min(q, max_tokens)
            for cached in (0, q // 2, 2 * q):
                c = min(q + cached, ctx_cap)
                attn.append(clip_batch([min(q, c)], [c]))
        for _ in range(10):  # several prefill chunks in one batch
            k = int(rng.integers(2, 5))
            q = [int(x) for x in rng.integers(16, max(17, max_tokens // k), k)]
            c = [min(qi + int(rng.integers(0, 2 * qi)), ctx_cap) for qi in q]
            attn.append(clip_batch([min(a, b) for a, b in zip(q, c)], c))
        for _ in range(14):  # mixed: decode batch + prefill chunk(s)
            b = int(rng.integers(1, max_batch + 1))
            dq, dc = decode(b, int(rng.choice([128, 512, 1024])))
            k = int(rng.integers(1, 3))
            q = [int(x) for x in rng.integers(16, max(17, max_tokens // 2), k)]
            c = [min(qi + int(rng.integers(0, qi)), ctx_cap) for qi in q]
            attn.append(clip_batch(list(dq) + [min(a, b) for a, b in zip(q, c)], list(dc) + c))
        attn = list(dict.fromkeys(attn))
        # Whole layers fit what composing the modules adds: a fixed per-call overhead and
        # a scale on attention (a layer whose attention streams the KV cache through the
        # CPU caches pays for it again in its projections). Small and medium batches (the
        # decode iterations) and attention-heavy ones (long contexts, mixed steps).
        layer = []
        for b in (1, 2, 4, 8, 16, 32):
            if b <= max_batch:
                layer.append(decode(b, min(128, ctx_cap)))
                layer.append(decode(b, min(384, ctx_cap)))
        for b, mc in ((8, 1024), (16, 2048), (48, 2048), (64, 1024)):
            if b <= max_batch:
                layer.append(decode(b, min(mc, ctx_cap)))
        for q in (16, 64, 256):
            q = min(q, max_tokens)
            layer.append(clip_batch([q], [min(q, ctx_cap)]))
        q = min(1024, max_tokens)
        layer.append(clip_batch([q], [min(q + q // 2, ctx_cap)]))
        for b, q, mc in ((4, 32, 256), (8, 128, 256), (16, 64, 256), (32, 256, 1024), (48, 64, 512)):
            if b <= max_batch:
                dq, dc = decode(b, min(mc, ctx_cap))
                layer.append(clip_batch(list(dq) + [min(q, max_tokens)], list(dc) + [min(q + 64, ctx_cap)]))
        layer = list(dict.fromkeys(layer))
        head = [r for r in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128) if r <= max(max_batch, 1) * 2]
        embed = sorted({n for n in (1, 8, 64, 256, 1024, max_tokens) if n <= max_tokens})
        return cls(sorted(st), attn, layer, embed, head)

    @classmethod
    def tiny(cls, seed: int = 0, rounds: tuple[int, int] = (2, 3)) -> "ProfileGrid":
        """A small grid (seconds on a small model): for tests and ``laser profile --quick``."""
        rng = np.random.default_rng(seed)
        st = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
        attn = []
        for b in (1, 4, 16):
            for mc in (32, 256):
                c = tuple(int(x) for x in rng.integers(2, 2 * mc, b))
                attn.append(((1,) * b, c))
        for q in (16, 64, 256):
            for cached in (0, q):
                attn.append(((q,), (q + cached,)))
        attn.append(((1, 1, 32), (40, 90, 64)))
        attn.append(((1, 24, 48), (100, 24, 96)))
        return cls(st, attn, attn[::3], [1, 16, 128], [1, 4, 16], min_rounds=rounds[0], max_rounds=rounds[1],
                   tol=0.05, warmup_s=0.2)

    def num_cases(self) -> int:
        return (len(self.stateless_tokens) + len(self.attention_batches) + len(self.layer_batches)
                + len(self.embed_tokens) + len(self.head_rows))


# --------------------------------------------------------------------------------------
# Calls that replicate what the executor runs


class Probe:
    """Builds timed calls on a :class:`ModelRunner` (see the module docstring)."""

    def __init__(self, runner: ModelRunner, seed: int = 0):
        self.runner = runner
        self.model = runner.model
        self.cfg = runner.model.config
        self.bm = runner.bm
        self.num_layers = runner.num_layers
        self.sampler = Sampler(seed)  # own generator: the engine's stream is left alone
        self.gen = torch.Generator().manual_seed(seed)
        self._layer = 0
        self._uid = 0

    def next_layer(self) -> int:
        """Layers rotate across calls, as in a pass through the model."""
        self._layer = (self._layer + 1) % self.num_layers
        return self._layer

    def randn(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(self.model.dtype)

    # -- metadata on fake works ------------------------------------------------------------
    def metadata(self, query_lens: Sequence[int], context_lens: Sequence[int]):
        """``AttnMetadata`` for the batch, from blocks really allocated (then freed).

        Rows follow the runner's order (decode works first). The metadata only holds
        slot indices; freeing the blocks leaves them valid to index the KV pool.
        """
        works, ids = [], []
        try:
            for q, c in zip(query_lens, context_lens):
                self._uid += 1
                rid = f"{_REQ_PREFIX}-{self._uid}"
                self.bm.allocate(rid, c, range(0, 1))
                ids.append(rid)
                works.append(Work(rid, c - q, q, 0, self.num_layers))
            works.sort(key=lambda w: (w.num_tokens > 1, w.context_len if w.num_tokens == 1 else 0))  # as ModelRunner._join
            return self.runner._build_metadata(works, range(0, self.num_layers))
        finally:
            for rid in ids:
                self.bm.free(rid)

    # -- the pieces -------------------------------------------------------------------------
    def stateless_call(self, n: int) -> Callable[[], object]:
        """One layer's forward_layer ops minus the attention core (cache write + kernel):
        :meth:`LlamaModel.qkv` then :meth:`LlamaModel.finish_layer`, q standing in for the
        attention output (same shape)."""
        m, c = self.model, self.cfg
        hidden = self.randn(n, c.hidden_size)
        cos, sin = m.rope_cos[:n].contiguous(), m.rope_sin[:n].contiguous()

        def run():
            i = self.next_layer()
            q, _, _ = m.qkv(i, hidden, cos, sin)
            return m.finish_layer(i, hidden, q)

        return run

    def attention_call(self, query_lens, context_lens) -> Callable[[], object]:
        """KV-cache write of the new tokens + the attention kernel: :meth:`LlamaModel.attend`."""
        m, c = self.model, self.cfg
        meta = self.metadata(query_lens, context_lens)
        T = sum(query_lens)
        qkv = self.randn(T, c.q_size + 2 * c.kv_size)
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = _rope(q.view(T, c.num_heads, c.head_dim), meta.cos, meta.sin)
        k = _rope(k.reshape(T, c.num_kv_heads, c.head_dim), meta.cos, meta.sin)
        v = v.view(T, c.num_kv_heads, c.head_dim)
        return lambda: m.attend(self.next_layer(), q, k, v, meta)

    def layer_call(self, query_lens, context_lens) -> Callable[[], object]:
        """A whole ``forward_layer`` call."""
        meta = self.metadata(query_lens, context_lens)
        hidden = self.randn(sum(query_lens), self.cfg.hidden_size)
        m = self.model
        return lambda: m.forward_layer(self.next_layer(), hidden, meta)

    def embed_call(self, n: int) -> Callable[[], object]:
        """Token ids (a Python list, as the runner collects them) -> tensor -> embedding."""
        ids = [int(x) for x in torch.randint(0, self.cfg.vocab_size, (n,), generator=self.gen)]
        m = self.model
        return lambda: m.embed(torch.tensor(ids, dtype=torch.long))

    def head_call(self, rows: int, sampling: SamplingParams | None = None) -> Callable[[], object]:
        """Gather the last rows, final norm + LM head, sampling (``ModelRunner._finish``).

        Greedy by default (as the benchmarks run): a row sampled at temperature > 0 costs
        more (softmax + multinomial over the vocabulary, ~1.4 ms per row for SmolLM2 on
        two CPU cores), which a per-row-count head model cannot tell apart.
        """
        sp = sampling or GREEDY
        reqs = [Request([1], sp, req_id=f"{_REQ_PREFIX}-head-{k}") for k in range(rows)]
        hidden = self.randn(rows * 2, self.cfg.hidden_size)
        idx = [2 * k + 1 for k in range(rows)]
        m, sampler = self.model, self.sampler

        def run():
            logits = m.compute_logits(hidden[torch.tensor(idx)])
            return sampler.sample(logits, reqs)

        return run


# --------------------------------------------------------------------------------------
# Profiling


def _runner_of(obj) -> ModelRunner:
    runner = getattr(obj, "runner", obj)
    if not isinstance(runner, ModelRunner):
        raise TypeError(f"expected an Engine or a ModelRunner, got {type(obj).__name__}")
    return runner


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def shape_signature(cfg) -> str:
    """The model shape (what latency depends on), e.g. ``llama-h576-i1536-L30-q9-kv3-d64-v49152``."""
    bias = "-bias" if cfg.qkv_bias else ""
    qkn = "-qknorm" if cfg.qk_norm else ""
    return (f"{cfg.model_type}-h{cfg.hidden_size}-i{cfg.intermediate_size}-L{cfg.num_layers}-q{cfg.num_heads}"
            f"-kv{cfg.num_kv_heads}-d{cfg.head_dim}-v{cfg.vocab_size}{bias}{qkn}")


def model_name_of(obj) -> str:
    """A readable model name: the engine's (file/dir name of a path), else the checkpoint's
    directory name, else the shape."""
    name = getattr(obj, "model_name", None)
    if not name:
        hf = getattr(_runner_of(obj).model.config, "hf_config", None)
        name = getattr(hf, "_name_or_path", None) or getattr(hf, "name_or_path", None)
    if name:
        name = str(name)
        base = os.path.basename(os.path.normpath(name)) if ("/" in name or os.sep in name) else name
        return base.removesuffix(".gguf") or name
    return shape_signature(_runner_of(obj).model.config)


def profile_metadata(obj, threads: int | None = None) -> dict:
    """What a profile is keyed by and checked against when loaded.

    ``model_id`` (the file key) is the model *shape*: latency depends on it, not on the
    weights, so an Engine and its bare ModelRunner find the same file.
    """
    runner = _runner_of(obj)
    shape = shape_signature(runner.model.config)
    return {
        "model_id": shape,
        "model_name": model_name_of(obj),
        "shape": shape,
        "dtype": dtype_name(runner.model.dtype),
        "hardware": cpu_hardware_string(),
        "threads": int(threads or torch.get_num_threads()),
        "profiler_version": PROFILER_VERSION,
    }


def pool_tokens(runner: ModelRunner) -> int:
    return runner.bm.num_blocks * runner.bm.block_size


def default_grid(runner: ModelRunner) -> ProfileGrid:
    cfg = runner.model.config
    pool = pool_tokens(runner)
    return ProfileGrid.default(max_tokens=min(2048, cfg.max_position, pool),
                               max_context=min(4096, cfg.max_position), pool_tokens=pool,
                               block_size=runner.bm.block_size)


def _profile_cases(probe: Probe, grid: ProfileGrid) -> list[Case]:
    pool, bs = pool_tokens(probe.runner), probe.bm.block_size
    cases: list[Case] = []
    for n in grid.stateless_tokens:
        cases.append(Case(("stateless", n), probe.stateless_call(n)))
    for q, c in dict.fromkeys(fit_to_pool(q, c, pool, bs) for q, c in grid.attention_batches):
        cases.append(Case(("attention", q, c), probe.attention_call(q, c)))
    for q, c in dict.fromkeys(fit_to_pool(q, c, pool, bs) for q, c in grid.layer_batches):
        cases.append(Case(("layer", q, c), probe.layer_call(q, c)))
    for n in grid.embed_tokens:
        cases.append(Case(("embed", n), probe.embed_call(n)))
    for r in grid.head_rows:
        cases.append(Case(("head", r), probe.head_call(r)))
    return cases


def _run_bench(cases: list[Case], bench: Bench, probe: Probe, warmup_s: float, desc: str, progress) -> None:
    _global_warmup(probe, warmup_s)
    bar = _bar(planned_calls(len(cases), bench), desc, progress)
    bench.progress = bar
    try:
        bench.run(cases)
    finally:
        if bar is not None:
            bar.close()


def _samples(cases: list[Case], tol: float, bench: Bench, stats: dict | None, warn: bool = True) -> list:
    """Profile samples from measured profile cases; ``stats`` receives how clean they were."""
    unsettled = [k for k, c in enumerate(cases) if not c.settled(tol)]
    clean = sum(len(c.clean) for c in cases) / max(1, sum(len(c.times) for c in cases))
    info = {"repeats": sum(len(c.times) for c in cases), "clean_fraction": round(clean, 3),
            "unsettled_cases": len(unsettled), "cases": len(cases), "out_of_time": bench.out_of_time,
            "unsettled_index": unsettled}
    if stats is not None:
        stats.update(info)
    if warn and (clean < 0.8 or len(unsettled) > len(cases) // 3):
        log.warning("the CPU was busy with other work while profiling (%.0f%% of timed calls ran with no other "
                    "task waiting for a CPU; %d of %d samples without two repeats within %.0f%%%s): the profile may "
                    "be off; re-run `laser profile` on a quiet machine", 100 * clean, len(unsettled), len(cases),
                    100 * tol, f"; the {bench.budget_s:g} s time budget ran out after {bench.rounds} rounds"
                    if bench.out_of_time else "")
    out = []
    for cs in cases:
        kind, *args = cs.key
        t = cs.estimate()
        if kind == "stateless":
            out.append(StatelessSample(args[0], t))
        elif kind == "attention":
            out.append(AttentionSample(args[0], args[1], t))
        elif kind == "layer":
            out.append(LayerSample(args[0], args[1], t))
        elif kind == "embed":
            out.append(EmbedSample(args[0], t))
        else:
            out.append(HeadSample(args[0], t))
    return out


def collect_samples(runner: ModelRunner, grid: ProfileGrid | None = None, *, progress: bool | None = None,
                    budget_s: float = 40.0, seed: int = 0, stats: dict | None = None, warn: bool = True) -> list:
    """Time every grid point on ``runner`` (see the module docstring). Returns profile samples;
    ``stats`` (when given) receives how clean the measurements were."""
    runner = _runner_of(runner)
    grid = grid or default_grid(runner)
    probe = Probe(runner, seed)
    with torch.inference_mode():
        cases = _profile_cases(probe, grid)
        bench = Bench(grid.min_rounds, grid.max_rounds, grid.tol, budget_s=budget_s, seed=seed)
        _run_bench(cases, bench, probe, grid.warmup_s, "profiling", progress)
    runner.bm.check_integrity()
    return _samples(cases, grid.tol, bench, stats, warn=warn and grid.max_rounds > 1)


def _sample_prediction(model: FittedLatencyModel, s) -> float:
    if isinstance(s, StatelessSample):
        return model.stateless_time(s.n_tokens)
    if isinstance(s, AttentionSample):
        return model.attention_time(s.query_lens, s.context_lens)
    if isinstance(s, LayerSample):
        return model.layer_time(s.query_lens, s.context_lens)
    if isinstance(s, EmbedSample):
        return model.embed_time(s.n_tokens)
    return model.head_time(s.n_rows)


def robust_fit(samples: list, unsettled: set[int], num_layers: int, metadata: dict,
               ) -> tuple[FittedLatencyModel, int]:
    """Fit, then drop *unsettled* samples (no two clean repeats agreed) that the fit puts far
    below their measurement -- the signature of a call slowed by another process -- and
    refit. Returns the model and how many samples were dropped."""
    model = fit(samples, num_layers=num_layers, metadata=metadata, widths=PROFILE_WIDTHS)
    if not unsettled:
        return model, 0
    resid = [_sample_prediction(model, s) / s.seconds - 1.0 for s in samples]
    typical: dict[type, float] = {}
    for t in {type(s) for s in samples}:
        typical[t] = float(np.median([abs(r) for s, r in zip(samples, resid) if type(s) is t]))
    drop = {k for k, (s, r) in enumerate(zip(samples, resid))
            if k in unsettled and r < -max(0.15, 4 * typical[type(s)])}
    for t in typical:  # never drop every sample of a kind
        if all(k in drop for k, s in enumerate(samples) if type(s) is t):
            drop -= {k for k, s in enumerate(samples) if type(s) is t}
    if not drop:
        return model, 0
    kept = [s for k, s in enumerate(samples) if k not in drop]
    return fit(kept, num_layers=num_layers, metadata=metadata, widths=PROFILE_WIDTHS), len(drop)


def _global_warmup(probe: Probe, seconds: float = 1.0) -> None:
    """Spin the CPU up and touch every layer's weights once before timing."""
    t0 = time.perf_counter()
    runs = [probe.stateless_call(64), probe.stateless_call(1)]
    while time.perf_counter() - t0 < seconds:
        for r in runs:
            for _ in range(probe.num_layers):
                r()


def _fit_profile(obj, samples: list, stats: dict, seconds: float, threads: int | None = None) -> FittedLatencyModel:
    runner = _runner_of(obj)
    meta = profile_metadata(obj, threads)
    meta["profile_seconds"] = round(seconds, 2)
    meta["pool_tokens"] = pool_tokens(runner)
    model, dropped = robust_fit(samples, set(stats.pop("unsettled_index", ())), runner.num_layers, meta)
    stats["dropped_outliers"] = dropped
    model.metadata["measurement"] = stats
    return model


def profile(obj, path: str | os.PathLike | None = None, *, grid: ProfileGrid | None = None,
            progress: bool | None = None, budget_s: float = 40.0, seed: int = 0,
            threads: int | None = None) -> FittedLatencyModel:
    """Profile ``obj`` (an Engine or a ModelRunner), fit, and save to ``path`` when given."""
    t0 = time.perf_counter()
    stats: dict = {}
    samples = collect_samples(_runner_of(obj), grid, progress=progress, budget_s=budget_s, seed=seed, stats=stats)
    model = _fit_profile(obj, samples, stats, time.perf_counter() - t0, threads)
    if path is not None:
        model.save(path)
    return model


def default_path(obj, threads: int | None = None) -> Path:
    m = profile_metadata(obj, threads)
    return default_profile_path(m["model_id"], m["dtype"], m["hardware"], m["threads"])


def load_or_create(engine_or_model_runner, path: str | os.PathLike | None = None, create: bool = True, *,
                   progress: bool | None = None, grid: ProfileGrid | None = None,
                   budget_s: float = 40.0) -> FittedLatencyModel:
    """The fitted latency model of this engine's setup: loaded from ``path`` (default:
    :func:`default_profile_path` of model, dtype, hardware and threads) when present and
    made for the same setup; otherwise profiled now and saved there.

    A missing, unreadable, corrupt or mismatching file is logged (why, and that a new
    profile is being made) and replaced; it never raises for that, unless
    ``create=False``, which raises :class:`LatencyProfileError` instead of profiling.
    A profile that cannot be saved is logged and still returned.
    """
    obj = engine_or_model_runner
    runner = _runner_of(obj)
    meta = profile_metadata(obj)
    path = Path(path) if path is not None else default_profile_path(
        meta["model_id"], meta["dtype"], meta["hardware"], meta["threads"])
    expect = {k: meta[k] for k in ("shape", "dtype", "hardware", "threads", "profiler_version")}
    expect["num_layers"] = runner.num_layers
    try:
        model = FittedLatencyModel.load(path, **expect)
        log.info("latency profile loaded from %s", path)
        return model
    except LatencyProfileError as e:
        if not create:
            raise
        log.warning("%s -- profiling now (takes up to a minute)", e)
    model = profile(obj, None, grid=grid, progress=progress, budget_s=budget_s)
    try:
        model.save(path)
        log.info("latency profile saved to %s", path)
    except OSError as e:
        log.warning("cannot save the latency profile to %s (%s); using it for this run only", path, e)
    return model


# --------------------------------------------------------------------------------------
# Accuracy report (``laser profile --evaluate``)


def accuracy(pred: float, actual: float) -> float:
    """``1 - |pred - actual| / actual``, clipped to [0, 1]."""
    if not actual > 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - abs(pred - actual) / actual))


def summarize(preds: Sequence[float], actuals: Sequence[float]) -> dict:
    """Mean and P10 accuracy (fractions), count, and the mean signed error (pred/actual - 1)."""
    if not len(actuals):
        return {"n": 0, "mean_accuracy": None, "p10_accuracy": None, "mean_bias": None}
    acc = np.array([accuracy(p, a) for p, a in zip(preds, actuals)])
    bias = np.array([p / a - 1.0 for p, a in zip(preds, actuals)])
    return {"n": int(len(acc)), "mean_accuracy": float(acc.mean()), "p10_accuracy": float(np.percentile(acc, 10)),
            "mean_bias": float(bias.mean())}


def random_layer_batches(count: int, *, max_tokens: int = 2048, max_context: int = 4096,
                         pool_tokens: int = 1 << 30, max_batch: int = 64, block_size: int = 16,
                         seed: int = 1) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """Held-out layer steps ``(kind, query_lens, context_lens)``: decode batches of 1..max_batch
    with mixed contexts, prefill chunks of 16..max_tokens (some after cached context), mixed steps."""
    rng = np.random.default_rng(seed)
    cap = max(2, min(max_context, pool_tokens))

    def ctxs(b):
        # mixed contexts: short chats and long documents side by side
        long = rng.random(b) < 0.3
        split = max(3, min(512, cap))
        c = np.where(long, rng.integers(split - 1, max(split, cap + 1), b), rng.integers(2, split, b))
        return [int(x) for x in c]

    def chunk():
        q = int(round(math.exp(rng.uniform(math.log(16), math.log(max_tokens)))))
        q = max(2, min(q, max_tokens, cap))
        cached = int(rng.integers(0, q + 1)) if rng.random() < 0.5 else 0
        return q, min(q + cached, cap)

    out = []
    for k in range(count):
        kind = ("decode", "prefill", "mixed")[k % 3]
        q, c = [], []
        if kind in ("decode", "mixed"):
            b = int(rng.integers(1, max_batch + 1))
            q += [1] * b
            c += ctxs(b)
        if kind in ("prefill", "mixed"):
            for _ in range(1 if kind == "mixed" or rng.random() < 0.7 else 2):
                qi, ci = chunk()
                q.append(qi)
                c.append(ci)
        out.append((kind, *fit_to_pool(q, c, pool_tokens, block_size)))
    return out


class _Tables:
    """The block tables of some requests, frozen: the part of the block manager that
    ``ModelRunner._build_metadata`` reads (``block_size``, ``canonical_table``, ``table``,
    ``overridden_layers``)."""

    _versions = iter(range(-1, -(1 << 62), -1))

    def __init__(self, bm, req_ids):
        self.block_size = bm.block_size
        self.num_blocks = bm.num_blocks
        self.version = next(self._versions)  # never equal to a live block manager's
        self._canon = {r: list(bm.canonical_table(r)) for r in req_ids}
        self._over = {r: tuple(bm.overridden_layers(r)) for r in req_ids}
        self._tables = {(r, layer): list(bm.table(r, layer)) for r in req_ids for layer in self._over[r]}

    def canonical_table(self, req_id):
        return self._canon[req_id]

    def overridden_layers(self, req_id):
        return self._over[req_id]

    def table(self, req_id, layer):
        t = self._tables.get((req_id, layer))
        if t is not None:
            return t
        return self._canon[req_id]


@dataclass
class _Snapshot:
    """Everything ``ModelRunner.execute`` reads for one plan, frozen at planning time."""

    policy: str
    index: int
    plan: StepPlan
    bm: _Tables  # the block tables of the plan's requests at that step
    requests: dict  # req_id -> Request with the tokens the plan reads
    resumed: list  # (req_id, num_tokens) of works resuming from the intermediate cache


def synthetic_stream(num_requests: int, lm: LatencyModel, *, seed: int = 0, max_prompt: int = 384,
                     max_output: int = 48) -> list[tuple[float, Request]]:
    """``(arrival time, request)`` pairs: a burst, then Poisson arrivals (virtual seconds).

    Prompt lengths mix short and medium prompts; SLO classes are the paper's three classes
    scaled to this machine (targets relative to predicted decode and prefill times) plus
    best effort, so the Laser policy has TBT targets to plan layer slices against.
    """
    rng = np.random.default_rng(seed)
    t_dec = lm.predict_decode_iteration([256] * 8)
    t_pf = lm.predict_prefill(256)
    classes = [SLO(ttft=3 * t_pf, tbt=1.5 * t_dec, name="code"), SLO(ttft=6 * t_pf, tbt=3 * t_dec, name="chat"),
               SLO(ttft=20 * t_pf, tbt=6 * t_dec, name="summarization"), SLO(name="best_effort")]
    out, now = [], 0.0
    mean_gap = 2.5 * t_dec
    for k in range(num_requests):
        if k >= num_requests // 3:
            now += float(rng.exponential(mean_gap))
        short = rng.random() < 0.6
        plen = int(rng.integers(8, 96)) if short else int(rng.integers(96, max_prompt + 1))
        sp = SamplingParams(max_tokens=int(rng.integers(4, max_output + 1)), temperature=0.0, ignore_eos=True)
        ids = [int(x) for x in rng.integers(10, 1000, plen)]
        out.append((now, Request(ids, sp, slo=classes[int(rng.integers(0, len(classes)))], arrival_time=now,
                                 req_id=f"{_REQ_PREFIX}-eval-{seed}-{k}")))
    return out


def policy_snapshots(runner: ModelRunner, policy: str, lm: LatencyModel, *, num_requests: int = 24,
                     max_steps: int = 200, keep: int = 10, seed: int = 0,
                     max_num_batched_tokens: int = 256) -> list[_Snapshot]:
    """Drive ``policy``'s scheduler on a synthetic stream and keep ``keep`` of its plans.

    Torch-free: the plans are executed symbolically (the intermediate cache holds
    placeholders, tokens are random), which is all a scheduler observes; the virtual
    clock advances by the latency model's prediction. The engine's block manager is used
    (it must be idle) and is empty again afterwards. Plans are kept spread over the run
    and over kinds (prefill, decode, mixed, layer-sliced).
    """
    from .scheduler import get_policy

    bm = runner.bm
    n = runner.num_layers
    cfg = SchedulerConfig(policy=policy, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=64)
    icache = IntermediateCache(1 << 30)
    sched = get_policy(policy)(cfg, n, bm, icache, lm)
    clock = [0.0]
    sched.clock = lambda: clock[0]
    stream = synthetic_stream(num_requests, lm, seed=seed)
    rng = random.Random(seed)
    snaps: list[_Snapshot] = []
    pending = list(stream)
    try:
        for step in range(max_steps):
            while pending and pending[0][0] <= clock[0]:
                sched.add_request(pending.pop(0)[1])
            if not sched.has_unfinished() and not pending:
                break
            plan = sched.schedule(clock[0])
            if not plan:
                if pending:
                    clock[0] = max(clock[0], pending[0][0])
                    continue
                break
            reqs = {w.req_id: Request(list(sched.requests[w.req_id].all_token_ids), sched.requests[w.req_id].sampling_params,
                                      req_id=w.req_id) for w in plan.works}
            snaps.append(_Snapshot(policy, step, plan, _Tables(bm, list(reqs)), reqs,
                                   [(w.req_id, w.num_tokens) for w in plan.works if w.layer_start > 0]))
            # symbolic execution: what the runner does to the intermediate cache, and tokens
            for w in plan.works:
                if w.layer_start > 0:
                    icache.pop(w.req_id)
            for w in plan.works:
                if w.layer_end < n:
                    icache.put(w.req_id, None, w.num_tokens)
            sampled = {w.req_id: rng.randrange(10, 1000) for w in plan.works if w.sample and w.layer_end == n}
            clock[0] += lm.predict_iteration(plan)
            for req in sched.update(plan, plan.last_layer, sampled, clock[0]):
                if req.num_output_tokens >= req.sampling_params.max_tokens:
                    sched.finish(req, "length", clock[0])
    finally:
        for rid in list(sched.requests):
            sched.abort(rid, clock[0])
    bm.check_integrity(expect_empty=True)
    return _spread(snaps, keep, rng)


def _plan_kind(plan: StepPlan, n: int) -> str:
    if any(w.layer_start > 0 or w.layer_end < n for w in plan.works):
        return "layer-sliced"
    dec = any(w.num_tokens == 1 for w in plan.works)
    pf = any(w.num_tokens > 1 for w in plan.works)
    return "mixed" if dec and pf else ("decode" if dec else "prefill")


def _spread(snaps: list[_Snapshot], keep: int, rng: random.Random) -> list[_Snapshot]:
    """Up to ``keep`` snapshots, round-robin over plan kinds, spread over time within a kind."""
    if len(snaps) <= keep:
        return snaps
    by_kind: dict[str, list[_Snapshot]] = {}
    for s in snaps:
        by_kind.setdefault(_plan_kind(s.plan, s.plan.num_layers), []).append(s)
    for v in by_kind.values():
        rng.shuffle(v)
    out: list[_Snapshot] = []
    while len(out) < keep:
        for v in by_kind.values():
            if v and len(out) < keep:
                out.append(v.pop())
    return sorted(out, key=lambda s: s.index)


class _Replay:
    """Runs ``ModelRunner.execute`` on a snapshot: the runner reads the snapshot's block
    tables, requests and intermediate-cache entries (random hidden states of the right
    shape); its KV writes land in slots of the (idle) pool."""

    def __init__(self, runner: ModelRunner, snap: _Snapshot, gen: torch.Generator):
        self.runner, self.snap = runner, snap
        h = runner.model.config.hidden_size
        self.hidden = {rid: torch.randn(k, h, generator=gen).to(runner.model.dtype) for rid, k in snap.resumed}
        self.sampler = Sampler(0)

    def __call__(self):
        r = self.runner
        icache = IntermediateCache(1 << 30)
        for rid, k in self.snap.resumed:
            icache.put(rid, self.hidden[rid], k)
        saved = r.bm, r.icache, r.sampler
        r.bm, r.icache, r.sampler = self.snap.bm, icache, self.sampler
        try:
            return r.execute(self.snap.plan, self.snap.requests)
        finally:
            r.bm, r.icache, r.sampler = saved


@dataclass
class EvalSet:
    """Held-out measurements: what is timed (cases) and what describes it."""

    cases: list[Case]
    batches: list  # (kind, query_lens, context_lens) of the layer steps
    snaps: list  # _Snapshot of the iterations


def _eval_set(runner: ModelRunner, probe: Probe, planning_lm: LatencyModel, *, policies: Sequence[str],
              num_layer_steps: int, plans_per_policy: int, seed: int, max_tokens: int, max_batch: int,
              num_requests: int) -> EvalSet:
    if runner.bm.usage() > 0:
        raise ValueError("evaluate needs an idle engine (its KV pool is written to)")
    cfg = runner.model.config
    pool = pool_tokens(runner)
    rng = np.random.default_rng(seed)
    batches = random_layer_batches(num_layer_steps, max_tokens=min(max_tokens, cfg.max_position, pool),
                                   max_context=min(2 * max_tokens, cfg.max_position), pool_tokens=pool,
                                   max_batch=max_batch, block_size=runner.bm.block_size, seed=seed)
    snaps: list[_Snapshot] = []
    for k, pol in enumerate(policies):
        snaps += policy_snapshots(runner, pol, planning_lm, keep=plans_per_policy, seed=seed + k,
                                  num_requests=num_requests)
    gen = torch.Generator().manual_seed(seed)
    cases: list[Case] = []
    for k, (kind, q, c) in enumerate(batches):
        cases.append(Case(("layer", k), probe.layer_call(q, c)))
        cases.append(Case(("stateless", k), probe.stateless_call(sum(q))))
        cases.append(Case(("attention", k), probe.attention_call(q, c)))
    for n in sorted({int(x) for x in rng.integers(1, min(max_tokens, pool) + 1, 6)}):
        cases.append(Case(("embed", n), probe.embed_call(n)))
    for r in sorted({int(x) for x in rng.integers(1, max_batch + 1, 6)}):
        cases.append(Case(("head", r), probe.head_call(r)))
    for k, s in enumerate(snaps):
        cases.append(Case(("iteration", k), _Replay(runner, s, gen)))
    return EvalSet(cases, batches, snaps)


def _eval_report(obj, es: EvalSet, lm: LatencyModel, tol: float, method: str, bench: Bench) -> dict:
    res: dict[str, list] = {k: [] for k in CASE_KINDS}
    for cs in es.cases:
        kind, k = cs.key
        if kind in ("layer", "stateless", "attention"):
            bkind, q, c = es.batches[k]
            rec = {"kind": bkind, "batch": len(q), "tokens": sum(q), "sum_context": sum(c), "max_context": max(c),
                   "query_lens": list(q), "context_lens": list(c)}
        elif kind == "embed":
            rec = {"tokens": k}
        elif kind == "head":
            rec = {"rows": k}
        else:
            s = es.snaps[k]
            rec = {"policy": s.policy, "step": s.index, "kind": _plan_kind(s.plan, s.plan.num_layers),
                   "num_works": len(s.plan.works), "tokens": sum(w.num_tokens for w in s.plan.works),
                   "layer_calls": len(s.plan.layer_steps()), "num_layers": s.plan.num_layers,
                   "works": [[w.token_start, w.num_tokens, w.layer_start, w.layer_end, int(w.sample)]
                             for w in s.plan.works]}
        rec.update(actual_s=cs.estimate(), median_s=cs.median(), spread=cs.spread(), repeats=len(cs.times),
                   clean_repeats=len(cs.clean), settled=cs.settled(tol))
        res[kind].append(rec)
    all_cases = [r for v in res.values() for r in v]
    report = {
        "setup": profile_metadata(obj),
        "measurement": {
            "method": method,
            "repeats": sum(r["repeats"] for r in all_cases),
            "clean_fraction": round(sum(r["clean_repeats"] for r in all_cases)
                                    / max(1, sum(r["repeats"] for r in all_cases)), 3),
            "settled_fraction": round(sum(r["settled"] for r in all_cases) / max(1, len(all_cases)), 3),
            "out_of_time": bench.out_of_time,
            "rounds": bench.rounds,
            "timing_seconds": round(bench.seconds, 1),
            "median_over_estimate": float(np.mean([r["median_s"] / r["actual_s"] for r in all_cases])),
            "two_fastest_spread": float(np.mean([r["spread"] for r in all_cases])),
        },
        "cases": res,
    }
    return score(report, lm)


_METHOD = ("per case: shuffled rounds (min {lo}, max {hi}) after a warm-up, every case once per round, "
           "more rounds for unsettled cases while time is left; time = mean of the two fastest repeats; settled "
           "when they agree within {tol:.0f}% and one was clean (no task waiting for a CPU, /proc/pressure/cpu)")


def evaluate(obj, lm: LatencyModel, *, policies: Sequence[str] = ("vllm", "sarathi", "laser"),
             num_layer_steps: int = 45, plans_per_policy: int = 10, progress: bool | None = None, seed: int = 1,
             budget_s: float = 100.0, rounds: tuple[int, int] = (3, 6), tol: float = 0.03,
             max_tokens: int = 2048, max_batch: int = 64, num_requests: int = 24, warmup_s: float = 1.0) -> dict:
    """Accuracy of ``lm`` on held-out measurements of ``obj`` (an idle Engine or ModelRunner).

    * per module: stateless, attention, embedding and LM head on random held-out sizes;
    * per layer step: whole ``forward_layer`` calls on random batches vs ``predict_layer``;
    * per iteration: plans of every policy's scheduler (planned with ``lm``) on synthetic
      request streams, ``ModelRunner.execute(plan)`` end to end vs ``predict_iteration(plan)``.

    Ground truth is measured like the profile (:class:`Bench`: interleaved rounds, two
    fastest repeats). Returns a JSON-friendly dict (see ``format_report``).
    See :func:`profile_and_evaluate` for measuring the profile and the test set together.
    """
    runner = _runner_of(obj)
    probe = Probe(runner, seed + 100)
    with torch.inference_mode():
        es = _eval_set(runner, probe, lm, policies=policies, num_layer_steps=num_layer_steps,
                       plans_per_policy=plans_per_policy, seed=seed, max_tokens=max_tokens, max_batch=max_batch,
                       num_requests=num_requests)
        bench = Bench(rounds[0], rounds[1], tol, budget_s=budget_s, seed=seed)
        _run_bench(es.cases, bench, probe, warmup_s, "evaluating", progress)
    runner.bm.check_integrity(expect_empty=True)
    rep = _eval_report(obj, es, lm, tol, _METHOD.format(lo=rounds[0], hi=rounds[1], tol=100 * tol), bench)
    rep["measurement"]["interleaved_with_profile"] = False
    return rep


def profile_and_evaluate(obj, *, grid: ProfileGrid | None = None, policies: Sequence[str] = ("vllm", "sarathi", "laser"),
                         num_layer_steps: int = 45, plans_per_policy: int = 10, progress: bool | None = None,
                         seed: int = 0, budget_s: float = 140.0, max_tokens: int = 2048, max_batch: int = 64,
                         num_requests: int = 24, planning_lm: LatencyModel | None = None,
                         threads: int | None = None) -> tuple[FittedLatencyModel, dict]:
    """Profile and measure a held-out test set *in the same interleaved rounds*, then fit on
    the profile samples and score the test set (see :func:`evaluate`).

    Interleaving puts training and test measurements under the same machine conditions
    (other tenants, clock speed, allocator state drift over minutes on a shared host), so
    the report measures the latency model, not the drift. The schedulers plan the test
    iterations with ``planning_lm`` (default: a quick one-round profile on a small grid).
    """
    runner = _runner_of(obj)
    grid = grid or default_grid(runner)
    t0 = time.perf_counter()
    if planning_lm is None:
        pre = ProfileGrid.tiny(rounds=(1, 1))
        pre.warmup_s = 0.3
        planning_lm = fit(collect_samples(runner, pre, progress=False, seed=seed + 7), num_layers=runner.num_layers)
    probe = Probe(runner, seed)
    with torch.inference_mode():
        pcases = _profile_cases(probe, grid)
        es = _eval_set(runner, probe, planning_lm, policies=policies, num_layer_steps=num_layer_steps,
                       plans_per_policy=plans_per_policy, seed=seed + 1, max_tokens=max_tokens, max_batch=max_batch,
                       num_requests=num_requests)
        bench = Bench(grid.min_rounds, grid.max_rounds, grid.tol, budget_s=budget_s, seed=seed)
        setup_s = time.perf_counter() - t0
        _run_bench(pcases + es.cases, bench, probe, grid.warmup_s, "profiling + evaluating", progress)
    runner.bm.check_integrity(expect_empty=True)
    stats: dict = {}
    model = _fit_profile(obj, _samples(pcases, grid.tol, bench, stats), stats, time.perf_counter() - t0, threads)
    model.metadata["measurement"]["interleaved_with_evaluation"] = True
    rep = _eval_report(obj, es, model, grid.tol,
                       _METHOD.format(lo=grid.min_rounds, hi=grid.max_rounds, tol=100 * grid.tol), bench)
    rep["measurement"]["interleaved_with_profile"] = True
    rep["measurement"]["setup_seconds"] = round(setup_s, 1)
    return model, rep


CASE_KINDS = ("layer", "stateless", "attention", "embed", "head", "iteration")


def _case_prediction(lm: LatencyModel, kind: str, rec: dict) -> float:
    if kind in ("layer", "stateless", "attention"):
        q, c = tuple(rec["query_lens"]), tuple(rec["context_lens"])
        if kind == "layer":
            return lm.layer_time(q, c)
        return lm.stateless_time(sum(q)) if kind == "stateless" else lm.attention_time(q, c)
    if kind == "embed":
        return lm.embed_time(rec["tokens"])
    if kind == "head":
        return lm.head_time(rec["rows"])
    works = [Work(f"w{k}", ts, n, a, b, bool(smp)) for k, (ts, n, a, b, smp) in enumerate(rec["works"])]
    return lm.predict_iteration(StepPlan(rec["num_layers"], works))


def score(report: dict, lm: LatencyModel) -> dict:
    """(Re)compute predictions and accuracy summaries of an accuracy report for ``lm``.

    The measured ground truth in ``report["cases"]`` does not depend on the model, so a
    report can be re-scored for another (e.g. refitted) model without measuring again.
    """
    res = report["cases"]
    for kind in CASE_KINDS:
        for rec in res.get(kind, ()):
            rec["pred_s"] = _case_prediction(lm, kind, rec)

    def summ(recs):
        return summarize([r["pred_s"] for r in recs], [r["actual_s"] for r in recs])

    def by(recs, key):
        groups: dict[str, list] = {}
        for r in recs:
            groups.setdefault(r[key], []).append(r)
        return {g: summ(v) for g, v in sorted(groups.items())}

    meta = getattr(lm, "metadata", {}) or {}
    rep = getattr(lm, "report", {}) or {}
    report["model"] = {"profile_created": meta.get("created"),
                       "stateless_width": rep.get("stateless", {}).get("width"),
                       "head_width": rep.get("head", {}).get("width"),
                       "attention_features": rep.get("attention", {}).get("feature_set"),
                       "layer_overhead_s": getattr(lm, "layer_overhead_s", 0.0)}
    report["per_module"] = {m: summ(res.get(m, [])) for m in ("stateless", "attention", "embed", "head")}
    report["per_layer_step"] = {**summ(res.get("layer", [])), "by_kind": by(res.get("layer", []), "kind")}
    its = res.get("iteration", [])
    report["per_iteration"] = {**summ(its), "by_policy": by(its, "policy"), "by_kind": by(its, "kind")}
    return report


def format_report(rep: dict) -> str:
    """Human-readable accuracy table."""
    def pct(x):
        return "   n/a" if x is None else f"{100 * x:5.1f}%"

    def row(name, s):
        return f"  {name:<22} {pct(s['mean_accuracy'])}  {pct(s['p10_accuracy'])}  {s['n']:4d}"

    su = rep["setup"]
    lines = [f"Latency model accuracy: {su.get('model_name') or su['model_id']} {su['dtype']}, {su['threads']} threads, {su['hardware']}"
             + (" (test set measured interleaved with the profile)"
                if rep.get("measurement", {}).get("interleaved_with_profile") else ""),
             "  accuracy = 1 - |pred - actual| / actual",
             f"  {'':<22} {'mean':>6}  {'P10':>6}  {'n':>4}"]
    lines.append(" per module")
    for m, s in rep["per_module"].items():
        lines.append(row(m, s))
    lines.append(" per layer step")
    lines.append(row("all", rep["per_layer_step"]))
    for k, s in rep["per_layer_step"]["by_kind"].items():
        lines.append(row("  " + k, s))
    lines.append(" per iteration")
    lines.append(row("all", rep["per_iteration"]))
    for k, s in rep["per_iteration"]["by_policy"].items():
        lines.append(row("  policy " + k, s))
    for k, s in rep["per_iteration"]["by_kind"].items():
        lines.append(row("  " + k, s))
    ms = rep["measurement"]
    lines.append(f" measurement: {ms['repeats']} timed calls in {ms.get('rounds', '?')} rounds, "
                 f"{100 * ms['clean_fraction']:.0f}% clean, {100 * ms['settled_fraction']:.0f}% of cases settled; "
                 f"two fastest repeats {100 * ms.get('two_fastest_spread', 0):.1f}% apart, median "
                 f"{100 * (ms['median_over_estimate'] - 1):.0f}% above them"
                 + (" (ran out of time)" if ms["out_of_time"] else ""))
    return "\n".join(lines)
