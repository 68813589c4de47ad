"""benchmarks/llamacpp_compare.py and benchmarks/build_llama_server.py (issue 15's peer comparison):
the pure parts -- decode-rate window, command lines, cache path, tables -- and
:class:`laser.bench.serve_proc.ServerProcess` on a real non-Laser subprocess. Building llama.cpp
and the comparison run itself take many minutes of CPU; they are benchmarks, not tests."""

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

from laser.bench.serve_proc import ServerProcess, free_port, goodput_search_cmd, goodput_table, keep_log

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, _BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


cmp_ = _load("llamacpp_compare")
build = _load("build_llama_server")


def test_steady_decode_rate_one_stream_is_tokens_after_the_first_over_the_span():
    assert cmp_.steady_decode_rate([[0.0, 0.5, 1.0, 1.5, 2.0]]) == pytest.approx(2.0)  # 4 tokens in 2 s


def test_steady_decode_rate_counts_only_the_window_where_every_stream_decodes():
    a = [0.0, 1.0, 2.0, 3.0, 4.0]   # starts first
    b = [1.5, 2.5, 3.5, 4.5, 5.5]   # starts last: window [1.5, 4.0]
    # inside (1.5, 4.0]: a has 2.0, 3.0, 4.0; b has 2.5, 3.5 -> 5 tokens in 2.5 s
    assert cmp_.steady_decode_rate([a, b]) == pytest.approx(5 / 2.5)


def test_steady_decode_rate_none_without_a_common_window_or_tokens():
    assert cmp_.steady_decode_rate([[0.0, 1.0], [2.0, 3.0]]) is None  # a finished before b began
    assert cmp_.steady_decode_rate([[0.0, 1.0], [0.5]]) is None
    assert cmp_.steady_decode_rate([]) is None


def test_llama_server_cmd_splits_context_among_slots():
    cmd = cmp_.llama_server_cmd(Path("bin/llama-server"), Path("m.gguf"), 8123, 1, 32, 2048)
    assert cmd[0] == "bin/llama-server"
    opts = dict(zip(cmd[1::2], cmd[2::2]))
    assert opts == {"-m": "m.gguf", "--host": "127.0.0.1", "--port": "8123", "-t": "1", "-tb": "1",
                    "--parallel": "32", "-c": str(32 * 2048)}


def test_decode_batch_above_slots_is_rejected(capsys):
    with pytest.raises(SystemExit):
        cmp_.main(["--decode-batch", "64", "--slots", "32"])
    assert "--slots >= 64" in capsys.readouterr().err


def test_tables_take_the_full_probe_and_render_missing_values_as_dashes():
    probe = {"rate_rps": 0.2, "attainment": 1.0, "mean_ttft_s": 0.5, "p99_tbt_s": 0.1}
    blocks = {
        "laser": {"goodput_rps": 0.2, "probes": [probe], "decode_tok_s": {1: 10.0, 32: 100.0}},
        # a probe stopped early before any token: no TTFT / TBT
        "llama.cpp": {"goodput_rps": None, "goodput_below_range": True,
                      "probes": [{"rate_rps": 0.2, "attainment": 0.9, "mean_ttft_s": 0.1, "p99_tbt_s": 0.1,
                                  "early_stopped": True},  # superseded by the full re-run below
                                 {"rate_rps": 0.2, "attainment": 0.0, "mean_ttft_s": None, "p99_tbt_s": None,
                                  "early_stopped": False}],
                      "decode_tok_s": {1: 50.0, 32: None}},
    }
    g = goodput_table(blocks, first_col="server").splitlines()
    assert g[0].startswith("| server | goodput (req/s) | attainment @ 0.2 req/s")
    assert g[2] == "| laser | 0.200 | 1.00 | 0.50 s | 0.10 s |"
    assert g[3] == "| llama.cpp | <0.200 (every probe failed) | 0.00 | - | - |"
    d = cmp_.decode_table(blocks, [1, 32]).splitlines()
    assert d[2:] == ["| laser | 10.0 | 100.0 |", "| llama.cpp | 50.0 | n/a |", "| laser / llama.cpp | 0.20x | n/a |"]
    # a workload that passes even as one burst has no knee: never shown as a plain goodput figure
    blocks["laser"].update(goodput_rps=0.5, goodput_unbounded=True)
    assert goodput_table(blocks, first_col="server").splitlines()[2].startswith("| laser | unbounded (no knee")


