"""Tight SLOs on a live ``laser serve`` beside best-effort load (issue 28, items 2 and 3), timed
client-side over HTTP as a user's client would see them.

Starts one ``laser serve`` (the embedded model unless ``--model``; ``--threads``, SLO classes
x ``--slo-scale``: at x4 chat 1.0 s / 0.4 s and code 0.5 s / 0.2 s TTFT / P99 TBT), then:

  routes      a closed loop of ``--background`` best-effort streams stays in flight; meanwhile
              code-target requests go in turn by every route and every way of naming the
              target: ``slo_class: code`` in the body, ``ttft_slo_ms`` / ``tbt_slo_ms`` in the
              body, ``x-slo-class`` header, ``x-slo-ttft-ms`` / ``x-slo-tbt-ms`` headers -- each
              to ``/v1/chat/completions`` and to ``/v1/completions`` (item 2: a target must
              reach the scheduler with the same effect by every route). Prints TTFT and P99 TBT
              per way, and whether the code targets were met.
  background  a closed loop of ``--background`` best-effort requests (512-token prompts, 128
              tokens, before ``--prompt-scale``) with Poisson chat (0.5/s, 200-token prompts)
              and code (0.25/s, 100-token prompts) arrivals for ``--duration`` seconds (item 3:
              tight traffic keeps >= 0.9 attainment; best effort may slow down). Prints
              attainment per class and the best-effort tokens served.

Prompts are essays from the shipped LongBench-like set, cut to length with the model's tokenizer.
``--prompt-scale`` shrinks every prompt length (a slow CPU prefills far fewer tokens per second
than the issue's; say which scale was used with any figure).

    PYTHONPATH=. python benchmarks/slo_server.py [--scenarios routes,background] [--threads 1]
        [--slo-scale 4] [--prompt-scale 0.25] [--background 12] [--duration 60] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import tempfile
import time
from pathlib import Path

import httpx

from laser.bench.client import ClientTarget
from laser.bench.serve_proc import Server, free_port, keep_log
from laser.bench.workloads import HFTokenizer, WorkloadRequest, load_essays, truncate
from laser.core.metrics import RequestRecord
from laser.core.slo import SLOClasses

#: The ways a target can be named (item 2): where the class or the targets travel.
WAYS = ("body-class", "body-targets", "header-class", "header-targets")
ROUTES = ("/v1/chat/completions", "/v1/completions")


class RouteTarget(ClientTarget):
    """A :class:`ClientTarget` that names the request's SLO one way only (one of :data:`WAYS`)
    instead of sending the class in the body and in the headers."""

    def __init__(self, base_url: str, endpoint: str, way: str, model: str):
        super().__init__(base_url, model=model, endpoint=endpoint, label=f"{way} {endpoint}")
        self.way = way

    def _headers(self, slo) -> dict:
        if self.way == "header-class":
            return {"x-slo-class": slo.name}
        if self.way == "header-targets":
            return {"x-slo-ttft-ms": f"{slo.ttft * 1e3:.6g}", "x-slo-tbt-ms": f"{slo.tbt * 1e3:.6g}"}
        return {}

    def _body(self, wr: WorkloadRequest, slo) -> dict:
        body = super()._body(wr, slo)
        del body["slo_class"]
        if self.way == "body-class":
            body["slo_class"] = slo.name
        elif self.way == "body-targets":
            body["ttft_slo_ms"], body["tbt_slo_ms"] = slo.ttft * 1e3, slo.tbt * 1e3
        return body


class Prompts:
    """Essay prompts of a given token length (cut with the served model's tokenizer)."""

    def __init__(self, tokenizer, scale: float, seed: int):
        self.tok = tokenizer
        self.scale = scale
        self.texts = [e.text for e in load_essays()]
        self.rng = random.Random(seed)

    def request(self, cls: str, prompt_len: int, output_len: int, at: float = 0.0) -> WorkloadRequest:
        text, n = truncate(self.rng.choice(self.texts), max(8, round(prompt_len * self.scale)), self.tok)
        return WorkloadRequest(cls, text, n, output_len, at)


async def _send(target: ClientTarget, client, wr: WorkloadRequest, slo, t0: float, records: list) -> RequestRecord:
    rec = RequestRecord(f"{target.label}-{len(records)}", slo.name, slo.ttft, slo.tbt, t0 + wr.arrival_time, [],
                        wr.prompt_len, wr.output_len, False)
    records.append(rec)
    await target._one(client, len(records), wr, slo, t0, rec, asyncio.Semaphore(1), None)
    return rec


async def _closed_loop(target, client, prompts: Prompts, slo, t0: float, end: float, records: list,
                       prompt_len: int, output_len: int, start: float) -> None:
    await asyncio.sleep(start)  # staggered: the loop's requests do not all restart at once
    while time.monotonic() < end:
        await _send(target, client, prompts.request("best_effort", prompt_len, output_len,
                                                    time.monotonic() - t0), slo, t0, records)


async def _scenario(base_url: str, model: str, slos: SLOClasses, prompts: Prompts, args, name: str) -> dict:
    be_target = ClientTarget(base_url, model=model, endpoint="/v1/completions", label="best_effort")
    be_slo = slos.get("best_effort")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    records: list[RequestRecord] = []
    tight: list[tuple[str, RequestRecord]] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        t0 = time.monotonic()
        end = t0 + args.duration
        loops = [asyncio.create_task(_closed_loop(be_target, client, prompts, be_slo, t0, end, records,
                                                  args.background_prompt, args.background_tokens,
                                                  i * args.warmup / max(1, args.background)))
                 for i in range(args.background)]
        await asyncio.sleep(args.warmup)
        if name == "routes":
            code = slos.get("code")
            while time.monotonic() < end:
                for way in WAYS:
                    for route in ROUTES:
                        target = RouteTarget(base_url, route, way, model)
                        wr = prompts.request("code", 100, args.tight_tokens, time.monotonic() - t0)
                        tight.append((f"{way} {route}", await _send(target, client, wr, code, t0, [])))
                        await asyncio.sleep(0.5)
        else:
            rng = random.Random(args.seed)
            window = args.duration - args.warmup
            arrivals = sorted([(t, "chat") for t in _poisson(rng, 0.5, window)]
                              + [(t, "code") for t in _poisson(rng, 0.25, window)])
            sends = []
            for at, cls in arrivals:
                wr = prompts.request(cls, 200 if cls == "chat" else 100, args.tight_tokens, args.warmup + at)
                target = ClientTarget(base_url, model=model, endpoint="/v1/chat/completions", label=cls)
                sends.append(asyncio.create_task(_send(target, client, wr, slos.get(cls), t0, [])))
            tight = [(wr_cls, rec) for (_, wr_cls), rec in zip(arrivals, await asyncio.gather(*sends))]
        await asyncio.gather(*loops)
    return {"tight": tight, "background": records, "errors": be_target.errors}


def _poisson(rng: random.Random, rate: float, duration: float) -> list[float]:
    out, t = [], rng.expovariate(rate)
    while t < duration:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _row(rec: RequestRecord) -> dict:
    return {"ttft": rec.ttft, "p99_tbt": rec.p99_tbt, "met": rec.slo_met, "finished": rec.finished,
            "tokens": rec.num_output_tokens}


def report(name: str, out: dict) -> dict:
    """Print one scenario's table; return its JSON block."""
    groups: dict[str, list[RequestRecord]] = {}
    for key, rec in out["tight"]:
        groups.setdefault(key, []).append(rec)
    print(f"\n== {name} ==")
    print(f"{'requests':<40} {'n':>3} {'met':>5} {'TTFT s (each)':<28} P99 TBT s (each)")
    block = {}
    for key, recs in groups.items():
        met = sum(r.slo_met for r in recs)
        ttfts = " ".join("-" if r.ttft is None else f"{r.ttft:.2f}" for r in recs)
        tbts = " ".join("-" if r.p99_tbt is None else f"{r.p99_tbt:.3f}" for r in recs)
        print(f"{key:<40} {len(recs):>3} {met:>2}/{len(recs):<2} {ttfts:<28} {tbts}")
        block[key] = {"attainment": met / len(recs), "requests": [_row(r) for r in recs]}
    bg = out["background"]
    done = [r for r in bg if r.finished]
    toks = sum(r.num_output_tokens for r in bg)
    print(f"best effort: {len(done)} requests completed, {toks} tokens streamed; "
          f"{len(out['errors'])} failed requests")
    block["best_effort"] = {"completed": len(done), "tokens": toks, "errors": out["errors"][:5]}
    return block


def missed_causes(base_url: str) -> dict[str, float]:
    """``laser:slo_missed_cause_total`` on ``/metrics``, as ``{"class/cause": count}`` (counts since
    the server started: why the server says requests missed)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base_url + "/metrics", timeout=10).text
    return {f"{s.labels.get('slo_class')}/{s.labels.get('cause')}": s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name.startswith("laser:slo_missed_cause") and s.name.endswith("_total") and s.value}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", default="routes,background")
    p.add_argument("--model", default=None, help="served model (default: the embedded one)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--slo-scale", type=float, default=4.0)
    p.add_argument("--prompt-scale", type=float, default=0.25, help="every prompt length times this")
    p.add_argument("--background", type=int, default=12, help="closed-loop best-effort streams")
    p.add_argument("--background-prompt", type=int, default=512)
    p.add_argument("--background-tokens", type=int, default=128)
    p.add_argument("--tight-tokens", type=int, default=32, help="output tokens of each chat / code request")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of each scenario")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds of best-effort load before tight requests")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--serve-args", default="", help="extra `laser serve` flags (one string)")
    p.add_argument("--json", default=None)
    p.add_argument("--log-dir", default="", help="copy the server's log here")
    args = p.parse_args(argv)

    from laser.model.loader import load_tokenizer, resolve_model

    slos = SLOClasses.load(scale=args.slo_scale)
    prompts = Prompts(HFTokenizer(load_tokenizer(resolve_model(args.model))), args.prompt_scale, args.seed)
    print(f"CPU: {platform.processor() or platform.machine()}; laser serve --threads {args.threads} "
          f"--slo-scale {args.slo_scale}; prompts x{args.prompt_scale}; {args.background} best-effort streams")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        serve_args = ["--threads", str(args.threads), "--slo-scale", str(args.slo_scale), *args.serve_args.split()]
        if args.model:
            serve_args = ["--model", args.model, *serve_args]
        server = Server(Path(tmp) / "data", free_port(), serve_args)
        server.start()
        try:
            model = ClientTarget(server.base_url).resolve_model()
            for name in args.scenarios.split(","):
                out = asyncio.run(_scenario(server.base_url, model, slos, prompts, args, name))
                results[name] = report(name, out)
                results[name]["missed_causes_so_far"] = causes = missed_causes(server.base_url)
                print("server's missed-SLO causes so far:", causes or "none")
        finally:
            server.stop()
            keep_log(server.log_path, args.log_dir, "slo_server")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
