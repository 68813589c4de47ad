"""The command line's help: every flag says what it does (with its default), and the flags
README.md and docs/server.md name exist on the commands they are shown with."""

import argparse
import re
from pathlib import Path

import pytest

from laser.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _documented(action) -> bool:
    return not isinstance(action, (argparse._HelpAction, argparse._VersionAction)) and action.help != argparse.SUPPRESS


@pytest.mark.parametrize("cmd", ["generate", "serve", "profile", "bench", "plan"])
def test_every_flag_has_a_help_text_with_its_default(cmd):
    p = _subparsers()[cmd]
    for a in filter(_documented, p._actions):
        assert a.help and a.help.strip(), f"laser {cmd} {a.option_strings}: no help text"
        takes_value = a.nargs != 0  # (store_true/store_false flags take none)
        if a.option_strings and takes_value and a.default is not None and not a.required:
            assert "default" in a.help, f"laser {cmd} {a.option_strings}: help does not state the default"
    p.format_help()  # every %(default)s expands


def test_top_level_help_lists_every_command():
    text = build_parser().format_help()
    for cmd in ("generate", "serve", "profile", "bench", "plan"):
        assert cmd in text


def test_profile_help_says_what_latency_profile_does_there():
    # (it used to repeat the serving wording, "used as is", under a description saying the
    # profile is measured anew and written there)
    p = _subparsers()["profile"]
    lp = next(a for a in p._actions if a.dest == "latency_profile")
    assert "--output" in lp.help and "used as is" not in lp.help
    hidden = {a.dest for a in p._actions if a.help == argparse.SUPPRESS}
    assert {"policy", "latency_calibration", "jitter_margin"} <= hidden  # measure nothing different
    assert p.parse_args(["--latency-profile", "x.json"]).latency_profile == "x.json"  # still accepted


def _flags_of(p: argparse.ArgumentParser) -> set[str]:
    return {s for a in p._actions for s in a.option_strings}


@pytest.mark.parametrize("doc", ["README.md", "docs/server.md"])
def test_flags_in_the_docs_exist(doc):
    subs = _subparsers()
    every = set().union(*(_flags_of(p) for p in subs.values()))
    text = (ROOT / doc).read_text()
    for line in text.splitlines():
        shown = re.search(r"(?:^|\s|`)(?:\S*/)?laser (\w+)((?: +[^`#]*)?)", line)
        if shown and shown.group(1) in subs:  # a command line: its flags belong to that command
            for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", shown.group(2)):
                assert flag in _flags_of(subs[shown.group(1)]), f"{doc}: laser {shown.group(1)} has no {flag}: {line}"
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", line):
            assert flag in every, f"{doc}: no laser command has {flag}: {line}"


def test_docs_list_every_shipped_slo_class_with_its_targets():
    from laser.core.slo import SLOClasses

    slo = SLOClasses.load()
    readme, server = (ROOT / "README.md").read_text(), (ROOT / "docs/server.md").read_text()
    listed = re.search(r"`slo_class` \(from the SLO config: ([^)]*)\)", readme).group(1)
    assert sorted(re.findall(r"`(\w+)`", listed)) == slo.names()
    for name in slo.names():
        c = slo.get(name)
        ms = ("none" if c.ttft is None else f"{c.ttft * 1e3:g} ms", "none" if c.tbt is None else f"{c.tbt * 1e3:g} ms")
        assert re.search(rf"^\| `{name}` \| {c.tier} \| {ms[0]} \| {ms[1]}\b", server, re.M), name
        if c.ttft is not None:
            assert f"`{name}` {c.ttft:g} s / {c.tbt:g} s" in readme, name
        else:
            assert f"`{name}`" in readme, name


def test_engine_argv_gives_a_server_the_engine_of_another_command():
    """``engine_argv`` writes a command's engine flags back as flags (benchmarks start ``laser serve``
    with the engine they built in process): parsed by ``laser serve``, every engine setting is the
    same, defaults included; overrides replace values."""
    from laser.cli import add_engine_args, engine_argv

    subs = _subparsers()
    bench = subs["bench"].parse_args(["--policies", "sarathi", "--threads", "1", "--dtype", "float32",
                                      "--kv-cache-gib", "0.5", "--no-latency-calibration", "--no-jitter-margin",
                                      "--no-enable-prefix-caching", "--dynamic-depth", "--max-num-seqs", "8"])
    argv = engine_argv(bench, latency_profile="p.json")
    serve = subs["serve"].parse_args(argv)
    ref = argparse.ArgumentParser()
    add_engine_args(ref)
    dests = [a.dest for a in ref._actions if a.option_strings and a.dest != "help"]
    for d in dests:
        want = "p.json" if d == "latency_profile" else getattr(bench, d)
        assert getattr(serve, d) == want, d
    assert subs["serve"].parse_args(engine_argv(subs["profile"].parse_args([]))).policy == "vllm"  # (its own default)
    assert engine_argv(argparse.Namespace()) == []
