"""The profile pipeline: time the grid on the real runner, fit, keep one profile file per setup.

``load_or_create`` keeps one profile file per (model shape, dtype, hardware, threads, executor
path: :func:`executor_path_of`);
``profile`` measures and fits; ``collect_samples`` only measures (see :mod:`.timing`
for how, :mod:`.calls` for what).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np
import torch

from ..latency import (
    AttentionSample,
    DecodeStepSample,
    EmbedSample,
    FittedLatencyModel,
    HeadSample,
    LatencyProfileError,
    LayerSample,
    PrefillStepSample,
    StatelessSample,
    StepOverheadSample,
    WarmDecodeStepSample,
    cpu_hardware_string,
    default_profile_path,
)
from ..latency.calibrated import repeat_spread
from ..latency.fitting import fit
from ..model.runner import ModelRunner
from .calls import ExecutorCalls
from ..core.pricing import plan_compositions
from .grid import ProfileGrid, fit_to_pool, step_works
from .snapshots import StepOverheadReplay, WarmDecodeReplay, step_snapshots
from .timing import Bench, Case, planned_calls, progress_bar

log = logging.getLogger(__name__)

# Bump when what is measured, or how, changes: older profile files are then re-made.
PROFILER_VERSION = 13  # 4: layer matmuls in per-row-count layouts (laser.model.llama.Linear); 5: typical (median) times;
# 6: skewed decode batches (padded gather), executor-path label in the key; 7: whole steps' overhead
# (StepOverheadSample); 8: the row counts where the matmul kernels switch (metadata["kernel_rows"]),
# sampled on both sides, and a denser LM-head grid; 9: causal prefill attention at 18 more chunk lengths, around
# the flash kernel's query-block switches (grid.CAUSAL_GRID); 10: whole decode steps' compute (DecodeStepSample),
# at 12 more decode steps spread like the decode layer samples (grid._decode_step_shapes); 11: whole prefill and
# mixed steps' compute (PrefillStepSample), at more steps of one or two prompts and chunks, beside decode rows or
# not (grid._prefill_step_shapes); 12: decode steps of up to 8 rows timed in streaks as well (WarmDecodeStepSample);
# 13: the decode-attention kernel's independent FMA chains (laser.model.attn_kernel: ~5x faster on an AVX2-only
# EPYC, under the same executor path label in bf16; fp32 models now run it too: `...-fused-dattn-cpp`)
#: Decode steps of at most this many rows are also timed in streaks back to back (``WarmDecodeStepSample``,
#: ``snapshots.WarmDecodeReplay``: up to 24 steps or 0.25 s; one step shape per row count): on an AMX Xeon a
#: batch-1 step saved up to 24 % of its price, batch 4 up to 9 %, 5+ rows (over dense bf16 copies) ~5 %.
WARM_DECODE_MAX_ROWS = 8
# Candidate segment widths for the stateless / LM-head fits. On CPUs a single row runs a
# matrix-vector kernel (one decode token: ~25% cheaper than two), so widths down to 1
# are offered; cross-validation picks one.
PROFILE_WIDTHS = (1, 2, 4, 8, 16, 32, 64, 128)


def runner_of(obj) -> ModelRunner:
    """The :class:`ModelRunner` of an Engine (or the runner itself). Raises ``TypeError``."""
    runner = getattr(obj, "runner", obj)
    if not isinstance(runner, ModelRunner):
        raise TypeError(f"expected an Engine or a ModelRunner, got {type(obj).__name__}")
    return runner


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
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
        hf = getattr(runner_of(obj).model.config, "hf_config", None)
        name = getattr(hf, "_name_or_path", None) or getattr(hf, "name_or_path", None)
    if name:
        name = str(name)
        base = os.path.basename(os.path.normpath(name)) if ("/" in name or os.sep in name) else name
        return base.removesuffix(".gguf") or name
    return shape_signature(runner_of(obj).model.config)


def executor_path_of(obj) -> str:
    """The label of the code path that runs the layers (what a profile is measured on): the
    runner's, else the model's ``executor_path`` attribute (e.g. ``"compiled"``, ``"int8"``,
    ``"compiled-int4"``), else ``"eager"`` (the plain PyTorch modules). A different path is a
    different machine to the latency model: it gets its own profile file and evaluation."""
    runner = runner_of(obj)
    label = getattr(runner, "executor_path", None) or getattr(runner.model, "executor_path", None)
    return str(label or "eager")


def kernel_rows_of(model) -> dict[str, list[int]]:
    """Row counts ``k`` at which ``model``'s matmuls switch kernel (``n <= k`` rows one, more
    another): ``"stateless"`` from the layers' projections (a quantized weight's
    ``kernel_max_rows``; an fp32 :class:`~laser.model.llama.Linear` with its packed layout,
    ``PACKED_MAX_ROWS``), ``"head"`` from a quantized LM head. The latency fit keeps a segment
    edge at each (:func:`laser.latency.features.kernel_rows_from_metadata`)."""
    def edge(lin):
        k = getattr(lin, "kernel_max_rows", None)
        if k is None and getattr(lin, "wt", None) is not None:
            k = getattr(lin, "PACKED_MAX_ROWS", None)
        return k

    layers = getattr(model, "layers", [])
    st = {edge(lin) for L in layers for lin in (L.qkv, L.o, L.gate_up, L.down)} - {None}
    head = getattr(model, "lm_head_q", None)
    return {"stateless": sorted(int(k) for k in st), "head": [int(head.kernel_max_rows)] if head is not None else []}


def profile_metadata(obj, threads: int | None = None) -> dict:
    """What a profile is keyed by and checked against when loaded.

    ``model_id`` (the file key) is the model *shape*: latency depends on it, not on the
    weights, so an Engine and its bare ModelRunner find the same file -- plus the format of
    quantized weights (``-int4``, ``-int4-int8``: laser.model.quant), which changes every matmul.
    ``threads`` (torch intra-op threads) and ``executor`` (:func:`executor_path_of`) are part of
    the key: a profile measured with one thread, or on the eager path, does not price two
    threads or compiled code.
    """
    runner = runner_of(obj)
    shape = shape_signature(runner.model.config)
    kinds = getattr(runner.model, "quant_kinds", [])
    return {
        "model_id": "-".join([shape, *kinds]),
        "model_name": model_name_of(obj),
        "shape": shape,
        "dtype": dtype_name(runner.model.dtype),
        "hardware": cpu_hardware_string(),
        "threads": int(threads or torch.get_num_threads()),
        "executor": executor_path_of(runner),
        "profiler_version": PROFILER_VERSION,
        "kernel_rows": kernel_rows_of(runner.model),
    }


def pool_tokens(runner: ModelRunner) -> int:
    """KV slots per layer of the runner's pool (blocks x block size)."""
    return runner.bm.num_blocks * runner.bm.block_size


