"""Dynamic depth (issue 31): self-speculative decoding from trained early exits vs plain decoding;
lossy early exit (``--pareto``, ``--goodput``).

On the embedded SmolLM2-135M (fp32) with the exits `laser train-exits` saved for it, for each
batch size and each (exit layer, draft length) setting: greedy decode tokens/s of plain
decoding and of self-speculation, measured interleaved (plain, spec, plain, spec, ...) on the
same held-out dataset prompts (ShareGPT + HumanEval, items the exits were not trained on), the
ratio of the two (median over rounds), the acceptance rate (accepted / drafted tokens) and the
tokens emitted per speculative step. Every spec run's tokens are checked equal to the plain run's
(the script exits 1 otherwise).

Decode tokens/s counts the tokens after each request's first one over the time from the step
where every request had its first token to the end (prefill excluded: both modes prefill alike).

Lossy dynamic depth (``--pareto``; laser.core.depth): the same held-out prompts generated greedily
at full depth and, for each confidence threshold, with early exit (min depth: a quarter of the
layers unless ``--min-depth``). Per threshold: mean depth (layers run per decode token, as a
fraction of N), greedy agreement (decode tokens equal to the full model's greedy token *given the
same lossy prefix*: one teacher-forced full-depth pass over each lossy sequence), the continuations
identical to the full-depth ones, perplexity of the generated decode tokens under the full model
(the full-depth row: the full model's own greedy text), and decode tok/s vs full depth (interleaved).

``--goodput``: a mixed chat + code workload on the simulator (``laser.sim``: the engine's walker and
Laser scheduler in virtual time, priced by the engine's latency model -- its cached profile of this
machine when there is one, else the analytic estimate; printed), where the chat class opts in with
the exit depths measured by ``--pareto`` at the operating threshold (the loosest one with >= 95 %
agreement, or ``--goodput-threshold``) vs the same workload without opt-in: SLO attainment per
class and goodput (requests meeting their SLO per second) at each arrival rate.

Run from the repository root::

    laser train-exits                                   # once: exits beside the model cache
    python benchmarks/dynamic_depth.py                  # batch 1 and 4, the recommended setting
    python benchmarks/dynamic_depth.py --batch 1 4 16 --settings 8:2 8:3 12:3 --rounds 3
    python benchmarks/dynamic_depth.py --pareto --goodput --thresholds 0.5 0.8 0.9 0.95 0.99
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from laser.latency import cpu_hardware_string


def _decode(engine, prompts, max_tokens, temperature=0.0):
    """Generate (greedy, or sampled at ``temperature`` with a seed per prompt); returns (token
    lists, decode seconds, decode tokens)."""
    from laser.core.request import SamplingParams

    reqs = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True,
                                                 seed=i if temperature > 0 else None))
            for i, p in enumerate(prompts)]
    while any(r.num_output_tokens == 0 for r in reqs):
        engine.step()
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    dt = time.perf_counter() - t0
    engine.check_integrity(expect_empty=True)
    return [list(r.output_token_ids) for r in reqs], dt, sum(r.num_output_tokens - 1 for r in reqs)


def _generate(engine, prompts, max_tokens, dd=None):
    """Greedy-generate (``dd``: dynamic depth or None). Returns (requests, decode seconds, the
    layers each decode token ran: a list per request)."""
    from laser.core.request import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, dynamic_depth=dd)
    reqs = [engine.add_request(p, sp) for p in prompts]
    depths = [[] for _ in reqs]
    seen = [(0, 0)] * len(reqs)
    t0 = None
    while engine.has_unfinished():
        if t0 is None and all(r.num_output_tokens for r in reqs):
            t0 = time.perf_counter()
        engine.step()
        for i, r in enumerate(reqs):
            if r.num_depth_tokens > seen[i][0]:
                depths[i].append(r.depth_layers - seen[i][1])
                seen[i] = (r.num_depth_tokens, r.depth_layers)
    dt = time.perf_counter() - (t0 or time.perf_counter())
    engine.check_integrity(expect_empty=True)  # no K/V slot left unwritten by the exits
    return reqs, dt, depths


def _judge(engine, req):
    """Teacher-forced full-depth pass over ``req``'s prompt + output: (agreeing decode tokens,
    decode tokens, their negative log-likelihood sum under the full model)."""
    import torch

    from laser.model.exits import collect_hidden

    toks = list(req.prompt_token_ids) + list(req.output_token_ids)
    p = req.num_prompt_tokens
    _, fin = collect_hidden(engine.runner, toks[:-1], [])
    with torch.inference_mode():
        logits = engine.model.compute_logits(fin[p:].to(engine.model.dtype))  # rows predicting tokens p+1..
    target = torch.tensor(toks[p + 1:])
    agree = int((logits.argmax(-1) == target).sum())
    nll = float(-torch.log_softmax(logits, -1).gather(1, target[:, None]).sum())
    return agree, len(target), nll


def pareto(engine, heads, prompts, thresholds, max_tokens, min_depth):
    """The Pareto table of lossy early exit; returns its rows (dicts), the full-depth row first."""
    import math

    from laser.core.depth import DynamicDepth

    n = engine.model.config.num_layers
    rows = []
    ref, dt_ref, _ = _generate(engine, prompts, max_tokens)
    ref_out = [list(r.output_token_ids) for r in ref]
    judged = [_judge(engine, r) for r in ref]
    dec = sum(j[1] for j in judged)
    rows.append({"threshold": None, "depth": 1.0, "agreement": sum(j[0] for j in judged) / dec, "identical": len(ref),
                 "ppl": math.exp(sum(j[2] for j in judged) / dec), "speed": 1.0, "hist": {n: dec}})
    for thr in thresholds:
        dd = DynamicDepth(threshold=thr, min_depth=min_depth)
        _, dt_full, _ = _generate(engine, prompts, max_tokens)  # interleaved: full, lossy, full, lossy...
        reqs, dt, depths = _generate(engine, prompts, max_tokens, dd)
        judged = [_judge(engine, r) for r in reqs]
        dec = sum(j[1] for j in judged)
        flat = [d for ds in depths for d in ds]
        hist = {}
        for d in flat:
            hist[d] = hist.get(d, 0) + 1
        rows.append({"threshold": thr, "depth": sum(flat) / (len(flat) * n), "agreement": sum(j[0] for j in judged) / dec,
                     "identical": sum(list(r.output_token_ids) == o for r, o in zip(reqs, ref_out)),
                     "ppl": math.exp(sum(j[2] for j in judged) / dec), "speed": dt_full / dt if dt > 0 else float("nan"),
                     "hist": dict(sorted(hist.items()))})
    return rows


def print_pareto(rows, n, num_prompts, min_layers):
    print(f"\nLossy early exit: {num_prompts} held-out prompts, min depth {min_layers} of {n} layers")
    print(f"{'threshold':>9} {'mean depth':>10} {'agreement':>9} {'identical':>9} {'ppl (full)':>10} {'decode x':>8}"
          "  exits (layers: tokens)")
    for r in rows:
        thr = "full" if r["threshold"] is None else f"{r['threshold']:g}"
        print(f"{thr:>9} {r['depth']:>9.1%} {r['agreement']:>9.1%} {r['identical']:>6}/{num_prompts:<2} "
              f"{r['ppl']:>10.3f} {r['speed']:>7.2f}x  {r['hist']}")


def goodput(engine, heads, hist, rates, num_requests, slo_scale, length_scale, min_depth, seed=0):
    """Simulated goodput of a chat + code mix, chat opting in (exit depths drawn from ``hist``) or
    not. Returns [(rate, {"off"|"on": {class: (attainment, goodput)}})]."""
    import dataclasses

    from laser.bench.arrivals import arrival_times
    from laser.bench.workloads import HFTokenizer, sample_mix
    from laser.core.depth import DynamicDepth
    from laser.core.metrics import record_from_request, summarize
    from laser.core.request import Request, SamplingParams
    from laser.core.slo import SLOClasses
    from laser.sim.instance import SimDepth, SimInstance

    n = engine.model.config.num_layers
    cost = heads.cost(engine.model)  # what the engine's own plans price the exits with
    dm = SimDepth(tuple(sorted(hist.items())), cost.exit_layers, head_fraction=cost.head_fraction,
                  fill_fraction=cost.fill_fraction, seed=seed)
    classes = SLOClasses.load(scale=slo_scale)
    lm = engine.latency_model
    work = sample_mix({"chat": 1, "code": 1}, num_requests, seed=seed, length_scale=length_scale,
                      tokenizer=HFTokenizer(engine.tokenizer), max_model_len=engine.max_model_len)
    out = []
    for rate in rates:
        times = arrival_times(len(work), rate, seed=seed)
        res = {}
        for mode in ("off", "on"):
            sim = SimInstance("laser", n, lm, depth_model=dm, num_blocks=engine.kv_cache.num_blocks,
                              block_size=engine.kv_cache.block_size)
            reqs = []
            for i, (w, t) in enumerate(zip(work, times)):
                dd = DynamicDepth(min_depth=min_depth) if mode == "on" and w.slo_class == "chat" else None
                r = Request([1 + (i + k) % 1000 for k in range(w.prompt_len)],
                            SamplingParams(max_tokens=w.output_len, temperature=0.0, ignore_eos=True, dynamic_depth=dd),
                            classes.get(w.slo_class), arrival_time=float(t), req_id=f"r{i}")
                reqs.append(r)
                sim.submit(r)
            sim.run()
            sim.check_integrity(expect_empty=True)
            dur = max(r.finish_time for r in reqs) - min(r.arrival_time for r in reqs)
            summ = summarize([record_from_request(r) for r in reqs], dur)
            res[mode] = {c: (s.attainment, s.slo_met / dur) for c, s in summ.per_class.items()}
            res[mode]["all"] = (summ.overall.attainment, summ.overall.slo_met / dur)
        out.append((rate, res))
    return out, dm, lm


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--exits", default=None, help="exit heads file (default: the model's, beside the cache)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--settings", nargs="+", default=None,
                    help="exit_layer:draft_tokens pairs (default: the one recommended when trained)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampled requests (seeded; speculative sampling's rejection rule): the 'same' column is "
                         "then n/a, the distribution is what tests/spec/test_spec_sampling.py checks")
    ap.add_argument("--policy", default="vllm", help="scheduling policy of the engine (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved plain/spec rounds (default %(default)s)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"],
                    help="weights as served (default %(default)s: the GGUF's own precision; quantized kernels "
                         "pick their path by row count, so a verify chunk and a plain decode step can round "
                         "differently: use none for bit-identical output)")
    ap.add_argument("--prompt-offset", type=int, default=1000,
                    help="first dataset item of the prompts (training uses 0..prompts+eval)")
    ap.add_argument("--pareto", action="store_true", help="lossy early exit: depth / agreement / perplexity table")
    ap.add_argument("--goodput", action="store_true",
                    help="lossy early exit: simulated goodput of a chat + code mix, chat opting in vs not")
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0.5, 0.7, 0.8, 0.9, 0.95, 0.99])
    ap.add_argument("--min-depth", type=int, default=None, help="lossy: layers before any exit (default N/4)")
    ap.add_argument("--prompts", type=int, default=16, help="lossy: held-out prompts (default %(default)s)")
    ap.add_argument("--goodput-threshold", type=float, default=None,
                    help="the threshold whose measured exit depths the goodput run uses (default: the loosest "
                         "with >= 95%% agreement, else the strictest measured)")
    ap.add_argument("--histogram", default=None,
                    help="goodput without --pareto: the exit depths to draw from, as layers:tokens pairs "
                         "(e.g. '8:46,12:19,30:300', a --pareto row's exits column)")
    ap.add_argument("--rates", type=float, nargs="+", default=[0.2, 0.3, 0.4, 0.5],
                    help="goodput: arrival rates, requests/s of the simulated workload")
    ap.add_argument("--requests", type=int, default=120, help="goodput: requests per run (default %(default)s)")
    ap.add_argument("--slo-scale", type=float, default=4.0,
                    help="goodput: SLO targets x this (default %(default)s: the code class's 50 ms TBT is about one "
                         "decode iteration of the embedded model alone on a 2-core CPU)")
    ap.add_argument("--length-scale", type=float, default=0.5, help="goodput: prompt and output lengths x this")
    args = ap.parse_args(argv)
    if args.pareto or args.goodput:
        return main_lossy(args)

    import torch

    from laser.frontend.engine import Engine
    from laser.model.exits import format_report, training_prompts
    from laser.spec.self_spec import SelfSpeculator, load_exits

    torch.set_num_threads(args.threads)
    engine = Engine(args.model, policy=args.policy, dtype="float32", latency_calibration=False,
                    quantization=args.quantization)
    heads = load_exits(engine.model_path, args.exits)
    if heads.report:
        print(format_report(heads.report))
    rec = heads.report.get("recommended", {})
    settings = [tuple(map(int, s.split(":"))) for s in args.settings] if args.settings else \
        [(rec["exit_layer"], rec["draft_tokens"])]
    prompts = training_prompts(engine.tokenizer, max(args.batch), offset=args.prompt_offset, max_prompt_tokens=96)
    runner = engine.runner
    cpu = cpu_hardware_string()
    kind = "greedy" if args.temperature <= 0 else f"sampled (temperature {args.temperature})"
    print(f"\nCPU: {cpu}; torch threads {args.threads}; fp32; weights {args.quantization}; policy {args.policy}; "
          f"{args.max_tokens} {kind} tokens "
          f"per request; "
          f"{args.rounds} interleaved rounds (machine possibly shared: ratios are the robust figure)")
    print(f"{'batch':>5} {'exit':>4} {'draft':>5} {'plain tok/s':>11} {'spec tok/s':>10} {'ratio':>6} "
          f"{'accept':>6} {'tok/step':>8} {'same':>5}")
    ok = True
    for B in args.batch:
        ps = prompts[:B]
        for k, g in settings:
            spec = SelfSpeculator(runner, heads, k, g, engine.max_model_len)
            engine.scheduler.speculation = spec.shape  # (the laser policy prices the speculative steps)
            plain_r, spec_r, ratios = [], [], []
            same = True
            for _ in range(args.rounds):
                engine.core.executor = runner
                engine.scheduler.speculation = None
                want, dt_p, n_p = _decode(engine, ps, args.max_tokens, args.temperature)
                engine.core.executor = spec
                engine.scheduler.speculation = spec.shape
                got, dt_s, n_s = _decode(engine, ps, args.max_tokens, args.temperature)
                same &= got == want or args.temperature > 0
                plain_r.append(n_p / dt_p)
                spec_r.append(n_s / dt_s)
                ratios.append((n_s / dt_s) / (n_p / dt_p))
            engine.core.executor = runner
            engine.scheduler.speculation = None
            ok &= same
            st = spec.stats
            print(f"{B:>5} {k:>4} {g:>5} {statistics.median(plain_r):>11.1f} {statistics.median(spec_r):>10.1f} "
                  f"{statistics.median(ratios):>5.2f}x {st.acceptance:>6.1%} {st.tokens_per_step:>8.2f} "
                  f"{'n/a' if args.temperature > 0 else 'yes' if same else 'NO':>5}")
    return 0 if ok else 1


def main_lossy(args) -> int:
    import torch

    from laser.frontend.engine import Engine
    from laser.model.exits import training_prompts
    from laser.spec.self_spec import load_exits

    from laser.model.loader import resolve_model

    torch.set_num_threads(args.threads)
    heads = load_exits(resolve_model(args.model), args.exits)
    engine = Engine(args.model, policy="vllm", dtype="float32", latency_calibration=False, exits=heads,
                    quantization=args.quantization)
    n = engine.model.config.num_layers
    from laser.core.depth import DynamicDepth

    min_layers = DynamicDepth(min_depth=args.min_depth).min_layers(n)
    print(f"CPU: {cpu_hardware_string()}; torch threads {args.threads}; fp32; exits after layers {heads.depths} "
          f"(draft vocabulary {heads.vocab.numel()}); {args.max_tokens} greedy tokens per request "
          "(machine possibly shared: the decode x column is a ratio of interleaved runs)")
    if args.histogram and not args.pareto:
        hist = {int(a): float(b) for a, b in (x.split(":") for x in args.histogram.split(","))}
        depth = sum(d * w for d, w in hist.items()) / (sum(hist.values()) * n)
        return print_goodput(args, engine, heads, {"threshold": None, "hist": hist, "depth": depth})
    prompts = training_prompts(engine.tokenizer, args.prompts, offset=args.prompt_offset, max_prompt_tokens=96)
    rows = pareto(engine, heads, prompts, args.thresholds, args.max_tokens, args.min_depth)
    print_pareto(rows, n, len(prompts), min_layers)
    ok = [r for r in rows[1:] if r["agreement"] >= 0.95]
    best = min(ok, key=lambda r: r["depth"]) if ok else None
    if best is not None and best["depth"] <= 0.6:
        print(f"target met: mean depth {best['depth']:.1%} <= 60 % at {best['agreement']:.1%} agreement "
              f"(threshold {best['threshold']:g})")
    else:
        print("target (mean depth <= 60 % at >= 95 % agreement) not met: "
              + (f"at >= 95 % agreement the shallowest is {best['depth']:.1%} (threshold {best['threshold']:g})"
                 if best else f"no threshold reaches 95 % agreement (best {max(r['agreement'] for r in rows[1:]):.1%})"))
    if args.goodput:
        pick = ([r for r in rows[1:] if r["threshold"] == args.goodput_threshold] if args.goodput_threshold
                else ([max(ok, key=lambda r: -r["threshold"])] if ok else [max(rows[1:], key=lambda r: r["threshold"])]))
        if not pick:
            print(f"--goodput-threshold {args.goodput_threshold} was not measured (--thresholds)")
            return 2
        return print_goodput(args, engine, heads, pick[0])
    return 0


def print_goodput(args, engine, heads, op) -> int:
    """Run :func:`goodput` for operating point ``op`` (a --pareto row) and print the table."""
    res, dm, lm = goodput(engine, heads, op["hist"], args.rates, args.requests, args.slo_scale, args.length_scale,
                          args.min_depth)
    print(f"\nGoodput [SIMULATED: laser policy in virtual time, latency model {type(lm).__name__}"
          f"{' (' + lm.source + ')' if hasattr(lm, 'source') else ''}]; chat opts in with the exit depths "
          f"measured at threshold {op['threshold']} (mean {op['depth']:.1%} of the layers; exit-head check "
          f"{dm.head_fraction:.2f} of the LM head per row, K/V fill {dm.fill_fraction:.3f} of a layer per skipped "
          f"layer); {args.requests} requests chat:code 1:1, lengths x{args.length_scale}, SLO x{args.slo_scale}")
    print(f"{'rate/s':>6} {'class':>5} {'attain off':>10} {'attain on':>9} {'goodput off':>11} {'goodput on':>10} "
          f"{'gain':>6}")
    for rate, r in res:
        for c in ("chat", "code", "all"):
            a0, g0 = r["off"].get(c, (None, 0.0))
            a1, g1 = r["on"].get(c, (None, 0.0))
            print(f"{rate:>6g} {c:>5} {a0:>10.1%} {a1:>9.1%} {g0:>11.2f} {g1:>10.2f} "
                  f"{(g1 / g0 if g0 else float('nan')):>5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
