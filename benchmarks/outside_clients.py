"""Outside clients against ``laser serve``: lm-eval and aiperf, installed from the package index
into their own environment and run offline (issue 30 item 7; logic in laser/bench/outside.py).

1. The client environment ``<laser cache>/clients-venv`` is created once (reused when its pins
   match): CPU ``torch==2.13.0`` first (a bare ``torch`` pulls the CUDA build), then
   ``lm-eval[api,hf]==0.4.13`` and ``aiperf==0.13.0``.
2. ``laser serve`` starts on the embedded SmolLM2 in float32 with ``--quantization none`` (prefix cache
   off: aiperf's synthetic prompts share prefixes, laser bench's do not), so its
   weights equal the Hugging Face folder that loading the GGUF wrote under the Laser cache (config,
   float32 safetensors, tokenizer): the clients' tokenizer and lm-eval's ``hf`` model.
3. lm-eval: two local tasks made from HumanEval (a 4-way multiple choice scored by loglikelihood --
   the true next line of a solution among lines of other solutions -- and a greedy generation of a
   solution's first line, exact match) through the server (``local-completions``: echo + logprobs)
   and through lm-eval's own ``hf`` backend on the same weights (float32, CPU), both with
   ``--log_samples``; the table compares accuracy, the per-choice loglikelihoods and the
   generations item by item.
4. aiperf: a fixed-length streaming load (``--requests`` at ``--concurrency``, ``--input-tokens`` /
   ``--output-tokens``, ``ignore_eos``) against the server, and ``laser bench --base-url`` on the
   same load (a trace of the same lengths, ``--max-concurrency``); TTFT and ITL (mean, P99) side by
   side, and the goodput judged by aiperf (each request's mean ITL) beside Laser's (its P99 gap).

    python benchmarks/outside_clients.py [--skip-lm-eval] [--skip-aiperf] [--json out.json]

Defaults finish in about 10-15 minutes on 2 cores (the environment's first install aside).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from laser.bench import outside
from laser.bench.arrivals import write_trace
from laser.bench.serve_proc import Server, free_port
from laser.latency import cpu_hardware_string
from laser.model.loader import cache_dir, resolve_model

MODEL_NAME = "smollm2"


def ensure_venv(venv: Path) -> Path:
    """Create the client environment unless it is complete with the current pins."""
    if outside.venv_ready(venv):
        print(f"client environment: {venv} (reused)")
        return venv
    print(f"client environment: installing into {venv} (once)")
    for cmd in outside.venv_install_commands(venv):
        print("  $ " + " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    (venv / outside.VENV_MARKER).write_text(outside.venv_marker_text())
    return venv


def run_logged(cmd: list[str], log: Path, env: dict, timeout_s: float) -> float:
    """Run ``cmd`` with its output in ``log``; returns its wall seconds. Raises RuntimeError with
    the log's tail when it fails."""
    print("  $ " + " ".join(cmd), flush=True)
    t0 = time.monotonic()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout_s).returncode
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"{cmd[0]} exited with {rc}; log {log}:\n{tail}")
    return time.monotonic() - t0


def measure_isolated(base_url: str, load: outside.Load, repeats: int = 3) -> tuple[float, float]:
    """Median TTFT and mean gap between tokens (seconds) of ``repeats`` requests of ``load``'s
    lengths sent alone (streamed, one token a chunk), for targets the load can partly meet."""
    import statistics

    import httpx

    body = {"model": MODEL_NAME, "prompt": " hello" * load.input_tokens, "max_tokens": load.output_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True}
    ttfts, gaps = [], []
    for _ in range(repeats):
        times, t0 = [], time.monotonic()
        with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=600) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data:") and line[5:].strip() != "[DONE]":
                    times.append(time.monotonic())
        ttfts.append(times[0] - t0)
        gaps.append((times[-1] - times[0]) / max(1, len(times) - 1))
    return statistics.median(ttfts), statistics.median(gaps)


