"""laser/bench/outside.py, the pure parts of benchmarks/outside_clients.py (issue 30 item 7): the
client environment's install order, the local lm-eval tasks, the command lines, the comparison of
lm-eval sample logs and the reading of aiperf's export. Installing the clients and running them
takes many minutes: that is the benchmark, not a test."""

import json
from pathlib import Path

import pytest
import yaml

from laser.bench import outside
from laser.bench.arrivals import read_trace, write_trace
from laser.core.metrics import RequestRecord

PROBLEMS = [
    outside.CodeProblem(f"P/{i}", f"def f{i}(x):\n    \"\"\"doc {i}\"\"\"\n",
                        "".join(f"    y{i}_{k} = x + {k}\n" for k in range(3)) + f"    return y{i}_2\n")
    for i in range(8)
] + [outside.CodeProblem("P/short", "def g():\n", "    return 1\n")]  # one line: no multiple-choice item


def test_venv_installs_the_pinned_cpu_torch_alone_before_the_clients():
    cmds = outside.venv_install_commands(Path("/v"), python="py")
    assert cmds[0] == ["py", "-m", "venv", "/v"]
    assert cmds[1][-1] == "torch==2.13.0" and cmds[1][:4] == ["/v/bin/python", "-m", "pip", "install"]
    rest = cmds[2][4:]
    assert "lm-eval[api,hf]==0.4.13" in rest and any(p.startswith("aiperf==0.13") for p in rest)
    assert not any(p.startswith("torch") for p in rest)


def test_venv_ready_needs_the_marker_with_the_current_pins_and_both_clients(tmp_path):
    (tmp_path / "bin").mkdir()
    for exe in ("lm_eval", "aiperf"):
        (tmp_path / "bin" / exe).write_text("")
    assert not outside.venv_ready(tmp_path)
    (tmp_path / outside.VENV_MARKER).write_text(json.dumps({"torch": "torch==2.0.0", "packages": []}))
    assert not outside.venv_ready(tmp_path)  # other pins: reinstalled
    (tmp_path / outside.VENV_MARKER).write_text(outside.venv_marker_text())
    assert outside.venv_ready(tmp_path)
    (tmp_path / "bin" / "aiperf").unlink()
    assert not outside.venv_ready(tmp_path)


def test_mc_items_hold_the_true_next_line_among_lines_of_other_solutions():
    items = outside.mc_items(PROBLEMS, 6, seed=3)
    assert len(items) == 6 and len({it["id"] for it in items}) == 6 and "P/short" not in {it["id"] for it in items}
    for it in items:
        p = next(p for p in PROBLEMS if p.source == it["id"])
        assert len(it["choices"]) == 4 and len(set(it["choices"])) == 4
        true = it["choices"][it["label"]]
        lines = p.solution.splitlines()
        k = lines.index(true)
        assert it["context"] == p.prompt + "".join(ln + "\n" for ln in lines[:k])
        for j, c in enumerate(it["choices"]):
            if j != it["label"]:
                assert c.strip() not in {ln.strip() for ln in lines}  # a line of another solution
                assert c[: len(c) - len(c.lstrip())] == true[: len(true) - len(true.lstrip())]  # same indent
    assert outside.mc_items(PROBLEMS, 6, seed=3) == items  # seeded
    with pytest.raises(ValueError, match="2 or more solution lines"):
        outside.mc_items(PROBLEMS, 9)


def test_gen_items_target_the_first_solution_line():
    items = outside.gen_items(PROBLEMS, 2)
    assert items == [{"id": "P/0", "prompt": PROBLEMS[0].prompt, "target": "y0_0 = x + 0"},
                     {"id": "P/1", "prompt": PROBLEMS[1].prompt, "target": "y1_0 = x + 0"}]
    with pytest.raises(ValueError):
        outside.gen_items(PROBLEMS, 10)