def default_grid(runner: ModelRunner) -> ProfileGrid:
    """:meth:`ProfileGrid.default` sized to the runner's model (max positions) and KV pool."""
    cfg = runner.model.config
    pool = pool_tokens(runner)
    grid = ProfileGrid.default(max_tokens=min(2048, cfg.max_position, pool),
                               max_context=min(4096, cfg.max_position), pool_tokens=pool,
                               block_size=runner.bm.block_size)
    grid.add_kernel_edges(kernel_rows_of(runner.model))
    return grid


def profile_cases(calls: ExecutorCalls, grid: ProfileGrid) -> list[Case]:
    """One :class:`Case` per grid point (batches shrunk to fit the pool), keyed
    ``(kind, *size)`` as :func:`samples_from_cases` reads them."""
    pool, bs = pool_tokens(calls.runner), calls.bm.block_size
    cases: list[Case] = []
    for n in grid.stateless_tokens:
        cases.append(Case(("stateless", n), calls.stateless_call(n)))
    for q, c in dict.fromkeys(fit_to_pool(q, c, pool, bs) for q, c in grid.attention_batches):
        cases.append(Case(("attention", q, c), calls.attention_call(q, c)))
    for q, c in dict.fromkeys(fit_to_pool(q, c, pool, bs) for q, c in grid.layer_batches):
        cases.append(Case(("layer", q, c), calls.layer_call(q, c)))
    for n in grid.embed_tokens:
        cases.append(Case(("embed", n), calls.embed_call(n)))
    for r in grid.head_rows:
        cases.append(Case(("head", r), calls.head_call(r)))
    if grid.step_shapes:
        n = calls.num_layers
        shapes = []
        for shape in grid.step_shapes:
            works = step_works(shape, n)
            q, c = fit_to_pool([w[0] for w in works], [w[1] for w in works], pool, bs)
            shapes.append([(qi, ci, a, b) for qi, ci, (_, _, a, b) in zip(q, c, works)])
        warm_rows = set()  # (one streak case per row count: each call runs a streak of steps)
        for snap in step_snapshots(calls.runner, shapes, seed=len(cases)):
            k, m = plan_compositions(snap.plan.works, n)
            replay = StepOverheadReplay(calls.runner, snap, calls.gen)
            cases.append(Case(("step_overhead", snap.index, k, m), replay))
            rows = len(replay.decode_contexts or ())
            if 0 < rows <= WARM_DECODE_MAX_ROWS and rows not in warm_rows:
                warm_rows.add(rows)
                cases.append(Case(("decode_warm", snap.index), WarmDecodeReplay(calls.runner, snap, calls.gen)))
    return cases