def client_env(offline_hub: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error")
    if offline_hub:
        env["HF_HUB_OFFLINE"] = "1"
    else:  # aiperf rejects a local tokenizer path as a repo id when the hub is offline
        env.pop("HF_HUB_OFFLINE", None)
    return env


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--venv", default=None, help="client environment (default: <laser cache>/clients-venv)")
    p.add_argument("--out", default=None, help="directory for tasks, logs and exports (default: a temporary one)")
    p.add_argument("--server-threads", type=int, default=1, help="laser serve --threads (default %(default)s)")
    p.add_argument("--skip-lm-eval", action="store_true")
    p.add_argument("--skip-aiperf", action="store_true")
    p.add_argument("--mc-items", type=int, default=32, help="multiple-choice items (default %(default)s)")
    p.add_argument("--gen-items", type=int, default=24, help="generation items, 0: none (default %(default)s)")
    p.add_argument("--max-gen-toks", type=int, default=24)
    p.add_argument("--lm-eval-batch-size", type=int, default=1,
                   help="lm-eval --batch_size (N prompts in one /v1/completions request; default %(default)s)")
    p.add_argument("--requests", type=int, default=24, help="aiperf / laser bench requests (default %(default)s)")
    p.add_argument("--concurrency", type=int, default=2, help="requests in flight (default %(default)s)")
    p.add_argument("--input-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--slo-class", default="chat")
    p.add_argument("--ttft-ms", type=float, default=None,
                   help="TTFT target of the load, ms (default: 3x a request's isolated TTFT, measured first)")
    p.add_argument("--tbt-ms", type=float, default=None,
                   help="TBT target of the load, ms: aiperf judges the mean ITL, Laser the P99 gap (default: 2x a "
                        "request's isolated mean gap between tokens, measured first)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)

    venv = ensure_venv(Path(args.venv) if args.venv else cache_dir() / "clients-venv")
    hf_dir = resolve_model(None)  # the GGUF's Hugging Face folder (float32 safetensors + tokenizer)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="laser-outside-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"CPU: {cpu_hardware_string()}; model folder: {hf_dir.name}; outputs: {out}")
    results: dict = {"cpu": cpu_hardware_string(), "packages": [outside.CLIENT_TORCH, *outside.CLIENT_PACKAGES],
                     "command": "python benchmarks/outside_clients.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    tasks = [outside.MC_TASK] + ([outside.GEN_TASK] if args.gen_items else [])
    task_dir = None
    if not args.skip_lm_eval:
        task_dir = outside.write_lm_eval_tasks(out / "tasks", outside.humaneval_problems(), args.mc_items,
                                               max(args.gen_items, 1), args.seed, args.max_gen_toks)

    port = free_port()
    server = Server(out / "server-data", port, ["--dtype", "float32", "--quantization", "none", "--served-model-name",
                                                MODEL_NAME, "--threads", str(args.server_threads),
                                                "--no-enable-prefix-caching"])
    print(f"starting laser serve on port {port} ...", flush=True)
    print(f"  ready in {server.start():.0f} s")
    try:
        if task_dir is not None:
            print("lm-eval through the server (local-completions) ...")
            results["lm_eval_server_s"] = run_logged(
                outside.lm_eval_cmd(venv, "server", tasks, task_dir, out / "lm-eval-server", hf_dir, server.base_url,
                                    MODEL_NAME, args.lm_eval_batch_size), out / "lm-eval-server.log",
                client_env(True), 1800)
        if not args.skip_aiperf:
            load = outside.Load(args.requests, args.concurrency, args.input_tokens, args.output_tokens,
                                args.slo_class, args.ttft_ms or 0.0, args.tbt_ms or 0.0)
            if args.ttft_ms is None or args.tbt_ms is None:
                ttft_s, gap_s = measure_isolated(server.base_url, load)
                ttft_ms, tbt_ms = outside.targets_from_isolated(ttft_s, gap_s)
                load = dataclasses.replace(load, ttft_ms=args.ttft_ms or ttft_ms, tbt_ms=args.tbt_ms or tbt_ms)
                results["isolated"] = {"ttft_ms": ttft_s * 1e3, "gap_ms": gap_s * 1e3}
                print(f"  isolated: TTFT {ttft_s * 1e3:.0f} ms, mean gap {gap_s * 1e3:.0f} ms -> targets TTFT "
                      f"{load.ttft_ms:g} ms, TBT {load.tbt_ms:g} ms")
            spec = json.loads((Path(outside.__file__).parent.parent / "configs" / "slo_classes.json").read_text())
            slo_config = out / "slo.json"
            slo_config.write_text(json.dumps(outside.slo_config_for(load, spec), indent=1))
            trace = out / "trace.csv"
            write_trace(str(trace), outside.fixed_length_trace(load))
            print("aiperf ...")
            results["aiperf_s"] = run_logged(outside.aiperf_cmd(venv, load, server.base_url, MODEL_NAME, hf_dir,
                                                                out / "aiperf", args.seed),
                                             out / "aiperf.log", client_env(False), 1800)
            print("laser bench --base-url on the same load ...")
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(outside.__file__).parents[2]),
                                                                 os.environ.get("PYTHONPATH", "")])}
            results["laser_bench_s"] = run_logged(outside.laser_bench_cmd(load, server.base_url, trace, slo_config,
                                                                          out / "laser-bench.json"),
                                                  out / "laser-bench.log", env, 1800)
    finally:
        server.stop()
    if task_dir is not None:
        print("lm-eval through its own hf backend (float32, CPU) ...")
        results["lm_eval_hf_s"] = run_logged(outside.lm_eval_cmd(venv, "hf", tasks, task_dir, out / "lm-eval-hf",
                                                                 hf_dir), out / "lm-eval-hf.log", client_env(True), 1800)
        mc = outside.compare_mc_samples(outside.read_samples(out / "lm-eval-server", outside.MC_TASK),
                                        outside.read_samples(out / "lm-eval-hf", outside.MC_TASK))
        gen = outside.compare_gen_samples(outside.read_samples(out / "lm-eval-server", outside.GEN_TASK),
                                          outside.read_samples(out / "lm-eval-hf", outside.GEN_TASK)) \
            if args.gen_items else None
        results["lm_eval"] = {"mc": mc, "gen": gen}
        print("\n" + outside.format_lm_eval_table(mc, gen))
    if not args.skip_aiperf:
        summary, records = outside.read_aiperf(out / "aiperf", load)
        bench = json.loads((out / "laser-bench.json").read_text())
        results["load"] = dataclasses.asdict(load)
        results["aiperf_vs_laser_bench"] = cmp = outside.compare_load(summary, records, bench, "laser-bench")
        print("\n" + outside.format_load_table(cmp, load))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
        print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
