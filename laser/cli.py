"""Command line: ``laser generate | serve | profile | bench``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

# Transformers prints advisory warnings on import that are noise for a CLI user.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def int_at_least(lo: int):
    """An argparse type: an integer >= ``lo`` (raises ``argparse.ArgumentTypeError`` naming the bound)."""
    what = "a positive integer" if lo == 1 else f"an integer >= {lo}"

    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"expected {what}, got {v}")
        return v

    parse.__name__ = f"int_at_least_{lo}"
    return parse


#: argparse types: an integer >= 1, and >= 0.
positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def cpu_bind_arg(s: str) -> str:
    """argparse type of ``--cpu-bind``: ``auto``, ``none`` or a CPU list like ``0-3,6`` (checked
    against the allowed CPUs later, when the engine is built); raises ``argparse.ArgumentTypeError``."""
    from .core.config import ConfigError
    from .core.cpu_bind import MODES, parse_cpu_list

    if s in MODES:
        return s
    try:
        parse_cpu_list(s)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix(f"--cpu-bind {s!r}: ")) from None
    return s


def tcp_port(s: str) -> int:
    """argparse type: a TCP port number, 0-65535."""
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a TCP port (0-65535), got {s!r}") from None
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port (0-65535), got {v}")
    return v


def positive_float(s: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {s!r}") from None
    if not (v > 0 and v != float("inf")):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {s}")
    return v


def non_negative_float(s: str) -> float:
    """argparse type: a finite number >= 0."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {s!r}") from None
    if not (v >= 0 and v != float("inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {s}")
    return v


def fraction(s: str) -> float:
    """argparse type: a number in (0, 1] (a fraction of requests, a share of an iteration)."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {s!r}") from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {s}")
    return v


def policy_name(s: str) -> str:
    """argparse type: a registered scheduling policy (checked when the flags are parsed, not after
    the model has loaded and the latency model was profiled)."""
    from .scheduler import get_policy

    try:
        get_policy(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return s


def policy_names(s: str) -> str:
    """argparse type: a comma list of registered policies (``laser profile --policies``), each
    checked when the flags are parsed, not after minutes of profiling. Returns ``s``."""
    names = [x.strip() for x in s.split(",") if x.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected a comma list of policies, got {s!r}")
    for name in names:
        policy_name(name)
    return s


def add_engine_args(p: argparse.ArgumentParser, policy_default: str = "laser") -> None:
    """Flags shared by every command that builds an engine (``--policy``: one registered name;
    ``laser bench`` lifts that check for its comma lists)."""
    p.add_argument("--model", default=None,
                   help="HF checkpoint dir or GGUF file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="compute dtype (default auto: bfloat16 only on CPUs with native bf16 matmuls, "
                        "else float32)")
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"],
                   help="weight format of the linear layers (default auto: a GGUF file in its own quantization "
                        "-- 4-bit tensors int4, 5-8 bit int8, through torch's weight-only kernels --, a HF "
                        "checkpoint dense; none: dequantized to --dtype; int8 / int4: quantized at load)")
    p.add_argument("--policy", default=policy_default, type=policy_name,
                   help="scheduling policy: vllm, sarathi, laser (default %(default)s)")
    p.add_argument("--queue-order", default="edf", choices=["edf", "fcfs"],
                   help="waiting-queue order: earliest TTFT deadline first (default) or arrival order")
    p.add_argument("--best-effort-share", type=fraction, default=0.2,
                   help="laser: the most of an iteration with SLO work that best-effort work (no target) may "
                        "take, in (0, 1]; best effort slows down so interactive streams keep their pace "
                        "(default %(default)s; 1: best effort fills iterations up to the tightest TBT target, "
                        "the paper's rule)")
    p.add_argument("--kv-cache-gib", type=positive_float, default=1.0,
                   help="KV cache pool size, GiB over all layers (default %(default)s)")
    p.add_argument("--block-size", type=positive_int, default=16, help="KV cache block size, tokens (default 16)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of prompt blocks computed before (automatic prefix caching, vLLM's flag; "
                        "default on: --no-enable-prefix-caching switches it off)")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=512,
                   help="token budget per step, tokens (vLLM's max_num_batched_tokens; Sarathi's chunk budget; "
                        "default %(default)s)")
    p.add_argument("--max-num-seqs", type=positive_int, default=256,
                   help="most requests running at once (default %(default)s)")
    p.add_argument("--intermediate-cache-tokens", type=positive_int, default=16384,
                   help="capacity of the cache of paused hidden states, tokens (over it: recompute; "
                        "default %(default)s)")
    p.add_argument("--slo-config", default=None, help="SLO classes JSON (default: the shipped paper classes)")
    p.add_argument("--slo-scale", type=float, default=1.0, help="multiply every SLO target (default %(default)s)")
    p.add_argument("--default-slo-class", default="best_effort",
                   help="SLO class of requests that name none (default best_effort)")
    p.add_argument(
        "--latency-profile", default="auto",
        help="latency profile JSON (used as is; an error if it is unreadable or made for another setup; "
             "created there when missing); 'auto' (default): the cached profile of this setup, profiled "
             "on first use and re-made when stale",
    )
    p.add_argument("--no-latency-calibration", dest="latency_calibration", action="store_false",
                   help="plan with the profile's predictions as they are (default: scaled by how the "
                        "machine runs now, measured over the last steps; laser.latency.calibrated)")
    p.add_argument("--jitter-margin", action=argparse.BooleanOptionalAction, default=None,
                   help="with the calibration, divide Laser's planning margins (0.9 of T_g and of TTFT "
                        "targets) by the measured spread of slow steps (98th / 80th percentile of measured / "
                        "predicted step time, at most 1.5): fewer TBT misses on a jittery machine, less prefill "
                        "per iteration (default: on with the calibration; --no-jitter-margin: fixed margins)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch intra-op threads (default: the number of physical cores; with a --cpu-bind "
                        "list, those of its CPUs)")
    p.add_argument("--cpu-bind", type=cpu_bind_arg, default="none", metavar="auto|none|LIST",
                   help="bind the engine thread and its torch threads to CPUs: 'auto' (one logical CPU on each "
                        "of --threads physical cores, the front end on the CPUs left over), a list like 0-3,6 "
                        "(the front end on the allowed CPUs not listed), 'none' (default: the OS places threads; "
                        "vLLM's VLLM_CPU_OMP_THREADS_BIND)")
    s = p.add_argument_group("speculative decoding (greedy and sampled requests; every policy; on a cluster its "
                             "decode and mixed instances speculate)")
    s.add_argument("--speculative", default=None, choices=["self"],
                   help="'self': draft with the first layers and a trained exit head, verify with the rest "
                        "(lossless; exits from `laser train-exits`)")
    s.add_argument("--speculative-exit-layer", type=positive_int, default=None,
                   help="layers run before the draft exit (default: the one recommended when trained)")
    s.add_argument("--speculative-draft-tokens", type=positive_int, default=None,
                   help="tokens drafted per step (default: the one recommended when trained)")
    s.add_argument("--speculative-exits", default=None,
                   help="exit heads file (default: the model's, beside the model cache)")
    p.add_argument("--dynamic-depth", nargs="?", const="auto", default=None, metavar="EXITS",
                   help="serve lossy dynamic depth (opt-in per request, field dynamic_depth, or per SLO class, "
                        "entry \"dynamic_depth\" in --slo-config): greedy decode tokens may leave the model at "
                        "a trained exit; EXITS: an exit heads file (default: the model's, from `laser train-exits`)")


def engine_argv(args, **overrides) -> list[str]:
    """The engine flags of parsed ``args`` (any command's namespace holding :func:`add_engine_args`'
    destinations: ``laser bench``'s, ``laser profile``'s) written back as command-line flags, so a
    ``laser serve`` subprocess builds the engine an in-process one was built with. ``overrides``
    (destination -> value) replace values first. A flag whose value is its default, or absent from
    ``args``, is left out (the subprocess gets the same default). Raises ``ValueError`` for a value
    that has no flag spelling (e.g. a boolean flag given a non-boolean)."""
    p = argparse.ArgumentParser(add_help=False)
    add_engine_args(p)
    out: list[str] = []
    for act in p._actions:
        if not act.option_strings or act.dest not in overrides and not hasattr(args, act.dest):
            continue
        v = overrides[act.dest] if act.dest in overrides else getattr(args, act.dest)
        if v == act.default:
            continue
        flag = act.option_strings[0]
        if isinstance(act, argparse.BooleanOptionalAction):
            if v not in (True, False):
                raise ValueError(f"{flag} takes a boolean, got {v!r}")
            out.append(flag if v else "--no-" + flag[2:])
        elif isinstance(act, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            if v not in (True, False):
                raise ValueError(f"{flag} takes a boolean, got {v!r}")
            out.append(flag)  # (v differs from the default: the flag was given)
        elif act.nargs == "?" and v == act.const:
            out.append(flag)
        else:
            out += [flag, str(v)]
    return out


def set_threads(threads: int | None) -> int:
    """Set torch's intra-op threads to ``threads`` (default: physical cores; SMT siblings
    share one core's FMA units, so more threads only add contention). Returns the count.

    Raises:
        ConfigError: ``threads`` above the CPUs this process may run on (``os.sched_getaffinity``):
            the extra threads only wait for a CPU, and each thread count gets its own latency
            profile, made at the first start (minutes of oversubscribed timings).
    """
    import logging

    import torch

    from .core.config import ConfigError
    from .model.loader import physical_cores

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if threads and threads > usable:
        raise ConfigError(f"--threads {threads}: this process may run on {usable} CPUs; more threads than CPUs "
                          f"only wait for one (and would be profiled anew); use at most {usable}")
    n = threads or physical_cores()
    torch.set_num_threads(n)
    why = "--threads" if threads else "physical cores"
    if n > 1:  # README, "Latency model": its accuracy with several threads is the timings' own repeatability
        why += "; steps vary more between runs with several threads: --threads 1 for the tightest latency model"
    logging.getLogger(__name__).info("torch threads: %d (%s)", n, why)
    return n


def setup_cpus(args, binding="plan") -> int:
    """Bind (``--cpu-bind``, :mod:`laser.core.cpu_bind`) and set torch's threads (``--threads``,
    :func:`set_threads`) for an engine about to be built on the calling thread. ``binding``:
    ``"plan"`` (default, the in-process commands): planned from ``args`` here, and every thread of
    the process goes to the engine's CPUs; a :class:`~laser.core.cpu_bind.CpuBinding` or None
    planned by the caller (``laser serve``, whose front end is bound apart): only the calling
    thread is bound. Returns the thread count. Raises ConfigError (bad list, CPUs not allowed,
    more threads than CPUs)."""
    from .core.cpu_bind import bind_engine, engine_threads, plan_cpu_bind

    whole = isinstance(binding, str)
    if whole:
        binding = plan_cpu_bind(getattr(args, "cpu_bind", None), args.threads)
    bind_engine(binding, whole)
    return set_threads(engine_threads(binding, args.threads))


def engine_configs(args, role: str = "mixed"):
    """(CacheConfig, SchedulerConfig, SLOClasses) from parsed CLI flags."""
    from .core.config import CacheConfig, SchedulerConfig
    from .core.slo import SLOClasses

    cache = CacheConfig(
        block_size=args.block_size,
        kv_cache_gib=args.kv_cache_gib,
        intermediate_cache_tokens=args.intermediate_cache_tokens,
        enable_prefix_caching=getattr(args, "enable_prefix_caching", True),
    )
    sched = SchedulerConfig(
        policy=args.policy,
        queue_order=args.queue_order,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        best_effort_share=args.best_effort_share,
        role=role,
    )
    return cache, sched, SLOClasses.load(args.slo_config, scale=args.slo_scale, default=args.default_slo_class)


def build_engine(args, cpu_binding="plan", **overrides):
    """An :class:`Engine` from parsed CLI flags, built on the calling thread after
    :func:`setup_cpus` (``cpu_binding``: its ``binding``)."""
    from .frontend.engine import Engine

    setup_cpus(args, cpu_binding)
    cache, sched, slo = engine_configs(args, overrides.pop("role", getattr(args, "role", "mixed")))
    return Engine(
        model=args.model,
        policy=args.policy,
        dtype=args.dtype,
        quantization=args.quantization,
        cache=cache,
        scheduler=sched,
        slo_classes=slo,
        latency_profile=args.latency_profile,
        latency_calibration=getattr(args, "latency_calibration", True),
        jitter_margin=getattr(args, "jitter_margin", None),
        speculative=speculative_config(args),
        exits=getattr(args, "dynamic_depth", None),
        **overrides,
    )


def speculative_config(args):
    """The :class:`laser.spec.SpeculativeConfig` of ``--speculative`` flags, None without them.
    Raises ConfigError for a ``--speculative-*`` option without ``--speculative self`` (it would
    be ignored)."""
    if getattr(args, "speculative", None) is None:
        given = [f for f, v in (("--speculative-exit-layer", getattr(args, "speculative_exit_layer", None)),
                                ("--speculative-draft-tokens", getattr(args, "speculative_draft_tokens", None)),
                                ("--speculative-exits", getattr(args, "speculative_exits", None))) if v is not None]
        if given:
            from .core.config import ConfigError

            raise ConfigError(f"{', '.join(given)} needs --speculative self")
        return None
    from .spec import SpeculativeConfig

    return SpeculativeConfig(args.speculative, args.speculative_exit_layer, args.speculative_draft_tokens,
                             args.speculative_exits)


DEFAULT_GENERATE_TOKENS = 128  # laser generate without --max-tokens: at most this many (fewer near the context's end)


def cmd_generate(args) -> int:
    """``laser generate``: one prompt, streamed to stdout, timing on stderr. Refused (``laser:
    error``, exit 2) as vLLM refuses them: an empty ``--prompt`` (before the model loads), and
    prompt plus an explicit ``--max-tokens`` past the model's context (the server's 400 rule,
    :meth:`~laser.frontend.inputs.InputProcessor.check_budget`); without ``--max-tokens`` the
    output is capped at :data:`DEFAULT_GENERATE_TOKENS` or the rest of the context."""
    import dataclasses

    from .core.request import InvalidRequestError, SamplingParams

    if not args.prompt:
        raise InvalidRequestError("--prompt is empty: give the text to complete (vLLM refuses an empty prompt too)")
    sp = SamplingParams(  # checked before the model loads (InvalidRequestError: laser: error)
        max_tokens=args.max_tokens or DEFAULT_GENERATE_TOKENS,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    t0 = time.perf_counter()
    engine = build_engine(args)
    load_s = time.perf_counter() - t0
    prompt = [{"role": "user", "content": args.prompt}] if not args.raw and engine.tokenizer.chat_template else args.prompt
    n_prompt = len(engine.inputs.tokenize(prompt))
    if args.max_tokens is None:
        sp = dataclasses.replace(sp, max_tokens=min(sp.max_tokens, engine.max_model_len - n_prompt))
    engine.inputs.check_budget(n_prompt, sp.max_tokens, "--max-tokens")
    req = engine.add_request(prompt, sp)
    t1 = time.perf_counter()
    text = ""
    while engine.has_unfinished():
        for out in engine.step():
            if out.req_id == req.req_id:
                sys.stdout.write(out.delta_text)
                sys.stdout.flush()
                text = out.text
    dt = time.perf_counter() - t1
    sys.stdout.write("\n")
    n = req.num_output_tokens
    print(
        f"[laser] {n} tokens in {dt:.2f} s ({n / dt:.1f} tok/s), TTFT {req.token_times[0] - req.arrival_time:.3f} s, "
        f"model load {load_s:.1f} s, policy {engine.scheduler.report().policy}, weights {engine.model.weights_tag}",
        file=sys.stderr,
    )
    return 0 if text is not None else 1


def build_parser() -> argparse.ArgumentParser:
    """The ``laser`` argument parser with every subcommand that imports here."""
    parser = argparse.ArgumentParser(prog="laser", description="Laser: layer-level multi-SLO LLM serving")
    sub = parser.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="complete one prompt and print it")
    add_engine_args(g)
    g.add_argument("--prompt", required=True,
                   help="the prompt (in the model's chat template, if it has one, unless --raw)")
    g.add_argument("--max-tokens", type=positive_int, default=None,
                   help=f"most tokens to generate; prompt plus these must fit the model's context (default "
                        f"{DEFAULT_GENERATE_TOKENS}, or the rest of the context when less)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1: off)")
    g.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens (default 0: off)")
    g.add_argument("--seed", type=int, default=None,
                   help="this request's own sampling seed (default: none: the engine's shared generator)")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.set_defaults(func=cmd_generate)

    for name, module in (("serve", "server.cli"), ("profile", "profiler.cli"), ("bench", "bench.args"), ("plan", "bench.plan"),
                         ("train-exits", "model.exits_cli")):
        try:
            mod = __import__(f"laser.{module}", fromlist=["register"])
        except ImportError:
            continue
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from .core.config import ConfigError
    from .latency import LatencyProfileError
    from .model.loader import ModelLoadError
    from .core.request import InvalidRequestError

    try:
        return args.func(args)
    except (ModelLoadError, ConfigError, InvalidRequestError, LatencyProfileError, ValueError) as e:
        print(f"laser: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