def test_task_files_are_lm_eval_configs_reading_the_written_data(tmp_path):
    d = outside.write_lm_eval_tasks(tmp_path / "tasks", PROBLEMS, 5, 3, max_gen_toks=7)
    mc = yaml.safe_load((d / f"{outside.MC_TASK}.yaml").read_text())
    assert mc["task"] == outside.MC_TASK and mc["output_type"] == "multiple_choice"
    # fields by name (a Jinja template would drop the context's final newline), no delimiter
    assert (mc["doc_to_text"], mc["doc_to_choice"], mc["doc_to_target"], mc["target_delimiter"]) == \
        ("context", "choices", "label", "")
    rows = [json.loads(x) for x in Path(mc["dataset_kwargs"]["data_files"]["test"]).read_text().splitlines()]
    assert rows == outside.mc_items(PROBLEMS, 5, 0)
    gen = yaml.safe_load((d / f"{outside.GEN_TASK}.yaml").read_text())
    assert gen["output_type"] == "generate_until" and gen["generation_kwargs"] == \
        {"until": ["\n"], "do_sample": False, "temperature": 0.0, "max_gen_toks": 7}
    assert [m["metric"] for m in gen["metric_list"]] == ["exact_match"]
    assert len(Path(gen["dataset_kwargs"]["data_files"]["test"]).read_text().splitlines()) == 3


def test_lm_eval_cmd_server_and_hf_share_tasks_and_sample_logs():
    v, td, hf = Path("/v"), Path("/t"), Path("/m")
    srv = outside.lm_eval_cmd(v, "server", ["a", "b"], td, Path("/o/s"), hf, "http://h:1/", "smol", batch_size=4)
    ref = outside.lm_eval_cmd(v, "hf", ["a", "b"], td, Path("/o/h"), hf)
    assert srv[0] == "/v/bin/lm_eval" and srv[srv.index("--model") + 1] == "local-completions"
    margs = dict(kv.split("=", 1) for kv in srv[srv.index("--model_args") + 1].split(","))
    assert margs["base_url"] == "http://h:1/v1/completions" and margs["model"] == "smol"
    assert margs["tokenizer"] == "/m" and margs["tokenizer_backend"] == "huggingface"  # never the hub
    assert ref[ref.index("--model") + 1] == "hf" and ref[ref.index("--model_args") + 1] == "pretrained=/m,dtype=float32"
    assert ref[ref.index("--device") + 1] == "cpu"
    for c in (srv, ref):
        assert "--log_samples" in c and c[c.index("--tasks") + 1] == "a,b" and c[c.index("--include_path") + 1] == "/t"
    assert srv[srv.index("--batch_size") + 1] == "4"
    with pytest.raises(ValueError):
        outside.lm_eval_cmd(v, "vllm", ["a"], td, Path("/o"), hf)
    with pytest.raises(ValueError):
        outside.lm_eval_cmd(v, "server", ["a"], td, Path("/o"), hf)


def _mc_row(doc_id, lls, label):
    """A multiple-choice row as lm-eval 0.4.13 logs it (--log_samples)."""
    return {"doc_id": doc_id, "target": label, "resps": [[[str(x), "False"]] for x in lls],
            "filtered_resps": [[x, False] for x in lls], "acc": float(max(range(len(lls)), key=lls.__getitem__) == label)}


