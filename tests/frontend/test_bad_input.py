"""Malformed requests, unusable model paths and bad names fail with clear errors, and a
rejected request leaves no trace: the engine keeps serving everyone else."""

from __future__ import annotations

import math
import os
import re
import shutil

import pytest

from laser import cli
from laser.core.config import CacheConfig
from laser.frontend.engine import Engine
from laser.frontend.llm import LLM
from laser.model.loader import ModelLoadError
from laser.core.request import InvalidRequestError, SamplingParams
from laser.scheduler import get_policy

SMALL_CACHE = CacheConfig(num_blocks=32)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine(str(tiny_llama), policy="vllm", dtype="float32", max_model_len=64, cache=SMALL_CACHE)


@pytest.fixture(autouse=True)
def nothing_left_behind(request):
    yield
    if "engine" in request.fixturenames:
        e = request.getfixturevalue("engine")
        assert not e.scheduler.requests
        e.check_integrity(expect_empty=True)


# -- requests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", ["", []], ids=["str", "list"])
def test_empty_prompt(engine, prompt):
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        engine.add_request(prompt)


@pytest.mark.parametrize("prompt", ["a\ud800b", [{"role": "user", "content": "\udfff"}]], ids=["text", "chat"])
def test_prompt_with_a_lone_surrogate(engine, prompt):
    """JSON may carry an unpaired UTF-16 surrogate (\\ud800); the tokenizer cannot encode it
    (a TypeError that was an HTTP 500 for completions): it is an InvalidRequestError."""
    with pytest.raises(InvalidRequestError, match=r"not valid Unicode text \(an unpaired surrogate"):
        engine.add_request(prompt)


def test_prompt_longer_than_context(engine):
    assert engine.max_model_len == 64
    with pytest.raises(InvalidRequestError, match=r"prompt has 100 tokens; this model's context is 64 tokens"):
        engine.add_request(list(range(3, 103)))
    with pytest.raises(InvalidRequestError, match="context is 64 tokens"):
        engine.add_request("hello " * 80)
    # no room for even one output token
    with pytest.raises(InvalidRequestError, match="prompt has 64 tokens"):
        engine.add_request(list(range(3, 67)))
    # the longest admissible prompt is served, and stops at the context length
    req = engine.add_request(list(range(3, 66)), SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert req.num_output_tokens == 1 and req.finish_reason == "length"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(max_tokens=2.5), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=math.nan), "temperature"),
        (dict(temperature=math.inf), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=math.nan), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(stop=("",)), "stop strings"),
        # wrong types are InvalidRequestError too (not a TypeError from a comparison), and a
        # bool is not a number: found by a new-user pass
        (dict(stop=[5]), "stop must be a string or a list of strings"),
        (dict(stop_token_ids=["a"]), "stop_token_ids"),
        (dict(stop_token_ids=[1.5]), "stop_token_ids"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(temperature="0.5"), "temperature"),
        (dict(top_p=None), "top_p"),
        (dict(max_tokens=True), "max_tokens"),
        (dict(temperature=True), "temperature"),
        (dict(top_k=False), "top_k"),
        (dict(seed=True), "seed"),
        (dict(ignore_eos="no"), "ignore_eos"),
        # not a list at all: was a TypeError ('int' object is not iterable), fresh-user round 7
        (dict(stop=5), "stop must be a list, got 5"),
        (dict(stop_token_ids=3), "stop_token_ids must be a list, got 3"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)


def test_good_sampling_params_edges():
    """The boundaries of the valid ranges are accepted (so the checks above are not blanket)."""
    SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=0)
    SamplingParams(temperature=2.0, top_p=1e-6, top_k=1, stop="x")
    SamplingParams(temperature=1, top_p=1, stop=["a", "b"], stop_token_ids=[0, 2], ignore_eos=True, seed=0)


@pytest.mark.parametrize("bad", [-1, "vocab"], ids=["negative", "vocab_size"])
def test_token_id_out_of_range(engine, bad):
    v = engine.model_config.vocab_size
    tok = v if bad == "vocab" else bad
    with pytest.raises(InvalidRequestError, match=rf"token id {tok} out of range \[0, {v}\)"):
        engine.add_request([5, tok, 6])
    engine.add_request([5, v - 1, 6], SamplingParams(max_tokens=1))  # the largest id is fine
    while engine.has_unfinished():
        engine.step()


