"""Dynamic depth (issue 31): self-speculative decoding from trained early exits vs plain decoding.

On the embedded SmolLM2-135M (fp32) with the exits `laser train-exits` saved for it, for each
batch size and each (exit layer, draft length) setting: greedy decode tokens/s of plain
decoding and of self-speculation, measured interleaved (plain, spec, plain, spec, ...) on the
same held-out dataset prompts (ShareGPT + HumanEval, items the exits were not trained on), the
ratio of the two (median over rounds), the acceptance rate (accepted / drafted tokens) and the
tokens emitted per speculative step. Every spec run's tokens are checked equal to the plain run's
(the script exits 1 otherwise).

Decode tokens/s counts the tokens after each request's first one over the time from the step
where every request had its first token to the end (prefill excluded: both modes prefill alike).

Run from the repository root::

    laser train-exits                                   # once: exits beside the model cache
    python benchmarks/dynamic_depth.py                  # batch 1 and 4, the recommended setting
    python benchmarks/dynamic_depth.py --batch 1 4 16 --settings 8:2 8:3 12:3 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from laser.latency import cpu_hardware_string


def _decode(engine, prompts, max_tokens):
    """Greedy-generate; returns (token lists, decode seconds, decode tokens)."""
    from laser.core.request import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(p, sp) for p in prompts]
    while any(r.num_output_tokens == 0 for r in reqs):
        engine.step()
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    dt = time.perf_counter() - t0
    engine.check_integrity(expect_empty=True)
    return [list(r.output_token_ids) for r in reqs], dt, sum(r.num_output_tokens - 1 for r in reqs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--exits", default=None, help="exit heads file (default: the model's, beside the cache)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--settings", nargs="+", default=None,
                    help="exit_layer:draft_tokens pairs (default: the one recommended when trained)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved plain/spec rounds (default %(default)s)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt-offset", type=int, default=1000,
                    help="first dataset item of the prompts (training uses 0..prompts+eval)")
    args = ap.parse_args(argv)

    import torch

    from laser.frontend.engine import Engine
    from laser.model.exits import format_report, training_prompts
    from laser.spec.self_spec import SelfSpeculator, load_exits

    torch.set_num_threads(args.threads)
    engine = Engine(args.model, policy="vllm", dtype="float32", latency_calibration=False)
    heads = load_exits(engine.model_path, args.exits)
    if heads.report:
        print(format_report(heads.report))
    rec = heads.report.get("recommended", {})
    settings = [tuple(map(int, s.split(":"))) for s in args.settings] if args.settings else \
        [(rec["exit_layer"], rec["draft_tokens"])]
    prompts = training_prompts(engine.tokenizer, max(args.batch), offset=args.prompt_offset, max_prompt_tokens=96)
    runner = engine.runner
    cpu = cpu_hardware_string()
    print(f"\nCPU: {cpu}; torch threads {args.threads}; fp32; {args.max_tokens} greedy tokens per request; "
          f"{args.rounds} interleaved rounds (machine possibly shared: ratios are the robust figure)")
    print(f"{'batch':>5} {'exit':>4} {'draft':>5} {'plain tok/s':>11} {'spec tok/s':>10} {'ratio':>6} "
          f"{'accept':>6} {'tok/step':>8} {'same':>5}")
    ok = True
    for B in args.batch:
        ps = prompts[:B]
        for k, g in settings:
            spec = SelfSpeculator(runner, heads, k, g, engine.max_model_len)
            plain_r, spec_r, ratios = [], [], []
            same = True
            for _ in range(args.rounds):
                engine.core.executor = runner
                want, dt_p, n_p = _decode(engine, ps, args.max_tokens)
                engine.core.executor = spec
                got, dt_s, n_s = _decode(engine, ps, args.max_tokens)
                same &= got == want
                plain_r.append(n_p / dt_p)
                spec_r.append(n_s / dt_s)
                ratios.append((n_s / dt_s) / (n_p / dt_p))
            engine.core.executor = runner
            ok &= same
            st = spec.stats
            print(f"{B:>5} {k:>4} {g:>5} {statistics.median(plain_r):>11.1f} {statistics.median(spec_r):>10.1f} "
                  f"{statistics.median(ratios):>5.2f}x {st.acceptance:>6.1%} {st.tokens_per_step:>8.2f} "
                  f"{'yes' if same else 'NO':>5}")
    return 0 if ok else 1



if __name__ == "__main__":
    sys.exit(main())
