"""The files and functions of ``laser/`` one chat request crosses (issue 27: "an in-process chat
request crosses at most 15 files"), in process and on an in-process cluster (1 prefill + 1 decode
``InstanceWorker`` behind ``LocalHandle``s: the cluster front end's code without Ray).

One non-streamed ``POST /v1/chat/completions`` (4 tokens, greedy) goes through the real server
(uvicorn + the FastAPI app + ``AsyncEngine``) over a tiny random-weight Llama built as the tests
build it, after one warm-up request. A profile hook on every thread (set before the server's
threads start, active only during the measured request) records three counts per file of
``laser/``:

* **executed**: every named function of ``laser/`` that ran during the request (any helper,
  property or data class touched, by any thread);
* **reached**: the functions the request's data reaches, following its value: a call
  counts when one of its arguments, its return value or (on return) one of its locals *is the
  request's data* -- the HTTP body (a bytes/str holding a marker put in the message), its prompt
  token ids, its id, an object carrying its id (``Request``, its stream, token events,
  ``RequestOutput``, ``Work``), a container, record or closure holding one of these -- or is a
  tensor handed down by such a call (the batch's hidden states on their way to the layer
  kernel). ``self`` counts only when it is such a record itself. One request is in flight, so
  any request record seen is this request's.
* **crossed**: of those, the path itself -- the functions that hand the request on (call a
  function of ``laser/`` with its data as an argument: the nearest named caller counts; a
  comprehension is part of its function) or back (return its data); a leaf that only reads it
  (a lookup by id, a method of its own record, a hash) is touched, not crossed.

Prints the three counts with a per-folder breakdown and the functions crossed; ``--verbose``
also lists the functions reached, each with the argument that carried the request into it.

    PYTHONPATH=. python benchmarks/request_path.py [--cluster] [--verbose]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import threading
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # conftest.make_tiny_model: the tests' tiny random Llama

MARK = "rqpath7probe"  # in the chat message: the HTTP body's text carries it
CONTAINERS = (list, tuple, set, frozenset, dict)


class PathTracer:
    """A ``sys.setprofile`` hook recording, per ``laser/`` file, the functions executed and the
    functions crossed by the request (see the module docstring). Inactive until :meth:`start`."""

    def __init__(self, package: Path):
        import torch

        self.prefix = str(package) + "/"
        self.tensor = torch.Tensor
        self.active = False
        self.executed: dict[str, set[str]] = defaultdict(set)
        self.crossed: dict[str, dict[str, str]] = defaultdict(dict)  # file -> function -> carrier
        self.path: dict[str, set[str]] = defaultdict(set)  # file -> functions handing the request on
        self.ids: set[tuple[int, ...]] = set()  # the request's token id sequences seen so far
        self.req_ids: set[str] = set()
        self.carrying: set[int] = set()  # id() of live frames that carry the request
        self.keep: list = []  # frames in ``carrying`` stay alive (no id reuse)

    def start(self) -> None:
        self.active = True

    def stop(self) -> None:
        self.active = False

    # -- is this value the request's data? ---------------------------------------------------------
    def _record_id(self, v) -> str | None:
        for attr in ("req_id", "request_id"):
            rid = getattr(v, attr, None)
            if isinstance(rid, str) and rid:
                return rid
        return None

    def carries(self, v, depth: int = 3) -> bool:
        t = type(v)
        if t is str:
            return MARK in v or v in self.req_ids
        if t in (bytes, bytearray):
            return MARK.encode() in v
        if t in (int, float, bool) or v is None or isinstance(v, type):
            return False
        if t in CONTAINERS:
            items = list(v.items()) if t is dict else list(v)
            if 4 <= len(items) and t in (list, tuple) and all(type(x) is int for x in items[:64]):
                return tuple(items) in self.ids or any(tuple(items[:len(s)]) == s for s in self.ids if len(s) <= len(items))
            return depth > 0 and any(self.carries(x, depth - 1) for x in items[:64])
        rid = self._record_id(v)
        if rid is not None:
            self.req_ids.add(rid)
            ids = getattr(v, "prompt_token_ids", None)
            if isinstance(ids, (list, tuple)) and ids:
                self.ids.add(tuple(ids))
            return True
        if depth <= 0:
            return False
        if callable(v):  # a closure or partial handing the request on
            cells = [c.cell_contents for c in (getattr(v, "__closure__", None) or ()) if _filled(c)]
            cells += list(getattr(v, "args", ()) or ()) if type(v).__name__ == "partial" else []
            return any(self.carries(c, depth - 1) for c in cells)
        return any(self.carries(x, depth - 1) for x in _fields(v))

    def _tensor_from_carrier(self, frame, values) -> bool:
        if not any(isinstance(x, self.tensor) for x in values):
            return False
        f, hops = frame.f_back, 0
        while f is not None and hops < 4:
            if id(f) in self.carrying:
                return True
            f, hops = f.f_back, hops + 1
        return False

    # -- the hook ----------------------------------------------------------------------------------
    def hook(self, frame, event, arg):
        if not self.active or event not in ("call", "return"):
            return
        code = frame.f_code
        path = code.co_filename
        if not path.startswith(self.prefix):
            return
        rel, name = path[len(self.prefix):], code.co_qualname
        if event == "call":
            self.executed[rel].add(name)
        local = frame.f_locals
        found = None
        for k, v in local.items():
            if k == "self":
                if self._record_id(v) is not None and self.carries(v, 0):
                    found = "self"
                    break
            elif self.carries(v):
                found = k
                break
        if found is None and event == "return" and self.carries(arg):
            found = "<return>"
        if found is None and self._tensor_from_carrier(frame, [v for k, v in local.items() if k != "self"]):
            found = "<tensor from a caller carrying it>"
        if found is None:
            if event == "return":
                self.carrying.discard(id(frame))
            return
        if event == "return":
            if isinstance(arg, (list, tuple)) and len(arg) >= 4 and all(type(x) is int for x in arg[:64]):
                self.ids.add(tuple(arg))  # token ids the request's data was turned into (encode)
            self.carrying.discard(id(frame))
            if found == "<return>":
                self._on_path(frame)  # hands it back to its caller
        else:
            self.carrying.add(id(frame))
            self.keep.append(frame)
            if found != "self" and not _inline(name):
                self._on_path(frame.f_back)  # the caller hands it on (a method of the request's own
                # record reads it, a comprehension is part of its function: neither is a hand-on)
        if _named(name):
            self.crossed[rel].setdefault(name, found)

    def _on_path(self, frame) -> None:
        """Record the nearest named ``laser/`` function at or above ``frame``: it hands the request on."""
        while frame is not None:
            code = frame.f_code
            if code.co_filename.startswith(self.prefix) and _named(code.co_qualname):
                self.path[code.co_filename[len(self.prefix):]].add(code.co_qualname)
                return
            frame = frame.f_back


def _named(qualname: str) -> bool:
    """A named function (not a lambda, comprehension or generator expression)."""
    return not qualname.startswith("<") and "<locals>.<" not in qualname


def _inline(qualname: str) -> bool:
    """A comprehension or generator expression: part of the function it is written in."""
    return qualname.rsplit(".", 1)[-1] in ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _fields(v) -> list:
    """The fields of a record (dataclass, pydantic model, ``__slots__`` class of laser); [] for
    anything else (services are not searched: an engine holding the request is not the request)."""
    if dataclasses.is_dataclass(v):
        return [getattr(v, f.name, None) for f in dataclasses.fields(v)]
    if hasattr(type(v), "model_fields"):
        return [getattr(v, k, None) for k in type(v).model_fields]
    slots = getattr(type(v), "__slots__", None)
    if slots and type(v).__module__.startswith("laser."):
        return [getattr(v, k, None) for k in slots]
    return []


def _folder(rel: str) -> str:
    return rel.split("/")[0] if "/" in rel else "(top)"


def breakdown(files: dict) -> str:
    by = defaultdict(lambda: [0, 0])
    for rel, funcs in files.items():
        by[_folder(rel)][0] += 1
        by[_folder(rel)][1] += len(funcs)
    return ", ".join(f"{k} {f} ({n})" for k, (f, n) in sorted(by.items(), key=lambda kv: (-kv[1][0], kv[0])))


def named(funcs) -> list[str]:
    return [f for f in funcs if _named(f)]


def build_server(model_dir: Path, cluster: bool):
    from laser.core.config import CacheConfig, SchedulerConfig
    from laser.frontend.async_engine import AsyncEngine
    from laser.server.app import build_app
    from laser.server.cli import LiveServer

    kw = dict(model=str(model_dir), policy="laser", dtype="float32", cache=CacheConfig(num_blocks=256),
              max_model_len=1024, scheduler=SchedulerConfig(policy="laser"))
    if cluster:
        from laser.cluster.engine import ClusterEngine
        from laser.cluster.handles import LocalHandle
        from laser.controller import get_controller
        from laser.core.slo import SLOClasses
        from laser.instance.worker import InstanceWorker
        from laser.model.loader import load_config, load_tokenizer

        handles = [LocalHandle(InstanceWorker(0, "prefill", kw)), LocalHandle(InstanceWorker(1, "decode", kw))]
        engine = ClusterEngine(handles, get_controller("laser")(), load_tokenizer(str(model_dir)),
                               load_config(str(model_dir)), "tiny", SLOClasses.load())
    else:
        from laser.frontend.engine import Engine

        engine = Engine(kw.pop("model"), **kw)
    return LiveServer(build_app(AsyncEngine(engine), served_model_names=["tiny"]))


def measure(cluster: bool, verbose: bool) -> None:
    import httpx
    from conftest import make_tiny_model

    from laser.model.loader import resolve_model

    import laser

    tracer = PathTracer(Path(laser.__file__).resolve().parent)  # the package imported (PYTHONPATH)
    sys.setprofile(tracer.hook)
    threading.setprofile(tracer.hook)  # every thread the server starts from here on
    with tempfile.TemporaryDirectory() as tmp:
        make_tiny_model("llama", Path(tmp), resolve_model(None))
        srv = build_server(Path(tmp), cluster)
        try:
            def chat(text: str) -> dict:
                body = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 4,
                        "temperature": 0.0, "ignore_eos": True}
                r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=120)
                r.raise_for_status()
                return r.json()

            chat("warm up the server and the engine")
            tracer.start()
            out = chat(f"tell me about {MARK} please")
            tracer.stop()
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
            srv.stop()
    assert out["usage"]["completion_tokens"] == 4, out
    ex = {rel: named(f) for rel, f in tracer.executed.items() if named(f)}
    cr = tracer.crossed
    where = "cluster (1P1D, in-process handles)" if cluster else "in process"
    print(f"== one non-streamed chat request, 4 tokens, {where} ==")
    print(f"(a) executed: {len(ex)} files, {sum(map(len, ex.values()))} named functions "
          f"({sum(map(len, tracer.executed.values()))} with comprehensions and lambdas)")
    print(f"    {breakdown(ex)}")
    print(f"(b) reached by the request's data: {len(cr)} files, {sum(map(len, cr.values()))} functions")
    print(f"    {breakdown(cr)}")
    if verbose:
        for rel in sorted(cr):
            print(f"    {rel}: " + ", ".join(f"{f} [{c}]" for f, c in sorted(cr[rel].items())))
    path = tracer.path
    print(f"(c) crossed (functions handing the request on or back): {len(path)} files, "
          f"{sum(map(len, path.values()))} functions")
    print(f"    {breakdown(path)}")
    for rel in sorted(path):
        print(f"    {rel}: " + ", ".join(sorted(path[rel])))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster", action="store_true", help="the cluster path (1P1D, in-process handles, no Ray)")
    p.add_argument("--verbose", action="store_true", help="name the argument that carried the request into each")
    a = p.parse_args()
    measure(a.cluster, a.verbose)
    sys.stdout.flush()
    os._exit(0)  # the server's threads (still hooked, inactive) would abort the interpreter's exit


if __name__ == "__main__":
    main()