def test_prompt_of_wrong_type(engine):
    for bad in (None, 42, [1.5, 2.0], [[1, 2]]):
        with pytest.raises(InvalidRequestError, match="prompt must be"):
            engine.add_request(bad)


def test_unknown_slo_class(engine):
    with pytest.raises(InvalidRequestError, match=r"unknown slo_class 'platinum'; known: .*chat"):
        engine.add_request("hello", slo="platinum")
    # an slo that is neither a class name nor an SLO (a dict of targets) was a TypeError ('unhashable type')
    with pytest.raises(InvalidRequestError, match=r"slo must be an SLO class name .*got dict"):
        engine.add_request("hello", slo={"ttft": 0.25, "tbt": 0.1})
    assert not engine.scheduler.requests


def test_duplicate_request_id(engine):
    engine.add_request("hello", SamplingParams(max_tokens=1), req_id="dup")
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("hello again", req_id="dup")
    while engine.has_unfinished():
        engine.step()


def test_engine_keeps_serving_after_rejections(engine):
    sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    # rejected before anything is registered: the id can be reused right away
    with pytest.raises(InvalidRequestError):
        engine.add_request(list(range(3, 200)), sp, req_id="x")
    with pytest.raises(InvalidRequestError):
        engine.add_request("hi", sp, slo="nope", req_id="x")
    assert not engine.scheduler.requests
    good = engine.add_request("The quick brown fox", sp, req_id="x")
    with pytest.raises(InvalidRequestError):  # a bad one arriving while the good one runs
        engine.add_request([], sp)
    engine.step()
    with pytest.raises(InvalidRequestError):
        engine.add_request([engine.model_config.vocab_size + 5], sp)
    while engine.has_unfinished():
        engine.step()
    assert good.finish_reason == "length" and good.num_output_tokens == 5
    engine.check_integrity(expect_empty=True)


def test_llm_generate_with_one_bad_prompt_enqueues_none(engine):
    """``LLM.generate`` / ``LLM.chat`` raise for a bad prompt before anything runs: the good
    prompts listed before it are not left in the engine (the next call would run them too)."""
    llm = LLM.__new__(LLM)
    llm.engine = engine
    sp = SamplingParams(max_tokens=2, temperature=0)
    with pytest.raises(InvalidRequestError):
        llm.generate(["good one", "good two", ""], sp)
    assert not engine.has_unfinished() and not engine.scheduler.requests
    with pytest.raises(InvalidRequestError):
        llm.chat([[{"role": "user", "content": "hi"}], []], sp)
    assert not engine.has_unfinished() and not engine.scheduler.requests
    outs = llm.generate(["good one"], sp)
    assert len(outs) == 1 and outs[0].finish_reason == "length"


# -- models -------------------------------------------------------------------------------------


def _copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def make_nonexistent(tmp_path, tiny):
    return tmp_path / "does-not-exist", "model path does not exist"


def make_config_only(tmp_path, tiny):
    d = tmp_path / "config-only"
    d.mkdir()
    shutil.copy(tiny / "config.json", d)
    return d, "no *.safetensors weights"


def make_corrupt_safetensors(tmp_path, tiny):
    d = _copy_model(tiny, tmp_path / "corrupt")
    (d / "model.safetensors").write_bytes(b"\x20\x00\x00\x00\x00\x00\x00\x00{not a header" + os.urandom(64))
    return d, "cannot read weights model.safetensors"


