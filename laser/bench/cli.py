"""``laser bench``: multi-SLO serving benchmark (goodput per policy, paper §9).

Targets: in-process engines, one per ``--policies`` entry (one loaded model; a fresh
scheduler per run; ``--disaggregated`` for prefill+decode pairs), or any
OpenAI-compatible server (``--base-url``), or the simulator (``--sim``: the same
schedulers on a latency model, virtual time). Every probed rate runs every target on
the same arrivals before the next rate, so ratios hold on a noisy machine.

Modes: ``--request-rate R`` (or ``--trace`` without it) is one run per target; otherwise
the goodput search (grid over ``--rate-range``, doubling until every policy has failed a
probe, then bisection; see laser/bench/goodput.py). ``sarathi:best`` sweeps the token
budget and keeps the best; it is added to every comparison with laser (``--no-auto-best``).

This module sets a run up (targets, workload, SLOs, budgets); :mod:`laser.bench.command` runs it.
"""

from __future__ import annotations

import copy
import dataclasses
import logging

log = logging.getLogger("laser.bench")

from laser.bench.args import _floats, parse_mix


# ------------------------------------------------------------------------------------ setup


def parse_policies(s: str) -> list[tuple[str, str, int | str | None]]:
    """``"vllm,sarathi:64,sarathi:auto,sarathi:best,laser"`` -> [(label, policy, budget)].

    ``policy:N`` runs the policy with ``max_num_batched_tokens = N``; ``policy:auto`` with
    the budget Sarathi-Serve would pick for the tightest TBT target
    (:func:`laser.bench.runner.tbt_token_budget`); ``policy:best`` with the best of a
    budget sweep on the workload (:mod:`laser.bench.best`). Raises ValueError on an
    unknown policy, a bad budget or a duplicate.
    """
    from laser.scheduler import get_policy

    out = []
    for item in (x.strip() for x in s.split(",")):
        if not item:
            continue
        name, _, budget = item.partition(":")
        get_policy(name)  # ValueError on an unknown name
        b: int | str | None = None
        if budget:
            if budget in ("auto", "best"):
                b = budget
            else:
                try:
                    b = int(budget)
                except ValueError:
                    raise ValueError(f"bad token budget in {item!r}: want an integer, 'auto' or 'best'") from None
                if b < 1:
                    raise ValueError(f"token budget must be >= 1 in {item!r}")
        out.append((item, name, b))
    if len({lb for lb, _, _ in out}) != len(out):
        raise ValueError(f"duplicate policy in {s!r}")
    if not out:
        raise ValueError("no policy given")
    return out


def apply_budgets(targets, specs, slos, lm, num_layers=None) -> dict[str, int]:
    """Set each target's token budget from its spec; "auto" from the tightest TBT in ``slos``."""
    from laser.bench.runner import EngineTarget, SimTarget, tbt_token_budget

    tbts = [s.tbt for s in slos.classes.values() if s.tbt is not None]
    chosen = {}
    for label, _, b in specs:
        if b is None or label not in targets:
            continue
        if b == "auto":
            if not tbts:
                raise ValueError(f"{label}: no TBT target to size the token budget from")
            if lm is None:
                raise ValueError(f"{label}: a latency model is needed to size the token budget")
            b = tbt_token_budget(lm, min(tbts), num_layers)
        t = targets[label]
        if isinstance(t, EngineTarget):
            t.overrides["max_num_batched_tokens"] = b
        elif isinstance(t, SimTarget):
            t.config = dataclasses.replace(t.config, max_num_batched_tokens=b)
        chosen[label] = b
    return chosen


def _engine_args(args, policy: str):
    a = copy.copy(args)
    a.policy = policy
    return a


def _tokenizer(args, engine=None):
    from laser.bench.workloads import HFTokenizer

    if engine is not None and args.tokenizer is None:
        return HFTokenizer(engine.tokenizer)
    from laser.model.loader import load_tokenizer, resolve_model

    return HFTokenizer(load_tokenizer(resolve_model(args.tokenizer or args.model)))