def _write_samples(d: Path, task: str, rows, stamp="2026-12-01T23-00-00.000000"):
    sub = d / "model__name"
    sub.mkdir(parents=True, exist_ok=True)
    (sub / f"samples_{task}_{stamp}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_compare_mc_samples_reports_accuracy_agreement_and_loglikelihood_gaps(tmp_path):
    server = [_mc_row(0, [-1.0, -2.0, -3.0], 0), _mc_row(1, [-5.0, -4.0, -6.0], 2), _mc_row(2, [-1.0, -1.5, -9.0], 1)]
    hf = [_mc_row(0, [-1.0, -2.0, -3.001], 0), _mc_row(1, [-5.0, -4.0, -6.0], 2), _mc_row(2, [-1.6, -1.5, -9.0], 1)]
    _write_samples(tmp_path / "s", "t", reversed(server))  # read back by doc_id
    _write_samples(tmp_path / "h", "t", hf)
    r = outside.compare_mc_samples(outside.read_samples(tmp_path / "s", "t"), outside.read_samples(tmp_path / "h", "t"))
    assert r["n"] == 3 and r["acc_server"] == pytest.approx(1 / 3) and r["acc_hf"] == pytest.approx(2 / 3)
    assert r["choices_agree"] == 2  # doc 2: server picks 0, hf picks 1
    assert r["max_abs_diff"] == pytest.approx(0.6) and r["mean_abs_diff"] == pytest.approx(0.601 / 9)
    table = outside.format_lm_eval_table(r, None)
    assert "2/3 choices agree" in table and "6.00e-01" in table
    with pytest.raises(ValueError, match="different documents"):
        outside.compare_mc_samples(server[:2], hf)
    with pytest.raises(ValueError, match="choices"):
        outside.compare_mc_samples([_mc_row(0, [-1.0, -2.0], 0)], [_mc_row(0, [-1.0, -2.0, -3.0], 0)])


def test_compare_gen_samples_counts_identical_generations(tmp_path):
    def row(i, text, em):
        return {"doc_id": i, "resps": [[text]], "filtered_resps": [text.strip()], "exact_match": em}

    s = [row(0, "    return 1", 1.0), row(1, "    x = 2", 0.0)]
    h = [row(0, "    return 1", 1.0), row(1, "    x = 3", 0.0)]
    assert outside.compare_gen_samples(s, h) == {"n": 2, "em_server": 0.5, "em_hf": 0.5, "identical": 1}
    with pytest.raises(FileNotFoundError):
        outside.read_samples(tmp_path, "t")


LOAD = outside.Load(requests=3, concurrency=2, input_tokens=64, output_tokens=5, slo_class="chat", ttft_ms=500,
                    tbt_ms=100)


def _aiperf_row(ttft, gaps, phase="profiling", error=None):
    """One profile_export.jsonl record of aiperf 0.13 (ms)."""
    row = {"metadata": {"benchmark_phase": phase},
           "metrics": {"time_to_first_token": {"value": ttft, "unit": "ms"},
                       "inter_chunk_latency": {"value": gaps, "unit": "ms"},
                       "inter_token_latency": {"value": sum(gaps) / len(gaps), "unit": "ms"}}}
    if error:
        row["error"] = {"message": error}
    return row


def test_aiperf_records_follow_the_streamed_gaps_and_skip_warmup_and_failures():
    r = outside.aiperf_record(_aiperf_row(200.0, [50.0, 150.0, 50.0, 50.0]), LOAD, 7)
    assert isinstance(r, RequestRecord) and r.req_id == "aiperf-7" and r.finished
    assert r.ttft == pytest.approx(0.2) and r.tbts == pytest.approx([0.05, 0.15, 0.05, 0.05])
    assert (r.ttft_slo, r.tbt_slo, r.slo_class, r.output_len) == (0.5, 0.1, "chat", 5)
    assert outside.aiperf_record(_aiperf_row(200.0, [50.0], phase="warmup"), LOAD) is None
    assert outside.aiperf_record(_aiperf_row(200.0, [50.0], error="boom"), LOAD) is None


def test_goodput_mean_rule_passes_a_request_whose_p99_gap_fails():
    recs = [outside.aiperf_record(_aiperf_row(*a), LOAD, i) for i, a in enumerate([
        (200.0, [50.0, 150.0, 50.0, 50.0]),  # mean gap 75 <= 100, P99 gap ~147 > 100: met only by the mean rule
        (200.0, [60.0, 60.0, 60.0, 60.0]),  # met both ways
        (600.0, [10.0, 10.0, 10.0, 10.0]),  # TTFT missed
    ])]
    assert outside.goodput_both_rules(recs) == {"n": 3, "mean_rule": 2, "p99_rule": 1}


def test_read_aiperf_and_compare_load_against_laser_bench_json(tmp_path):
    d = tmp_path / "aiperf" / "run"
    d.mkdir(parents=True)
    rows = [_aiperf_row(100.0, [10.0, 10.0]), _aiperf_row(200.0, [50.0, 150.0, 50.0, 50.0]),
            _aiperf_row(300.0, [20.0, 20.0]), _aiperf_row(999.0, [1.0], phase="warmup")]
    (d / "profile_export.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"request_count": {"avg": 3.0}, "time_to_first_token": {"avg": 200.0, "p99": 298.0},
               "inter_token_latency": {"avg": 35.0}, "inter_chunk_latency": {"p99": 140.0},
               "good_request_count": {"avg": 3.0}, "goodput": {"avg": 1.5}, "request_throughput": {"avg": 1.5}}
    (d / "profile_export_aiperf.json").write_text(json.dumps(summary))
    got_summary, recs = outside.read_aiperf(tmp_path / "aiperf", LOAD)
    assert got_summary == summary and len(recs) == 3
    bench = {"policies": {"lb": {"mean_ttft_s": 0.25, "p99_ttft_s": 0.4, "mean_tbt_s": 0.03, "p99_tbt_s": 0.12,
                                 "attainment": 2 / 3, "per_class": {"chat": {"count": 3}}}}}
    cmp = outside.compare_load(summary, recs, bench, "lb")
    assert cmp["aiperf"]["met"] == 3.0 and cmp["aiperf"]["itl_p99_ms"] == 140.0
    assert cmp["aiperf_laser_rules"]["met"] == 3 and cmp["aiperf_laser_rules"]["met_p99"] == 2
    assert cmp["aiperf_laser_rules"]["ttft_mean_ms"] == pytest.approx(200.0)
    assert cmp["laser_bench"] == {"n": 3, "ttft_mean_ms": 250.0, "ttft_p99_ms": 400.0, "itl_mean_ms": 30.0,
                                  "itl_p99_ms": 120.0, "met_p99": 2}
    table = outside.format_load_table(cmp, LOAD)
    assert "laser bench" in table and "2/3" in table and "3/3" in table
    with pytest.raises(FileNotFoundError):
        outside.read_aiperf(tmp_path / "nothing", LOAD)


def test_aiperf_cmd_and_laser_bench_cmd_describe_the_same_load(tmp_path):
    a = outside.aiperf_cmd(Path("/v"), LOAD, "http://h:1", "smol", Path("/m"), tmp_path)
    assert a[:2] == ["/v/bin/aiperf", "profile"] and a[a.index("--tokenizer") + 1] == "/m"
    val = {k: a[a.index(k) + 1] for k in ("--concurrency", "--request-count", "--synthetic-input-tokens-mean",
                                           "--output-tokens-mean", "--endpoint-type", "--goodput")}
    assert val == {"--concurrency": "2", "--request-count": "3", "--synthetic-input-tokens-mean": "64",
                   "--output-tokens-mean": "5", "--endpoint-type": "completions",
                   "--goodput": "time_to_first_token:500 inter_token_latency:100"}
    extra = [a[i + 1] for i, x in enumerate(a) if x == "--extra-inputs"]
    assert {"ignore_eos:true", "min_tokens:5", "slo_class:chat"} <= set(extra) and "--streaming" in a
    assert "--no-server-metrics" in a and "--use-server-token-count" in a  # what laser bench does too
    csv = tmp_path / "t.csv"
    write_trace(str(csv), outside.fixed_length_trace(LOAD))
    assert [(e.arrival_time, e.slo_class, e.prompt_len, e.output_len) for e in read_trace(str(csv))] == \
        [(0.0, "chat", 64, 5)] * 3
    b = outside.laser_bench_cmd(LOAD, "http://h:1", csv, tmp_path / "slo.json", tmp_path / "o.json")
    assert b[b.index("--base-url") + 1] == "http://h:1" and b[b.index("--max-concurrency") + 1] == "2"
    assert b[b.index("--trace") + 1] == str(csv) and b[b.index("--slo-scale") + 1] == "1"
    spec = outside.slo_config_for(LOAD, {"chat": {"ttft": 0.25, "tbt": 0.1, "tier": "hot"}, "code": {"ttft": 1}})
    assert spec == {"chat": {"ttft": 0.5, "tbt": 0.1, "tier": "hot"}, "code": {"ttft": 1}}


def test_laser_bench_json_carries_the_mean_gap_beside_the_p99():
    """compare_load reads laser bench's mean ITL from its JSON (``mean_tbt_s``: every gap pooled)."""
    from types import SimpleNamespace

    from laser.bench import report
    from laser.core.metrics import summarize

    recs = [RequestRecord("a", "chat", 1.0, 0.1, 0.0, [0.2, 0.3, 0.6], 4, 3, True),
            RequestRecord("b", "chat", 1.0, 0.1, 0.0, [0.1, 0.2], 4, 2, True)]
    probe = SimpleNamespace(summary=summarize(recs, 1.0), rate=1.0, early_stopped=False)
    d = report.policy_json("lb", {}, probe, None, probes=[])
    assert d["mean_tbt_s"] == pytest.approx((0.1 + 0.3 + 0.1) / 3) and d["p99_tbt_s"] > d["mean_tbt_s"]