def make_truncated_safetensors(tmp_path, tiny):
    d = _copy_model(tiny, tmp_path / "truncated")
    data = (tiny / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    return d, "cannot read weights model.safetensors"


def make_garbage_gguf(tmp_path, tiny):
    f = tmp_path / "garbage.gguf"
    f.write_bytes(b"this is not a gguf file" + os.urandom(256))
    return f, "cannot read GGUF file"


def make_dir_with_garbage_gguf(tmp_path, tiny):
    d = tmp_path / "gguf-dir"
    d.mkdir()
    (d / "model.gguf").write_bytes(b"GGUF" + os.urandom(256))
    return d, "cannot read GGUF file"


def make_bad_config(tmp_path, tiny):
    d = _copy_model(tiny, tmp_path / "bad-config")
    (d / "config.json").write_text("{not json")
    return d, "cannot read config"


def make_empty_dir(tmp_path, tiny):
    d = tmp_path / "empty"
    d.mkdir()
    return d, "neither config.json"


def make_plain_file(tmp_path, tiny):
    return tiny / "config.json", "not a model directory or GGUF file"


@pytest.mark.parametrize(
    "make",
    [
        make_nonexistent,
        make_config_only,
        make_corrupt_safetensors,
        make_truncated_safetensors,
        make_garbage_gguf,
        make_dir_with_garbage_gguf,
        make_bad_config,
        make_empty_dir,
        make_plain_file,
    ],
)
def test_unusable_model_path(tmp_path, tiny_llama, monkeypatch, make):
    monkeypatch.setenv("LASER_CACHE_DIR", str(tmp_path / "cache"))
    path, match = make(tmp_path, tiny_llama)
    with pytest.raises(ModelLoadError, match=re.escape(match)) as ei:
        Engine(str(path), policy="vllm", dtype="float32", cache=SMALL_CACHE)
    msg = str(ei.value)
    assert str(path) in msg or "model.safetensors" in msg, msg  # names what is broken
    # a failed GGUF conversion leaves no half-written model in the cache
    assert not list((tmp_path / "cache").glob("models/*/complete"))


def test_unknown_policy_lists_names(tiny_llama):
    with pytest.raises(ValueError, match=r"unknown policy 'fifo'; choose one of laser, sarathi, vllm"):
        get_policy("fifo")
    with pytest.raises(ValueError, match="choose one of laser, sarathi, vllm"):
        Engine(str(tiny_llama), policy="fifo", dtype="float32", cache=SMALL_CACHE)


def test_unknown_dtype(tiny_llama):
    with pytest.raises(ValueError, match="unsupported dtype 'float8'"):
        Engine(str(tiny_llama), policy="vllm", dtype="float8", cache=SMALL_CACHE)


# -- CLI ----------------------------------------------------------------------------------------------


def test_cli_nonexistent_model(tmp_path, capsys):
    missing = tmp_path / "nope"
    rc = cli.main(["generate", "--model", str(missing), "--prompt", "hi"])
    assert rc == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert lines == [f"laser: error: model path does not exist: {missing}"], err


@pytest.mark.parametrize("argv,needle", [
    (["generate", "--policy", "fifo", "--prompt", "hi"], "argument --policy: unknown policy 'fifo'"),
    (["serve", "--policy", "fifo"], "argument --policy: unknown policy 'fifo'"),
    (["serve", "--max-model-len", "0"], "argument --max-model-len: expected a positive integer"),
    (["serve", "--batch-concurrency", "0"], "argument --batch-concurrency: expected a positive integer"),
    (["serve", "--max-waiting", "-1"], "argument --max-waiting: expected a positive integer"),
])
def test_cli_bad_flags_fail_before_loading(argv, needle, capsys, monkeypatch):
    """A misspelt policy or an impossible serving limit is a usage error when the flags are
    parsed; it used to surface only once the model had loaded (and, on a first start, the latency
    model had been profiled: minutes) -- or, for --batch-concurrency, when the app was built."""
    monkeypatch.setattr(cli, "build_engine", lambda *a, **k: pytest.fail("loaded the model first"))
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("flag,value,needle", [("--temperature", "-1", "temperature"), ("--top-p", "2", "top_p"),
                                               ("--top-k", "-3", "top_k")])
def test_cli_generate_checks_sampling_before_loading(flag, value, needle, capsys, monkeypatch):
    monkeypatch.setattr(cli, "build_engine", lambda *a, **k: pytest.fail("loaded the model first"))
    assert cli.main(["generate", "--prompt", "hi", flag, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("laser: error: ") and needle in err[0], err


def test_cli_serve_port_in_use_fails_before_loading(tmp_path, capsys):
    """A port already taken is reported before the model loads (minutes on first use:
    dequantising, profiling), not after; uvicorn used to find it out last."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rc = cli.main(["serve", "--model", str(tmp_path / "not-loaded"), "--port", str(port), "--log-level", "error"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"laser: error: cannot listen on 127.0.0.1:{port}: Address already in use"], err


def test_sampling_params_of_the_wrong_type_is_rejected_and_enqueues_nothing(engine):
    """A dict (vLLM-style keyword bag) or a list where one ``SamplingParams`` belongs was
    enqueued and failed only in the next step (``AttributeError: 'dict' object has no
    attribute 'stop'``), left in the engine: every later ``generate`` failed the same way."""
    llm = LLM.__new__(LLM)
    llm.engine = engine
    for bad in ({"max_tokens": 3}, [SamplingParams(max_tokens=2)], 16):
        with pytest.raises(InvalidRequestError, match="sampling_params must be a SamplingParams"):
            engine.add_request("hi", bad)
        assert not engine.scheduler.requests
    with pytest.raises(InvalidRequestError, match="sampling_params must be a SamplingParams"):
        llm.chat([[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]],
                 [SamplingParams(max_tokens=2)] * 2)
    assert not engine.scheduler.requests
    outs = llm.generate(["good one"], SamplingParams(max_tokens=2, temperature=0))
    assert len(outs) == 1 and outs[0].finish_reason == "length"


def test_non_string_stop_is_rejected_and_enqueues_nothing(engine):
    """``SamplingParams(stop=[5])`` used to pass its own checks; the engine enqueued the request
    and then raised TypeError building its stop-string matcher, leaving it in the scheduler
    (every later ``generate`` ran, and failed on, it again). SamplingParams refuses it now."""
    with pytest.raises(InvalidRequestError, match="stop must be a string or a list of strings"):
        engine.add_request("hi", SamplingParams(max_tokens=2, stop=[5]))
    assert not engine.scheduler.requests and not engine.has_unfinished()
    engine.check_integrity(expect_empty=True)


def test_llm_chat_with_a_string_says_what_it_wants(engine):
    """``LLM.chat("hi")`` took the string as a list of conversations and ran one request per
    character ('h', 'i'); it is an error naming the expected shape."""
    llm = LLM.__new__(LLM)
    llm.engine = engine
    for bad in ("hi", {"role": "user", "content": "hi"}):
        with pytest.raises(InvalidRequestError, match="list of .*role.*content"):
            llm.chat(bad, SamplingParams(max_tokens=2))
    assert not engine.scheduler.requests


def test_run_online_with_a_bad_request_leaves_nothing_behind(engine):
    """``laser.frontend.online.run_online`` raised for a malformed request in the stream (here an empty
    prompt arriving second) but left the requests it had already released in the engine: they
    ran on, unseen, inside the next run (stealing its steps and skewing its timings). It now
    aborts them before it raises, as ``LLM.generate`` does."""
    from laser.frontend.online import TimedRequest, run_online

    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    stream = [TimedRequest(0.0, "hello there " * 4, sp, "chat"), TimedRequest(0.02, "", sp, "chat"),
              TimedRequest(0.04, "ok", sp, "chat")]
    with pytest.raises(InvalidRequestError, match="empty"):
        run_online(engine, stream)
    assert not engine.has_unfinished() and not engine.scheduler.requests
    engine.check_integrity(expect_empty=True)
    (out,) = run_online(engine, [TimedRequest(0.0, "again", SamplingParams(max_tokens=3, temperature=0), "chat")])
    assert len(out.output_token_ids) == 3


def test_unreadable_slo_config_and_bad_port_are_clear_errors(tmp_path, capsys):
    """``--slo-config`` naming a missing or non-JSON file ended in a FileNotFoundError /
    JSONDecodeError traceback, and ``laser serve --port 70000`` in an OverflowError from
    ``bind()`` after the model had loaded; now a ValueError naming the file (``laser: error:``)
    and a usage error."""
    from laser.core.slo import SLOClasses

    with pytest.raises(ValueError, match=r"--slo-config .*missing\.json"):
        SLOClasses.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"--slo-config .*bad\.json.*not JSON"):
        SLOClasses.load(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"--slo-config .*bad\.json.*JSON object"):
        SLOClasses.load(bad)
    for port in ("70000", "-1", "http"):
        with pytest.raises(SystemExit) as e:
            cli.main(["serve", "--port", port])
        assert e.value.code == 2 and "argument --port" in capsys.readouterr().err