def reference_cases(calls: ExecutorCalls) -> list[Case]:
    """The reference calls :class:`Bench` re-times between the cases to see a slower
    machine (see :mod:`.timing`): one decode layer step at batch 8 (contexts 256;
    bandwidth-bound: KV and weights streamed) and one prefill layer step of 256 tokens
    (compute-bound), shrunk to the KV pool and the model's positions."""
    pool, bs = pool_tokens(calls.runner), calls.bm.block_size
    q = max(2, min(256, calls.cfg.max_position, pool))
    refs = [fit_to_pool((1,) * 8, (256,) * 8, pool, bs), fit_to_pool((q,), (q,), pool, bs)]
    return [Case(("reference", *b), calls.layer_call(*b)) for b in refs]


def run_bench(cases: list[Case], bench: Bench, calls: ExecutorCalls, warmup_s: float, desc: str, progress) -> None:
    """Warm the CPU up for ``warmup_s`` seconds, then time ``cases`` with ``bench`` (a
    progress bar titled ``desc`` when ``progress``; None: when stderr is a terminal),
    re-timing :func:`reference_cases` between them."""
    global_warmup(calls, warmup_s)
    bar = progress_bar(planned_calls(len(cases), bench), desc, progress)
    bench.progress = bar
    try:
        bench.run(cases, references=reference_cases(calls))
    finally:
        if bar is not None:
            bar.close()


def disturbance_stats(cases: list[Case], bench: Bench) -> dict:
    """How disturbed the timing of ``cases`` was: repeats, the fraction clean (undisturbed and
    no task waiting for a CPU), the fraction disturbed (reference re-timing drifted over
    ``bench.ref_tol``), cases left with no undisturbed repeat, the largest reference drift."""
    repeats = sum(c.repeats for c in cases)
    return {"repeats": repeats,
            "clean_fraction": round(sum(len(c.clean) for c in cases) / max(1, repeats), 3),
            "disturbed_fraction": round(sum(len(c.disturbed) for c in cases) / max(1, repeats), 3),
            "disturbed_cases": sum(1 for c in cases if c.repeats and not c.times),
            "min_repeats": bench.min_repeats,
            "reference_checks": len(bench.checks), "reference_tol": round(bench.effective_ref_tol(), 3),
            "max_reference_drift": round(bench.reference_drift(), 3)}


