"""A value no run can use is refused when the flags (or ``LLM(...)`` arguments) are read, with
the flag named, before a model loads or a latency profile is made (fresh-user round 8: these
were accepted and failed minutes later, hung, or ran a useless profile)."""

import os

import pytest
import torch

from laser.cli import build_parser, set_threads
from laser.core.config import ConfigError


@pytest.mark.parametrize("argv, flag", [
    (["--rate-range", "1.2,0.15"], "--rate-range"),  # lo > hi: was refused only after the targets were built
    (["--rate-range", "0.5"], "--rate-range"),
    (["--length-scale", "0"], "--length-scale"),
    (["--shared-prefix-tokens", "-1"], "--shared-prefix-tokens"),
    (["--burstiness", "0"], "--burstiness"),
    (["--tbt-multiple", "-1"], "--tbt-multiple"),
    (["--ttft-multiple", "0"], "--ttft-multiple"),
    (["--isolated-output-tokens", "1"], "--isolated-output-tokens"),
    (["--isolated-repeats", "0"], "--isolated-repeats"),
    (["--grid-points", "0"], "--grid-points"),
    (["--bisect-steps", "-1"], "--bisect-steps"),
    (["--max-doublings", "-1"], "--max-doublings"),
    (["--search-time-cap", "0"], "--search-time-cap"),
    (["--probe-timeout", "-5"], "--probe-timeout"),
    (["--max-model-len", "0"], "--max-model-len"),
    (["--trace", "no-such-trace.csv"], "--trace"),  # was a FileNotFoundError traceback after the model loaded
])
def test_bench_refuses_unusable_values_at_parse_time(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["bench", *argv])
    assert e.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


def test_bench_still_takes_the_documented_values():
    a = build_parser().parse_args(["bench", "--rate-range", "0.15,1.2", "--length-scale", "0.1",
                                   "--shared-prefix-tokens", "0", "--bisect-steps", "0", "--probe-timeout", "20"])
    assert a.rate_range == "0.15,1.2" and a.length_scale == 0.1 and a.bisect_steps == 0
    assert build_parser().parse_args(["bench"]).rate_range == "auto"


@pytest.mark.parametrize("argv", [["--threads-per-instance", "0"], ["--call-timeout", "-1"], ["--step-timeout", "0"],
                                  ["--stall-timeout", "-3"], ["--outage-wait", "-1"], ["--instance-restarts", "-1"],
                                  ["--step-log", "-5"], ["--prefill-instances", "-1"]])
def test_serve_refuses_negative_cluster_values(argv):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", *argv])
    assert build_parser().parse_args(["serve", "--outage-wait", "0", "--step-log", "0"]).outage_wait == 0


@pytest.mark.parametrize("cmd", ["serve", "generate", "profile"])
@pytest.mark.parametrize("value", ["inf", "nan", "0", "-1", "x"])
def test_kv_cache_gib_must_be_a_positive_finite_number(cmd, value, capsys):
    """``--kv-cache-gib inf`` was an OverflowError traceback and ``nan`` an unclear message, both after
    the weights loaded (fresh-user round, session 27)."""
    extra = ["--prompt", "hi"] if cmd == "generate" else []
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([cmd, *extra, "--kv-cache-gib", value])
    assert e.value.code == 2 and "argument --kv-cache-gib" in capsys.readouterr().err
    assert build_parser().parse_args([cmd, *extra, "--kv-cache-gib", "0.25"]).kv_cache_gib == 0.25


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 0.0, -1.0])
def test_cache_config_refuses_a_pool_size_that_is_not_a_positive_number(value):
    from laser.core.config import CacheConfig

    with pytest.raises(ConfigError, match="kv_cache_gib must be a positive number"):
        CacheConfig(kv_cache_gib=value)


def test_more_threads_than_cpus_is_refused():
    usable = len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    with pytest.raises(ConfigError, match=f"at most {usable}"):
        set_threads(usable + 1)  # was accepted: oversubscribed steps, and a fresh profile for the count
    assert torch.get_num_threads() == before


def test_llm_dtype_and_quantization_values_as_vllm_users_write_them():
    from laser.model.loader import resolve_dtype, resolve_quantization

    with pytest.raises(ConfigError, match="float16"):
        resolve_dtype(torch.float16)  # was accepted as is: no kernel here serves it
    assert resolve_dtype(torch.bfloat16) is torch.bfloat16 and resolve_dtype("float") is torch.float32
    assert resolve_quantization(None, None) == resolve_quantization("auto", None) == "gguf"  # vLLM's default
    with pytest.raises(ConfigError, match="fp8"):
        resolve_quantization("fp8", None)


def test_unknown_policy_fails_before_the_model_loads(monkeypatch):
    from laser.frontend.engine import Engine
    from laser.instance import model_instance

    def no_load(*a, **k):
        raise AssertionError("the weights were loaded before the policy was checked")

    monkeypatch.setattr(model_instance, "load_weights", no_load)
    with pytest.raises(ValueError, match="unknown policy 'foo'"):
        Engine(policy="foo")


def test_profile_refuses_an_unknown_policy_before_profiling(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["profile", "--evaluate", "--policies", "vllm,foo"])  # was after the profile
    assert "unknown policy 'foo'" in capsys.readouterr().err
    assert build_parser().parse_args(["profile", "--policies", "laser"]).policies == "laser"


def test_startup_log_names_the_executor_path(tiny_llama, caplog):
    """README: the executor path (the latency profile's key) is named in the startup log; it was
    only readable inside the profile's file name."""
    import logging

    from laser.core.config import CacheConfig
    from laser.frontend.engine import Engine
    from laser.profiler.pipeline import executor_path_of

    with caplog.at_level(logging.INFO, logger="laser.instance.model_instance"):
        engine = Engine(str(tiny_llama), policy="vllm", dtype="float32", cache=CacheConfig(num_blocks=16))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("executor path: ")]
    assert len(lines) == 1 and lines[0].startswith(f"executor path: {executor_path_of(engine)} (float32, none")