def test_build_commands_are_cpu_only_static_native_and_server_only(tmp_path):
    conf = build.cmake_configure_cmd(tmp_path / "src", tmp_path / "b", "Ninja")
    assert conf[:7] == ["cmake", "-S", str(tmp_path / "src"), "-B", str(tmp_path / "b"), "-G", "Ninja"]
    for opt in ("-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF", "-DGGML_CUDA=OFF"):
        assert opt in conf
    assert "-G" not in build.cmake_configure_cmd(tmp_path / "src", tmp_path / "b")
    assert build.cmake_build_cmd(tmp_path / "b", 2)[-4:] == ["--target", "llama-server", "-j", "2"]
    pip = build.pip_download_cmd("0.3.16", tmp_path, python="py")
    assert pip == ["py", "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "llama-cpp-python==0.3.16",
                   "-d", str(tmp_path)]


def test_binary_path_follows_laser_cache_dir(tmp_path, monkeypatch):
    assert build.binary_path("1.2.3", tmp_path) == tmp_path / "llama.cpp" / "1.2.3" / "llama-server"
    monkeypatch.setenv("LASER_CACHE_DIR", str(tmp_path / "c"))
    assert build.binary_path() == tmp_path / "c" / "llama.cpp" / build.LLAMA_CPP_PYTHON_VERSION / "llama-server"


def test_build_skips_when_the_binary_exists(tmp_path, capsys):
    out = build.binary_path("9.9.9", tmp_path)
    out.parent.mkdir(parents=True)
    out.write_bytes(b"")
    assert build.main(["--version", "9.9.9", "--cache-dir", str(tmp_path)]) == 0
    assert "already built" in capsys.readouterr().out