def disturbed_enough_to_warn(info: dict) -> bool:
    """Whether a profile measured as ``info`` says (from :func:`samples_from_cases`; the
    ``metadata["measurement"]`` of a profile) may be off because the machine was busy: under
    80% of its timed calls clean, over 10% disturbed, or over a third of its samples without
    two repeats within the tolerance. :func:`samples_from_cases` logs the warning then."""
    return (info["clean_fraction"] < 0.8 or info["disturbed_fraction"] > 0.1
            or info["unsettled_cases"] > info["cases"] // 3)


def samples_from_cases(cases: list[Case], tol: float, bench: Bench, stats: dict | None, warn: bool = True) -> list:
    """Profile samples from measured profile cases; ``stats`` receives how clean they were, and the
    spread of their repeats (``timing_spread``, :func:`~laser.latency.calibrated.repeat_spread`).

    A case left with only disturbed repeats (the time budget ran out before it could be
    re-measured) is dropped with a warning, unless that would drop every sample of its kind.
    """
    kinds = {c.key[0] for c in cases}
    drop = {k for k, c in enumerate(cases) if c.repeats and not c.times}
    for kind in kinds:  # never drop every sample of a kind
        if all(k in drop for k, c in enumerate(cases) if c.key[0] == kind):
            drop -= {k for k, c in enumerate(cases) if c.key[0] == kind}
    kept = [c for k, c in enumerate(cases) if k not in drop]
    unsettled = [k for k, c in enumerate(kept) if not c.settled(tol)]
    info = {**disturbance_stats(cases, bench), "unsettled_cases": len(unsettled), "cases": len(cases),
            "dropped_disturbed": len(drop), "out_of_time": bench.out_of_time, "unsettled_index": unsettled,
            "timing_spread": repeat_spread(c.times for c in kept)}  # (the margin before the calibration's first steps)
    if stats is not None:
        stats.update(info)
    clean, disturbed = info["clean_fraction"], info["disturbed_fraction"]
    if warn and disturbed_enough_to_warn(info):
        log.warning("the machine was busy with other work while profiling (%.0f%% of timed calls clean, %.0f%% "
                    "disturbed: reference calls re-timed up to %.0f%% slower than their best; %d of %d samples "
                    "without two repeats within %.0f%%%s): the profile may be off; re-run `laser profile` on a "
                    "quiet machine", 100 * clean, 100 * disturbed, 100 * info["max_reference_drift"],
                    len(unsettled), len(cases), 100 * tol,
                    f"; the {bench.budget_s:g} s time budget ran out after {bench.rounds} rounds"
                    if bench.out_of_time else "")
    if warn and drop:
        log.warning("%d of %d samples dropped: every timing of them was disturbed (the machine ran slower) and the "
                    "time budget ran out before they could be re-measured", len(drop), len(cases))
    out = []
    for cs in kept:
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
        elif kind == "decode_warm":
            if cs.run.warm:  # (none when the case was never run: timings given by a test)
                for k, ts in enumerate(zip(*cs.run.warm), 1):  # (streaks as long as the shortest call's)
                    out.append(WarmDecodeStepSample(cs.run.decode_contexts, k, max(float(np.median(ts)), 1e-7)))
        elif kind == "step_overhead":  # what the step cost beyond its timed compute (not its wall time)
            oh = getattr(cs.run, "overheads", None)
            if oh:  # (none when the case was never run: timings given by a test)
                out.append(StepOverheadSample(args[1], args[2], max(float(np.median(oh)), 1e-7)))
            if oh and cs.run.decode_contexts:  # and its compute (the typical wall time, as every case's, less
                # the overhead): decode layers as they run in a step
                out.append(DecodeStepSample(cs.run.decode_contexts, max(t - float(np.median(oh)), 1e-7)))
            if oh and cs.run.prefill_batch:  # (the same for layers holding a prefill chunk)
                out.append(PrefillStepSample(*cs.run.prefill_batch, max(t - float(np.median(oh)), 1e-7)))
        else:
            out.append(HeadSample(args[0], t))
    return out


def collect_samples(runner: ModelRunner, grid: ProfileGrid | None = None, *, progress: bool | None = None,
                    budget_s: float = 40.0, seed: int = 0, stats: dict | None = None, warn: bool = True) -> list:
    """Time every grid point on ``runner`` (see the module docstring). Returns profile samples;
    ``stats`` (when given) receives how clean the measurements were."""
    runner = runner_of(runner)
    grid = grid or default_grid(runner)
    calls = ExecutorCalls(runner, seed)
    with torch.inference_mode():
        cases = profile_cases(calls, grid)
        bench = Bench(grid.min_rounds, grid.max_rounds, grid.tol, budget_s=budget_s, seed=seed,
                      min_repeats=grid.min_repeats)
        run_bench(cases, bench, calls, grid.warmup_s, "profiling", progress)
    runner.bm.check_integrity()
    return samples_from_cases(cases, grid.tol, bench, stats, warn=warn and grid.max_rounds > 1)


def _sample_prediction(model: FittedLatencyModel, s) -> float:
    if isinstance(s, StatelessSample):
        return model.stateless_time(s.n_tokens)
    if isinstance(s, AttentionSample):
        return model.attention_time(s.query_lens, s.context_lens)
    if isinstance(s, LayerSample):
        return model.layer_time(s.query_lens, s.context_lens)
    if isinstance(s, EmbedSample):
        return model.embed_time(s.n_tokens)
    if isinstance(s, StepOverheadSample):
        return model.step_overhead_time(s.compositions, s.composed_works)
    if isinstance(s, DecodeStepSample):
        return model.step_compute_time((1,) * len(s.context_lens), s.context_lens)
    if isinstance(s, WarmDecodeStepSample):
        b = len(s.context_lens)
        return model.decode_warm_factor(b, s.streak) * model.step_compute_time((1,) * b, s.context_lens)
    if isinstance(s, PrefillStepSample):
        return model.step_compute_time(s.query_lens, s.context_lens)
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


def global_warmup(calls: ExecutorCalls, seconds: float = 1.0) -> None:
    """Spin the CPU up and touch every layer's weights once before timing."""
    t0 = time.perf_counter()
    runs = [calls.stateless_call(64), calls.stateless_call(1)]
    while time.perf_counter() - t0 < seconds:
        for r in runs:
            for _ in range(calls.num_layers):
                r()


def fit_profile(obj, samples: list, stats: dict, seconds: float, threads: int | None = None) -> FittedLatencyModel:
    """:func:`robust_fit` of ``samples`` with the setup's metadata; ``stats`` (from
    :func:`samples_from_cases`) goes to ``metadata["measurement"]``."""
    runner = runner_of(obj)
    meta = profile_metadata(obj, threads)
    meta["profile_seconds"] = round(seconds, 2)
    meta["pool_tokens"] = pool_tokens(runner)
    model, dropped = robust_fit(samples, set(stats.pop("unsettled_index", ())), runner.num_layers, meta)
    stats["dropped_outliers"] = dropped
    model.metadata["measurement"] = stats
    return model


def profile(obj, path: str | os.PathLike | None = None, *, grid: ProfileGrid | None = None,
            progress: bool | None = None, budget_s: float = 40.0, seed: int = 0,
            threads: int | None = None, grammar_tokenizer=None) -> FittedLatencyModel:
    """Profile ``obj`` (an Engine or a ModelRunner), fit, and save to ``path`` when given.
    ``grammar_tokenizer`` (a Hugging Face tokenizer or the model directory; default: an Engine's
    tokenizer): measure the grammar mask per sampled row with it (``mask_row_s``,
    :mod:`laser.profiler.mask`); without one it stays 0.0 (not measured)."""
    t0 = time.perf_counter()
    stats: dict = {}
    runner = runner_of(obj)
    samples = collect_samples(runner, grid, progress=progress, budget_s=budget_s, seed=seed, stats=stats)
    tok = grammar_tokenizer if grammar_tokenizer is not None else getattr(obj, "tokenizer", None)
    mask_s = 0.0
    if tok is not None:
        from .mask import measure_mask_row_s

        mask_s = measure_mask_row_s(tok, runner.model.config.vocab_size, runner.sampler.eos_ids, seed=seed)
    model = fit_profile(obj, samples, stats, time.perf_counter() - t0, threads)
    model.mask_row_s = mask_s
    if path is not None:
        model.save(path)
    return model


def default_path(obj, threads: int | None = None) -> Path:
    m = profile_metadata(obj, threads)
    return default_profile_path(m["model_id"], m["dtype"], m["hardware"], m["threads"], m["executor"])


#: A cached profile whose predictions of the reference calls are off by more than this factor
#: (either way) on the machine as it runs now is replaced at engine start.
STALE_RATIO = 1.6


def machine_ratio(model: FittedLatencyModel, runner: ModelRunner, repeats: int = 5) -> float:
    """How this machine runs the :func:`reference_cases` now against ``model``'s predictions:
    the geometric mean over the two reference layer calls of (their :class:`Bench` estimate over
    ``repeats`` repeats, each a burst of >= 5 ms of back-to-back calls, after one untimed call)
    / ``model.layer_time`` -- 1.0 when the profile still holds, > 1 when the machine is now
    slower than the profile says. Takes ~10 layer calls (well under a second for SmolLM2 on one
    core). The check of :func:`load_or_create` (issue "Keep tight SLOs under pressure": a
    profile made on a loaded machine predicted a 0.4 s chat TBT infeasible on a quiet one, so
    Laser stopped protecting it)."""
    cases = reference_cases(ExecutorCalls(runner))
    Bench(min_rounds=repeats, max_rounds=repeats, tol=0.0, burst_s=0.005, max_burst=100_000, psi=None).run(cases)
    logs = []
    for case in cases:
        _, q, ctx = case.key
        logs.append(np.log(case.estimate() / max(model.layer_time(q, ctx), 1e-9)))
    return float(np.exp(np.mean(logs)))


def _warn_if_measured_busy(model: FittedLatencyModel, path) -> None:
    """Log a warning when a loaded profile says it was measured on a busy machine: under half
    of its timed calls clean, over a quarter disturbed, or samples dropped as disturbed (this
    project's VM, quiet, measures 82-84 % clean and 6-14 % disturbed: not warned). Every engine
    start that loads it plans with it, and a profile cached while another job held the CPU (11 %
    of its timed calls clean on this project's VM) mispredicted steps by 0.58-1.33x. (Unsettled
    samples alone do not warn here: on a VM whose timing jitters by itself most are.)"""
    m = model.metadata.get("measurement") or {}
    keys = {"clean_fraction", "disturbed_fraction", "unsettled_cases", "cases"}
    if not (m.get("clean_fraction", 1.0) < 0.5 or m.get("disturbed_fraction", 0.0) > 0.25
            or m.get("dropped_disturbed")):
        return
    log.warning("the loaded profile %s was measured while the machine was busy: %.0f%% of its timed calls clean, "
                "%.0f%% disturbed (another process competing for memory bandwidth or cores)%s%s; its predictions, "
                "and SLO planning with them, may be off: re-run `laser profile` on a quiet machine", path,
                100 * m.get("clean_fraction", 1.0), 100 * m.get("disturbed_fraction", 0.0),
                f", {m['unsettled_cases']} of {m['cases']} samples unsettled" if keys <= m.keys() else "",
                f", {m['dropped_disturbed']} samples dropped" if m.get("dropped_disturbed") else "")


def load_or_create(engine_or_model_runner, path: str | os.PathLike | None = None, create: bool = True, *,
                   progress: bool | None = None, grid: ProfileGrid | None = None,
                   budget_s: float = 40.0, grammar_tokenizer=None) -> FittedLatencyModel:
    """The fitted latency model of this engine's setup: loaded from ``path`` (default:
    :func:`default_profile_path` of model, dtype, hardware, threads and executor path) when present and
    made for the same setup; otherwise profiled now and saved there.

    A missing, unreadable, corrupt or mismatching file is logged (why, and that a new
    profile is being made) and replaced; it never raises for that, unless
    ``create=False``, which raises :class:`LatencyProfileError` instead of profiling. With
    ``create``, a loaded profile is also checked against the machine as it runs now
    (:func:`machine_ratio`); one off by more than :data:`STALE_RATIO` either way is replaced.
    A profile that cannot be saved is logged and still returned. ``grammar_tokenizer``: see
    :func:`profile` (a new profile's grammar mask measurement).
    """
    obj = engine_or_model_runner
    runner = runner_of(obj)
    meta = profile_metadata(obj)
    path = Path(path) if path is not None else default_profile_path(
        meta["model_id"], meta["dtype"], meta["hardware"], meta["threads"], meta["executor"])
    expect = {k: meta[k] for k in ("shape", "dtype", "hardware", "threads", "executor", "profiler_version")}
    expect["num_layers"] = runner.num_layers
    try:
        model = FittedLatencyModel.load(path, **expect)
        log.info("latency profile loaded from %s", path)
        if not create:
            _warn_if_measured_busy(model, path)
            return model
        ratio = machine_ratio(model, runner)
        if 1 / STALE_RATIO <= ratio <= STALE_RATIO:
            log.info("latency profile matches this machine now (reference calls at %.2fx its predictions)", ratio)
            _warn_if_measured_busy(model, path)  # (kept: a stale one is re-made below, nothing to warn of)
            return model
        log.warning("the latency profile in %s predicts this machine %.2fx %s than it runs its reference calls "
                    "now (a profile made on a busier or quieter machine): SLO planning would be wrong -- "
                    "profiling now", path, ratio if ratio > 1 else 1 / ratio, "faster" if ratio > 1 else "slower")
    except LatencyProfileError as e:
        if not create:
            raise
        log.warning("%s -- profiling now (under a minute on quiet cores; minutes on a busy machine)", e)
    model = profile(obj, None, grid=grid, progress=progress, budget_s=budget_s, grammar_tokenizer=grammar_tokenizer)
    try:
        model.save(path)
        log.info("latency profile saved to %s", path)
    except OSError as e:
        log.warning("cannot save the latency profile to %s (%s); using it for this run only", path, e)
    return model
