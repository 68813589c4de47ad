"""``--cpu-bind`` (laser.core.cpu_bind): the option's parsing and checks, and that the engine's
thread, its torch (OpenMP) team and the front end end up on the CPUs asked for."""

import argparse
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from laser.cli import build_parser, engine_argv
from laser.core.config import ConfigError
from laser.core.cpu_bind import format_cpus, parse_cpu_list, plan_cpu_bind

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
needs_two = pytest.mark.skipif(len(ALLOWED) < 2, reason="the host lets this process run on one CPU only")


def smt(c):  # 4 physical cores with two logical CPUs each: c and c + 4 are siblings
    return ("0", str(c % 4))


@pytest.mark.parametrize("text, cpus", [("0", (0,)), ("0-3,6", (0, 1, 2, 3, 6)), ("6, 1-2,2", (1, 2, 6)),
                                        ("4-4", (4,))])
def test_cpu_lists_read_as_taskset_writes_them(text, cpus):
    assert parse_cpu_list(text) == cpus
    assert parse_cpu_list(format_cpus(cpus)) == cpus


@pytest.mark.parametrize("text", ["", "x", "1-", "-1", "3-1", "0,,1", "auto2", "0-3;6"])
def test_malformed_lists_are_refused_at_parse_time(text, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "p", "--cpu-bind", text])
    assert "argument --cpu-bind" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--cpu-bind"):
        plan_cpu_bind(text, None, allowed=range(8))


def test_every_command_takes_the_option_and_passes_it_to_a_served_engine():
    for cmd in (["generate", "--prompt", "p"], ["serve"], ["bench"], ["profile"]):
        assert build_parser().parse_args([*cmd, "--cpu-bind", "0-1"]).cpu_bind == "0-1"
        assert build_parser().parse_args(cmd).cpu_bind == "none"
    assert engine_argv(argparse.Namespace(cpu_bind="auto")) == ["--cpu-bind", "auto"]
    assert engine_argv(argparse.Namespace(cpu_bind="none")) == []


def test_auto_takes_one_logical_cpu_per_physical_core_and_leaves_cpu0_to_the_front_end():
    b = plan_cpu_bind("auto", 2, allowed=range(8), core=smt)
    assert b.engine == (2, 3) and b.front == (0, 1, 4, 5, 6, 7)
    b = plan_cpu_bind("auto", None, allowed=range(8), core=smt)  # default: every physical core
    assert b.engine == (0, 1, 2, 3) and b.front == (4, 5, 6, 7)
    b = plan_cpu_bind("auto", 6, allowed=range(8), core=smt)  # past the physical cores: siblings
    assert b.engine == (0, 1, 2, 3, 6, 7)
    b = plan_cpu_bind("auto", 2, allowed=[0, 1])  # nothing left: the front end is not bound
    assert b.engine == (0, 1) and b.front == ()
    assert plan_cpu_bind("none", 2) is None and plan_cpu_bind(None, 2) is None


def test_cpus_the_process_may_not_use_and_too_many_threads_are_refused():
    with pytest.raises(ConfigError, match=r"CPUs 9-10 are not in this process's allowed set 0-3"):
        plan_cpu_bind("0,9-10", None, allowed=range(4))
    with pytest.raises(ConfigError, match="--threads 3"):
        plan_cpu_bind("0-1", 3, allowed=range(4))
    with pytest.raises(ConfigError, match="--threads 5"):
        plan_cpu_bind("auto", 5, allowed=range(4))
    b = plan_cpu_bind("1,3", None, allowed=range(4))
    assert b.engine == (1, 3) and b.front == (0, 2)


SCRIPT = textwrap.dedent("""
    import argparse, json, os, sys, threading
    import torch
    from laser.cli import setup_cpus
    from laser.core.cpu_bind import bind_front_end, plan_cpu_bind, thread_ids
    from laser.core.owner_thread import OwnerThread

    def masks():
        return {t: sorted(os.sched_getaffinity(t)) for t in thread_ids()}

    mode, spec = sys.argv[1], sys.argv[2]
    args = argparse.Namespace(cpu_bind=spec, threads=None)
    x = torch.randn(256, 256)
    torch.set_num_threads(2)
    (x @ x).sum()  # main's OpenMP team exists before binding
    if mode == "process":
        setup_cpus(args)
        torch.set_num_threads(2)
        (x @ x).sum()
        print(json.dumps({"all": masks()}))
    else:  # as laser serve: the front end first, then the engine thread binds itself and builds
        binding = plan_cpu_bind(spec, None)
        bind_front_end(binding)
        before = set(thread_ids())

        def build():
            setup_cpus(args, binding)
            torch.set_num_threads(2)  # a team of two on the engine's CPU: made now, by this thread
            (x @ x).sum()
            return threading.get_native_id(), sorted(os.sched_getaffinity(0))

        owner = OwnerThread(build)
        tid, mask = owner.engine()
        new = {t: m for t, m in masks().items() if t not in before and t != tid}
        print(json.dumps({"engine": mask, "team": new, "main": sorted(os.sched_getaffinity(0))}))
""")


def run_script(mode, spec):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode, spec], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    import json

    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_two
def test_served_engine_thread_and_its_torch_team_on_the_engine_cpus_front_end_on_the_rest():
    engine, front = ALLOWED[-1], ALLOWED[:-1]
    got = run_script("serve", str(engine))
    assert got["engine"] == [engine]
    assert got["main"] == front
    assert got["team"] and all(m == [engine] for m in got["team"].values())  # made by the engine thread


@needs_two
def test_in_process_binding_moves_every_thread_including_a_torch_team_made_before():
    got = run_script("process", str(ALLOWED[0]))
    assert len(got["all"]) >= 2 and all(m == [ALLOWED[0]] for m in got["all"].values())


@needs_two
def test_benchmark_client_sends_on_the_cpus_asked_and_gets_its_mask_back():
    import threading

    from laser.bench.client import _cpus

    seen = []

    def body():
        before = os.sched_getaffinity(0)
        with _cpus(str(ALLOWED[0])):
            seen.append(sorted(os.sched_getaffinity(0)))
        seen.append(os.sched_getaffinity(0) == before)

    t = threading.Thread(target=body)  # a thread of its own: the test process's mask stays as it is
    t.start()
    t.join()
    assert seen == [[ALLOWED[0]], True]


def test_serve_refuses_cpus_not_allowed_and_binding_ray_instances_before_any_model_loads(tmp_path, capsys):
    from laser.cli import main

    far = str(max(ALLOWED or [0]) + 1)
    assert main(["serve", "--cpu-bind", far, "--port", "0", "--data-dir", str(tmp_path / "a")]) == 2
    assert f"CPUs {far} are not in this process's allowed set" in capsys.readouterr().err
    assert main(["serve", "--cpu-bind", "auto", "--mixed-instances", "1", "--port", "0",
                 "--data-dir", str(tmp_path / "b")]) == 2
    assert "Ray instance actors" in capsys.readouterr().err