_HEALTH_SERVER = textwrap.dedent("""
    import sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer
    t0 = time.monotonic()
    class H(BaseHTTPRequestHandler):
        def do_GET(self):  # 503 while 'loading' (like llama-server), then 200
            self.send_response(200 if time.monotonic() - t0 > 0.5 else 503)
            self.end_headers()
        def log_message(self, *a):
            pass
    print("listening", flush=True)
    HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def test_server_process_waits_for_health_then_stops(tmp_path):
    port = free_port()
    proc = ServerProcess([sys.executable, "-c", _HEALTH_SERVER, str(port)], port, tmp_path / "s.log",
                         start_timeout_s=30, name="health-server")
    try:
        assert proc.start() >= 0.5  # waited through the 503s
        assert proc.base_url == f"http://127.0.0.1:{port}"
        assert proc.cpu_seconds() is not None
    finally:
        proc.stop()
    assert proc.proc.poll() is not None
    assert "listening" in proc.log_tail()


def test_server_process_that_exits_raises_with_its_name_and_log(tmp_path):
    proc = ServerProcess([sys.executable, "-c", "print('bad flag'); raise SystemExit(3)"], free_port(),
                         tmp_path / "s.log", start_timeout_s=30, name="exiting-server")
    with pytest.raises(RuntimeError, match=r"exiting-server exited with 3(.|\n)*bad flag"):
        proc.start()


def test_keep_log_copies_only_when_asked_and_present(tmp_path):
    log = tmp_path / "server.log"
    keep_log(log, str(tmp_path / "logs"), "llamacpp")  # no log yet: nothing, no error
    assert not (tmp_path / "logs").exists()
    log.write_text("hello\n")
    keep_log(log, "", "llamacpp")  # '' drops logs
    assert not (tmp_path / "logs").exists()
    keep_log(log, str(tmp_path / "logs"), "llamacpp")
    assert (tmp_path / "logs" / "llamacpp-server.log").read_text() == "hello\n"


def test_both_servers_get_the_same_bench_and_llama_server_no_prompt_cache(tmp_path):
    """Same workload flags for both; only llama-server's requests carry ``cache_prompt: false``
    (the search replays the same prompts at every rate)."""
    import argparse

    from laser.bench.args import register

    p = argparse.ArgumentParser()
    cmp_.add_goodput_args(p, log_dir="")
    a = p.parse_args(["--num-prompts", "6", "--rate-range", "0.2,0.4"])
    cmds = {n: goodput_search_cmd("http://h:1", n, a, tmp_path / "o.json", cmp_.EXTRA_BODY[n]) for n in cmp_.SERVERS}
    strip = lambda c: [x for x in c if x not in cmp_.SERVERS]  # noqa: E731 - the label differs
    assert strip(cmds["laser"]) == strip(cmds["llama.cpp"])[:len(strip(cmds["laser"]))]
    assert cmds["llama.cpp"][-2:] == ["--extra-body", '{"cache_prompt": false}']
    assert "--extra-body" not in cmds["laser"]
    sub = argparse.ArgumentParser().add_subparsers()
    register(sub)  # the bench accepts the command as built
    parsed = sub.choices["bench"].parse_args(cmds["llama.cpp"][4:])
    assert parsed.extra_body == {"cache_prompt": False} and parsed.num_prompts == 6 and parsed.label == "llama.cpp"


def test_server_metric_sums_matching_samples_and_survives_a_failed_scrape(tmp_path, monkeypatch):
    """``Server.metric`` (cluster_goodput.py flags a layout whose instances failed during its run)."""
    import httpx

    from laser.bench import serve_proc

    text = textwrap.dedent("""\
        # HELP laser:instance_failures Instances marked dead.
        # TYPE laser:instance_failures counter
        laser:instance_failures_total{model_name="m"} 2.0
        # HELP laser:num_requests_running Running.
        # TYPE laser:num_requests_running gauge
        laser:num_requests_running{model_name="m",slo_class="batch"} 3.0
        laser:num_requests_running{model_name="m",slo_class="chat"} 5.0
        # HELP laser:num_requests_waiting Waiting.
        # TYPE laser:num_requests_waiting gauge
        laser:num_requests_waiting{model_name="m",slo_class="batch"} 1.0
        """)

    class _Resp:
        def __init__(self, t):
            self.text = t

    monkeypatch.setattr(serve_proc.httpx, "get", lambda url, timeout: _Resp(text))
    srv = serve_proc.Server(tmp_path / "data", free_port(), [])
    assert srv.metric(("laser:instance_failures",)) == 2.0
    assert srv.batch_lines_in_flight() == 4
    assert srv.metric(("laser:num_requests_running",)) == 8.0

    def fail(url, timeout):
        raise httpx.ConnectError("refused")

    monkeypatch.setattr(serve_proc.httpx, "get", fail)
    assert srv.metric(("laser:instance_failures",)) is None and srv.batch_lines_in_flight() is None


def test_calibrated_targets_reach_both_servers_and_the_laser_server_alike(tmp_path):
    """Targets calibrated on one server's isolated latencies: one --slo-config file, read back by
    SLOClasses with exactly the calibrated targets (tiers kept), and the goodput search of each
    server passes it with --slo-scale 1 (never the paper scale on top)."""
    import argparse

    from laser.bench.args import register
    from laser.bench.calibrate import IsolatedLatency, calibrate, paper_targets, write_slo_config
    from laser.core.slo import SLOClasses

    iso = IsolatedLatency({"chat": 0.05, "code": 0.04, "summarization": 0.4}, {"chat": 100, "code": 80,
                          "summarization": 900}, decode_step_s=0.03, source="test")
    cal = calibrate("measured", 1.0, paper_targets(), iso)
    cfg = write_slo_config(cal, tmp_path / "slo.json")
    table = SLOClasses.load(cfg)
    for c, t in cal.targets.items():
        assert table.get(c).ttft == pytest.approx(t["ttft"]) and table.get(c).tbt == pytest.approx(t["tbt"])
    assert table.get("code").tbt == pytest.approx(4 * 0.03)  # the tightest TBT = 4 x the decode step
    assert table.get("batch").tier == "cold" and table.get("chat").tier == "hot"
    p = argparse.ArgumentParser()
    cmp_.add_goodput_args(p, log_dir="")
    a = p.parse_args([])
    cmd = goodput_search_cmd("http://h:1", "laser", a, tmp_path / "o.json", None, cfg)
    i = cmd.index("--slo-config")
    assert cmd[i + 1] == str(cfg) and cmd[cmd.index("--slo-scale") + 1] == "1"
    sub = argparse.ArgumentParser().add_subparsers()
    register(sub)
    parsed = sub.choices["bench"].parse_args(cmd[4:])
    assert parsed.slo_config == str(cfg) and parsed.slo_scale == 1.0