def _planning_model(engine):
    """The latency model the engine's policies plan with (the engine loads it from
    ``--latency-profile``: the cached/fitted profile, or a roofline estimate)."""
    return getattr(engine, "latency_model", None)


def _sim_setup(args):
    """(latency model, num_layers, num_blocks, max_model_len, tokenizer) for --sim."""
    from laser.core.config import CacheConfig
    from laser.latency import AnalyticLatencyModel, FittedLatencyModel, ModelShape
    from laser.model.loader import load_config, resolve_dtype, resolve_model

    path = resolve_model(args.model)
    mc = load_config(path)
    lm = None
    if args.sim_latency in ("auto", "profile"):
        prof = getattr(args, "latency_profile", None)
        if prof not in (None, "auto"):
            lm = FittedLatencyModel.load(prof)
        else:
            # the engine loads (or profiles, once) the fitted model of this setup
            from laser.cli import build_engine

            a = _engine_args(args, "vllm")
            a.latency_profile = "auto"
            lm = _planning_model(build_engine(a))
            lm = getattr(lm, "inner", lm)  # the profiled model, not the engine's online calibration of it
            if not isinstance(lm, FittedLatencyModel):
                if args.sim_latency == "profile":
                    raise ValueError("--sim-latency profile: no fitted latency profile could be made")
                lm = None
    if lm is None:
        shape = ModelShape.from_hf_config(mc.hf_config.to_dict())
        lm = AnalyticLatencyModel(shape, args.sim_hardware or "cpu-2core")
    dtype = resolve_dtype(args.dtype)
    dbytes = 2 if str(dtype).endswith("bfloat16") else 4
    cache = CacheConfig(block_size=args.block_size, kv_cache_gib=args.kv_cache_gib)
    blocks = cache.blocks_per_layer(mc, dbytes)
    max_len = min(mc.max_position, blocks * args.block_size, args.max_model_len or mc.max_position)
    return lm, mc.num_layers, blocks, max_len


def _sched_config(args, policy: str):
    from laser.core.config import SchedulerConfig

    return SchedulerConfig(policy=policy, queue_order=args.queue_order, max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens, best_effort_share=args.best_effort_share)


def build_targets(args, specs):
    """(targets by label, tokenizer, max_model_len, latency model or None, mode)."""
    from laser.bench.client import ClientTarget
    from laser.bench.runner import EngineTarget, SimTarget

    if args.base_url:
        tgt = ClientTarget(args.base_url, args.served_model_name, args.endpoint, args.api_key, args.max_concurrency,
                           label=args.label, extra_body=args.extra_body)
        return {tgt.label: tgt}, _tokenizer(args), args.max_model_len, None, "client"
    if getattr(args, "cluster", None):
        from laser.bench.cluster import build_cluster_targets

        if not args.sim:
            raise ValueError("--cluster needs --sim (the cluster is simulated)")
        targets, cfg = build_cluster_targets(args)
        max_len = args.max_model_len or 32768
        return targets, _tokenizer(args), max_len, cfg.latency_model, "sim"
    if args.sim:
        lm, n_layers, blocks, max_len = _sim_setup(args)
        targets = {}
        for label, pol, _ in specs:
            targets[label] = SimTarget(pol, lm, n_layers, _sched_config(args, pol), num_blocks=blocks,
                                       block_size=args.block_size, icache_tokens=args.intermediate_cache_tokens,
                                       disaggregated=args.disaggregated, label=label)
        return targets, _tokenizer(args), max_len, lm, "sim"
    from laser.cli import build_engine
    from laser.frontend.disagg import DisaggregatedPair

    first = specs[0][1]
    pair = None
    if args.disaggregated:
        pair = DisaggregatedPair(build_engine(_engine_args(args, first), role="prefill"),
                                 build_engine(_engine_args(args, first), role="decode"))
        engine = pair.prefill
    else:
        engine = build_engine(_engine_args(args, first), max_model_len=args.max_model_len)
    lm = _planning_model(engine)
    targets = {}
    for label, pol, _ in specs:
        if pair is not None:
            targets[label] = EngineTarget(pol, pair=pair, latency_model=lm, label=label)
        else:
            targets[label] = EngineTarget(pol, engine=engine, latency_model=lm, label=label)
    max_len = engine.max_model_len if args.max_model_len is None else min(engine.max_model_len, args.max_model_len)
    return targets, _tokenizer(args, engine), max_len, lm, "engine"


