"""Flags of ``laser bench`` (the command itself: :mod:`laser.bench.cli`)."""

from __future__ import annotations

import argparse
import math

DEFAULT_POLICIES = "vllm,sarathi,laser"  # sarathi:best is added (see --no-auto-best)
DEFAULT_SLO_SCALES = "0.8,0.9,1.0,1.1,1.2,1.3"
DEFAULT_MIXES = "1:1:1,2:1:1,4:2:1,1:2:1,1:1:2"


def _rate(s: str) -> float:
    v = float(s)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"rate must be > 0, got {s}")
    return v


class MixError(argparse.ArgumentTypeError, ValueError):
    """A ``--mix`` value is not three non-negative weights."""


def parse_mix(s: str) -> tuple[float, float, float]:
    """``"4:2:1"`` -> (4.0, 2.0, 1.0) (chat:code:summarization). Raises MixError (a ValueError)."""
    try:
        parts = tuple(float(x) for x in s.split(":"))
    except ValueError:
        raise MixError(f"bad mix {s!r}: want ratios like 1:1:1 (chat:code:summarization)") from None
    if len(parts) != 3 or any(p < 0 or not math.isfinite(p) for p in parts) or sum(parts) <= 0:
        raise MixError(f"bad mix {s!r}: want three non-negative ratios (chat:code:summarization), not all 0")
    return parts  # type: ignore[return-value]