def build_workload(args, tokenizer, max_model_len, mix=None):
    """(requests, trace times or None, description dict)."""
    from laser.bench.arrivals import read_trace, requests_from_trace
    from laser.bench.workloads import WorkloadSampler, sample_mix

    if args.trace:
        entries = read_trace(args.trace, slo_class=args.trace_class)
        if args.num_prompts:
            entries = entries[: args.num_prompts]
        sampler = WorkloadSampler(tokenizer, args.seed, args.length_scale, max_model_len)
        reqs = requests_from_trace(entries, sampler, args.seed)
        times = [e.arrival_time for e in entries]
        desc = {"trace": args.trace, "num_prompts": len(reqs), "length_scale": args.length_scale}
    else:
        mix = mix or args.mix
        n = args.num_prompts or 100
        reqs = sample_mix(mix, n, args.seed, args.length_scale, tokenizer, max_model_len)
        times = None
        desc = {"mix": ":".join(f"{m:g}" for m in mix), "num_prompts": n, "length_scale": args.length_scale}
    if getattr(args, "shared_prefix_tokens", 0):
        from laser.bench.workloads import with_shared_prefix

        reqs = with_shared_prefix(reqs, args.shared_prefix_tokens, tokenizer, args.seed)
        desc["shared_prefix_tokens"] = args.shared_prefix_tokens
    kinds = getattr(args, "prefix_workload", None) or []
    if "multi-turn" in kinds:
        from laser.bench.prefix_workloads import multi_turn

        reqs = multi_turn(reqs, tokenizer, args.seed, args.conversations, min(3, args.max_turns), args.max_turns,
                          args.length_scale, max_model_len)
        desc["multi_turn"] = {"conversations": args.conversations, "max_turns": args.max_turns}
    if "few-shot" in kinds:
        from laser.bench.prefix_workloads import few_shot_code

        reqs = few_shot_code(reqs, tokenizer, args.few_shot_examples, max_model_len)
        desc["few_shot_examples"] = args.few_shot_examples
    if getattr(args, "cluster", None):
        from laser.bench.cluster import rescale_to_table1

        reqs, factors = rescale_to_table1(reqs, max_model_len)
        desc["lengths"] = "rescaled per class to the paper's Table 1 means"
        desc["rescale_factors"] = factors
    desc["seed"] = args.seed
    by: dict[str, list] = {}
    for r in reqs:
        by.setdefault(r.slo_class, []).append(r)
    desc["classes"] = {c: {"count": len(v), "mean_prompt_len": sum(r.prompt_len for r in v) / len(v),
                           "mean_output_len": sum(r.output_len for r in v) / len(v)} for c, v in sorted(by.items())}
    return reqs, times, desc


def calibrate_slos(args, targets, requests, tokenizer):
    from laser.bench.calibrate import calibrate, measure_target_isolated, paper_targets

    paper = paper_targets(args.slo_config)
    iso = None
    if args.slo_base == "measured":
        target = next(iter(targets.values()))
        src = {"engine": "measured on the engine", "sim": "simulated (latency model)",
               "client": f"measured on the server at {getattr(target, 'base_url', '')}"}[target.kind]
        iso = measure_target_isolated(target, requests, tokenizer, paper, args.seed, args.isolated_repeats,
                                      args.isolated_output_tokens, src)
    return calibrate(args.slo_base, args.slo_scale, paper, iso, args.tbt_multiple, args.ttft_multiple)


def _default_lm(args):
    """Roofline estimate of the served model on this kind of machine (when no profile exists)."""
    from laser.latency import AnalyticLatencyModel, ModelShape
    from laser.model.loader import load_config, resolve_model

    try:
        shape = ModelShape.from_hf_config(load_config(resolve_model(args.model)).hf_config.to_dict())
    except Exception:  # noqa: BLE001 - e.g. a remote server's model we do not have
        shape = ModelShape.preset("smollm2-135m")
    return AnalyticLatencyModel(shape, args.sim_hardware or "cpu-2core")


def _rate_range(args, targets, requests, slos, lm, mode, n_layers_blocks=None):
    if args.rate_range != "auto":
        lo, hi = _floats(args.rate_range)
        return lo, hi, "given"
    from laser.bench.runner import SimTarget, saturation_rate

    sim = next((t for t in targets.values() if t.kind == "sim"), None)
    if sim is None:
        pol = "sarathi"
        sim = SimTarget(pol, lm or _default_lm(args), config=_sched_config(args, pol))
    cap = saturation_rate(sim, requests, slos)
    return 0.1 * cap, cap, f"auto: 0.1-1.0x simulated saturation throughput {cap:.3g} req/s ({sim.label})"


def with_best_baseline(specs, searching: bool, auto: bool = True):
    """``specs`` plus :data:`~laser.bench.best.DEFAULT_BEST_BASELINE` (before laser) when
    they compare laser with no ``:best`` policy, ``auto`` is on and a goodput search runs.
    Raises ValueError for a ``:best`` policy without a goodput search."""
    from laser.bench.best import DEFAULT_BEST_BASELINE

    has_best = any(b == "best" for _, _, b in specs)
    if has_best and not searching:
        raise ValueError("a ':best' policy needs the goodput search (not --request-rate / a plain trace replay)")
    labels = [lb for lb, _, _ in specs]
    if not auto or has_best or not searching or "laser" not in labels or DEFAULT_BEST_BASELINE in labels:
        return list(specs)
    name = DEFAULT_BEST_BASELINE.partition(":")[0]
    out = list(specs)
    out.insert(labels.index("laser"), (DEFAULT_BEST_BASELINE, name, "best"))
    return out


# -------------------------------------------------------------------------------------- run


def check_flags(args, search: bool) -> None:
    """Refuse flags this run would otherwise ignore, and malformed sweep lists, before anything
    runs. ``search``: whether the goodput search runs (no ``--request-rate``, no plain trace
    replay). Raises ValueError naming the flag."""
    cluster = getattr(args, "cluster", None)
    sweeps = {"--sweep-slo-scale": args.sweep_slo_scale, "--sweep-mix": args.sweep_mix,
              "--sweep-cluster": args.sweep_cluster}
    for flag, value in sweeps.items():
        if value is not None and not search:
            raise ValueError(f"{flag} needs the goodput search (not --request-rate / a plain trace replay)")
    if args.sweep_cluster is not None and not cluster:
        raise ValueError("--sweep-cluster needs --cluster (the cluster it resizes)")
    if not cluster:
        for flag, value in (("--controller", args.controller), ("--sim-tp", args.sim_tp)):
            if value is not None:
                raise ValueError(f"{flag} applies to a simulated cluster only: add --sim --cluster (e.g. 2P2D)")
    for flag in ("--sweep-slo-scale", "--sweep-cluster"):
        if sweeps[flag] is None:
            continue
        try:
            values = _floats(sweeps[flag])
        except ValueError:
            values = []
        if not values or not all(v > 0 for v in values):
            raise ValueError(f"{flag} wants a comma list of positive numbers, got {sweeps[flag]!r}")
    if args.sweep_mix is not None:
        for m in args.sweep_mix.split(","):
            parse_mix(m.strip())  # MixError (a ValueError) naming the bad mix