def parse_extra_body(s: str) -> dict:
    """``--extra-body``: a JSON object merged into every request body the client sends (e.g.
    ``'{"cache_prompt": false}'`` for llama.cpp's server). Raises ArgumentTypeError otherwise."""
    import json

    try:
        v = json.loads(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--extra-body is not JSON ({e}): {s!r}") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError(f"--extra-body must be a JSON object, got {type(v).__name__}: {s!r}")
    return v


def sim_hardware_name(s: str) -> str:
    """argparse type of ``--sim-hardware``: the ``laser.latency.HARDWARE`` entry a name or alias
    (``a100``, ``h100``) denotes. Raises ArgumentTypeError listing the known names."""
    from laser.latency import HARDWARE
    from laser.sim.cluster import hardware_name

    name = hardware_name(s)
    if name not in HARDWARE:
        raise argparse.ArgumentTypeError(f"unknown hardware {s!r}; known: {', '.join(sorted(HARDWARE))} "
                                         "(aliases a100, h100)")
    return name


def sim_model_name(s: str) -> str:
    """argparse type of ``--sim-model``: a ``laser.latency.MODEL_SHAPES`` entry (any case).
    Raises ArgumentTypeError listing the known names."""
    from laser.latency import MODEL_SHAPES

    if s.lower() not in MODEL_SHAPES:
        raise argparse.ArgumentTypeError(f"unknown model shape {s!r}; known: {', '.join(sorted(MODEL_SHAPES))}")
    return s.lower()


def add_sim_model_arg(p) -> None:
    """``--sim-model`` (a paper-scale model shape, :func:`sim_model_name`), as ``laser bench``
    and ``laser plan`` take it."""
    p.add_argument("--sim-model", type=sim_model_name, default="qwen2.5-14b",
                   help="paper-scale model shape (qwen2.5-14b/32b, llama-3-70b; default %(default)s)")


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def rate_range(s: str) -> str:
    """argparse type of ``--rate-range``: ``auto`` or ``LO,HI`` req/s with ``0 < LO <= HI < inf``
    (checked when the flags are parsed, not after the targets were built). Returns ``s``."""
    if s == "auto":
        return s
    try:
        lo, hi = _floats(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"want 'auto' or LO,HI req/s (e.g. 0.15,1.2), got {s!r}") from None
    if not (0 < lo <= hi < math.inf):
        raise argparse.ArgumentTypeError(f"want 0 < LO <= HI < inf req/s, got {s!r}")
    return s


def _readable_file(s: str) -> str:
    """argparse type: the path of an existing file (``--trace``). Returns ``s``."""
    import os

    if not os.path.isfile(s):
        raise argparse.ArgumentTypeError(f"no such file: {s!r}")
    return s


def register(subparsers) -> None:
    """Add the ``bench`` subcommand (called by ``laser.cli.main``)."""
    from laser.bench.best import DEFAULT_BEST_BASELINE, DEFAULT_BEST_BUDGETS
    from laser.bench.goodput import DEFAULT_MAX_DOUBLINGS
    from laser.bench.calibrate import DEFAULT_TBT_MULTIPLE, DEFAULT_TTFT_MULTIPLE
    from laser.cli import (add_engine_args, fraction, int_at_least, non_negative_float, non_negative_int, positive_float,
                           positive_int)

    p = subparsers.add_parser(
        "bench", help="multi-SLO serving benchmark: SLO attainment and goodput per policy",
        description="Multi-SLO serving benchmark: per policy, SLO attainment at a request rate and goodput (the "
                    "highest rate at which --attainment-target of the requests meet their SLOs), on in-process "
                    "engines, an OpenAI-compatible server (--base-url) or SIMULATED (--sim, --cluster).")
    add_engine_args(p, policy_default=DEFAULT_POLICIES)
    for act in p._actions:
        if act.dest == "policy":
            act.type = None  # a comma list, checked by laser.bench.cli.parse_policies
            act.help = "comma list of policies to compare, as --policies (default %(default)s)"
    p.add_argument("--policies", dest="policy",
                   help="comma list of policies (same as --policy), e.g. vllm,sarathi,laser; 'name:N' sets its "
                        "token budget (max_num_batched_tokens) to N, 'name:auto' to Sarathi-Serve's TBT-sized budget, "
                        "'name:best' to the best of --best-budgets on this workload (default %s, plus %s beside laser: "
                        "see --no-auto-best)" % (DEFAULT_POLICIES, DEFAULT_BEST_BASELINE))
    p.add_argument("--best-budgets", default=",".join(map(str, DEFAULT_BEST_BUDGETS)),
                   help="token budgets a 'name:best' policy tries (default %(default)s)")
    p.add_argument("--no-auto-best", action="store_true",
                   help=f"do not add {DEFAULT_BEST_BASELINE} to a comparison with laser that has no ':best' policy")
    p.add_argument("--disaggregated", action="store_true",
                   help="a prefill+decode instance pair per policy (default: one mixed instance)")
    p.add_argument("--max-model-len", type=positive_int, default=None,
                   help="cap prompt+output length, tokens (default: the engine's context)")

    w = p.add_argument_group("workload")
    w.add_argument("--mix", type=parse_mix, default=(1.0, 1.0, 1.0),
                   help="chat:code:summarization ratios (default 1:1:1)")
    w.add_argument("--num-prompts", type=positive_int, default=None, help="requests per run (default 100; a trace: all rows)")
    w.add_argument("--length-scale", type=positive_float, default=1.0,
                   help="multiply prompt and output lengths (default %(default)s)")
    w.add_argument("--seed", type=int, default=0, help="workload and arrival seed (default %(default)s)")
    w.add_argument("--trace", type=_readable_file, default=None,
                   help="replay a trace CSV (Laser, vidur splitwise or Azure format; default: none, the --mix "
                        "workload)")
    w.add_argument("--trace-class", default=None,
                   help="SLO class of every trace row (default: the row's slo_class column; class-less formats: the "
                        "class the file name says)")
    w.add_argument("--tokenizer", default=None, help="tokenizer dir for prompt lengths (default: --model's)")
    w.add_argument("--shared-prefix-tokens", type=non_negative_int, default=0,
                   help="put one system prompt of about this many tokens in front of every request (the prefix "
                        "cache's workload; each probe starts with a cold cache; default 0: none)")
    w.add_argument("--prefix-workload", choices=["multi-turn", "few-shot"], action="append", default=[],
                   help="prefix-sharing workload (repeatable): multi-turn = chat requests become turns of ShareGPT "
                        "conversations, each resending the conversation so far; few-shot = every code request "
                        "behind the same solved HumanEval examples (see laser/bench/prefix_workloads.py; default: none)")
    w.add_argument("--conversations", type=positive_int, default=4,
                   help="multi-turn: conversations open at once, their turns interleaved (default %(default)s)")
    w.add_argument("--max-turns", type=positive_int, default=6,
                   help="multi-turn: turns per conversation at most (default %(default)s)")
    w.add_argument("--few-shot-examples", type=positive_int, default=8,
                   help="few-shot: solved examples in front of every code prompt (default %(default)s)")

    a = p.add_argument_group("arrivals and goodput search")
    a.add_argument("--request-rate", type=_rate, default=None,
                   help="one run per target at this rate (req/s, 'inf' = all at once); default: goodput search")
    a.add_argument("--burstiness", type=positive_float, default=1.0,
                   help="Gamma shape of the gaps between arrivals (default %(default)s: Poisson)")
    a.add_argument("--goodput", action="store_true",
                   help="goodput search even with --trace (rescaled to each rate; default: a trace replays its own "
                        "times)")
    a.add_argument("--rate-range", type=rate_range, default="auto",
                   help="LO,HI req/s of the search grid (default auto: 0.1-1.0x the simulated saturation throughput)")
    a.add_argument("--grid-points", type=positive_int, default=None, help="grid rates (default 4; sim 8)")
    a.add_argument("--bisect-steps", type=non_negative_int, default=None, help="bisection rounds after the grid (default 2; sim 6)")
    a.add_argument("--max-doublings", type=non_negative_int, default=DEFAULT_MAX_DOUBLINGS,
                   help="doublings (halvings) of the rate past the grid until a policy fails (passes) a probe "
                        "(default %(default)s)")
    a.add_argument("--search-time-cap", type=positive_float, default=None,
                   help="wall seconds after which the goodput search starts no probe; a policy that has not "
                        "failed a probe by then is reported as '>=' with the cap (default: 3600; sim 900)")
    a.add_argument("--full-grid", action="store_true", help="run every grid rate even after two failures in a row")
    a.add_argument("--attainment-target", type=fraction, default=0.9,
                   help="fraction of requests meeting their SLO at which a rate counts as goodput "
                        "(default %(default)s, as the paper)")
    a.add_argument("--probe-timeout", type=non_negative_float, default=None,
                   help="seconds a run may go on after its last arrival; unfinished = missed (default 60; sim none)")
    a.add_argument("--no-early-stop", action="store_true",
                   help="run every probe to the end (default: stop a real-time probe once it certainly fails; "
                        "goodput is the same, its attainment is then a lower bound)")
    a.add_argument("--report-rate", type=_rate, default=None,
                   help="rate for the TTFT/attainment columns (default: highest common rate <= best baseline goodput)")

    s = p.add_argument_group("SLO targets")
    s.add_argument("--slo-base", choices=["paper", "measured"], default="paper",
                   help="paper targets, or scaled to this target's isolated latency (see laser/bench/calibrate.py; "
                        "default %(default)s)")
    s.add_argument("--tbt-multiple", type=positive_float, default=DEFAULT_TBT_MULTIPLE,
                   help="measured base: tightest TBT = this x isolated decode step (default %(default)s)")
    s.add_argument("--ttft-multiple", type=positive_float, default=DEFAULT_TTFT_MULTIPLE,
                   help="measured base: every TTFT >= this x its class's isolated prefill (default %(default)s)")
    s.add_argument("--isolated-repeats", type=positive_int, default=3,
                   help="measured base: runs of each class's request alone, their median used (default %(default)s)")
    s.add_argument("--isolated-output-tokens", type=int_at_least(2), default=16,
                   help="measured base: output tokens of each request run alone, at least 2 (default %(default)s)")

    t = p.add_argument_group("client and simulator")
    t.add_argument("--base-url", default=None,
                   help="benchmark the OpenAI-compatible server at this URL (default: none, in-process engines)")
    t.add_argument("--endpoint", default="/v1/completions",
                   help="/v1/completions or /v1/chat/completions (default %(default)s)")
    t.add_argument("--served-model-name", default=None, help="'model' field (default: the server's first model)")
    t.add_argument("--api-key", default=None, help="Bearer token sent to --base-url (default: none)")
    t.add_argument("--max-concurrency", type=positive_int, default=None,
                   help="requests in flight at most against --base-url (default: no limit)")
    t.add_argument("--label", default=None, help="name of the server in outputs (default 'server')")
    t.add_argument("--extra-body", type=parse_extra_body, default=None,
                   help="JSON object merged into every request body, for server-specific fields "
                        "(e.g. '{\"cache_prompt\": false}' for llama-server; default: none)")
    t.add_argument("--sim", action="store_true", help="SIMULATED: the schedulers on a latency model in virtual time")
    t.add_argument("--sim-latency", choices=["auto", "profile", "analytic"], default="auto",
                   help="simulator clock: profile (--latency-profile's fitted profile, or this setup's), analytic "
                        "(roofline estimate), auto (default: profile when one can be made, else analytic)")
    t.add_argument("--sim-hardware", type=sim_hardware_name, default=None,
                   help="hardware table entry for --sim-latency analytic and --cluster (default cpu-2core; with "
                        "--cluster a100)")
    b = p.add_argument_group("background batch job (cold tier, issue 14)")
    b.add_argument("--batch-requests", type=positive_int, default=None,
                   help="run each target at --request-rate alone and beside a batch job of this many requests "
                        "(default: no batch job)")
    b.add_argument("--batch-window", type=_rate, default=600.0,
                   help="the job's completion window, seconds (default %(default)s)")
    b.add_argument("--batch-concurrency", type=positive_int, default=8,
                   help="job requests in flight at most (engine/sim; default %(default)s)")
    b.add_argument("--batch-repeats", type=positive_int, default=1,
                   help="alone/with-job pairs per target, alternating (default %(default)s)")
    c = p.add_argument_group("simulated cluster (global controller, SIMULATED)")
    c.add_argument("--cluster", default=None,
                   help="simulate a cluster: 8P8D (prefill+decode instances) or 16M (mixed); needs --sim (default: "
                        "none)")
    c.add_argument("--controller", default=None,
                   help="comma list of controllers (laser, distserve, colocated, colocated-laser, round_robin); "
                        "default laser,distserve,colocated")
    add_sim_model_arg(c)
    c.add_argument("--sim-tp", type=positive_int, default=None, help="GPUs per instance (default as in the paper: 1/2/4)")
    c.add_argument("--msg-delay-ms", type=non_negative_float, default=1.0,
                   help="controller<->instance message delay, ms (default %(default)s)")
    c.add_argument("--sweep-cluster", nargs="?", const="2,4,8,12,16", default=None,
                   help="goodput per cluster size in GPUs (default list 2,4,8,12,16), P:D split in half (default: off)")

    o = p.add_argument_group("output")
    o.add_argument("--json", default=None, help="write results JSON here (default: not written)")
    o.add_argument("--plots", default=None, help="write PNG plots into this directory (default: none)")
    o.add_argument("--sweep-slo-scale", nargs="?", const=DEFAULT_SLO_SCALES, default=None,
                   help=f"goodput per SLO scale (default list {DEFAULT_SLO_SCALES}; default: off)")
    o.add_argument("--sweep-mix", nargs="?", const=DEFAULT_MIXES, default=None,
                   help=f"goodput per mix (default list {DEFAULT_MIXES}; default: off)")
    o.add_argument("--no-progress", action="store_true", help="no progress bars (default: shown)")
    o.add_argument("--no-warmup", action="store_true",
                   help="skip the short warm-up requests sent to each engine or server before measuring")
    from laser.bench.command import cmd_bench

    p.set_defaults(func=cmd_bench)
