"""``laser serve``: the OpenAI-compatible server (FastAPI + uvicorn) over one engine instance."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys

log = logging.getLogger("laser.server")

#: ``laser serve``'s exit status when its cluster lost its Ray node for good (a supervisor restarts it).
EXIT_NODE_LOST = 3


def register(subparsers) -> None:
    """Add the ``serve`` subcommand (called by ``laser.cli.main``)."""
    from ..frontend.async_engine import ON_INFEASIBLE
    from ..cli import add_engine_args, non_negative_float, non_negative_int, positive_int, tcp_port

    p = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server with per-request SLOs",
    )
    add_engine_args(p)
    p.add_argument("--role", default="mixed", choices=["mixed"],
                   help="instance role (default %(default)s; prefill/decode instances are started with "
                        "--prefill-instances/--decode-instances behind the global controller)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=tcp_port, default=8000, help="TCP port to listen on (default %(default)s)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="names accepted in the 'model' field (default: the model's name)")
    p.add_argument("--api-key", default=os.environ.get("LASER_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on all routes but /health, /metrics, docs ($LASER_API_KEY)")
    p.add_argument("--allowed-origins", type=json_str_list, default=["*"],
                   help='CORS: JSON list of allowed origins (as vLLM; default: ["*"])')
    p.add_argument("--allowed-methods", type=json_str_list, default=["*"],
                   help='CORS: JSON list of allowed methods (as vLLM; default: ["*"])')
    p.add_argument("--allowed-headers", type=json_str_list, default=["*"],
                   help='CORS: JSON list of allowed headers (as vLLM; default: ["*"])')
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (as vLLM)")
    p.add_argument("--on-infeasible", default="queue", choices=list(ON_INFEASIBLE),
                   help="when the latency model predicts a TTFT miss: serve it anyway (queue, the default), "
                        "refuse it (reject: 429 with retry-after when the queue is to blame, 400 when even an idle "
                        "instance misses the target), or serve it as the strictest looser class it meets, else "
                        "best_effort (demote)")
    p.add_argument("--max-waiting", type=positive_int, default=256,
                   help="accepted requests without a first token, at most; more get 429 (default %(default)s)")
    p.add_argument("--max-model-len", type=positive_int, default=None,
                   help="context length limit, tokens (default: the model's, capped to the KV pool)")
    p.add_argument("--shutdown-timeout", type=non_negative_float, default=30.0,
                   help="on SIGINT/SIGTERM, seconds in-flight requests may finish before they are aborted "
                        "(default %(default)s)")
    p.add_argument("--data-dir", default=None,
                   help="Batch API store: SQLite jobs and results plus files (default: "
                        "$LASER_CACHE_DIR/batches, else ~/.cache/laser/batches); one server per directory: "
                        "a second one started on it is refused")
    p.add_argument("--batch-concurrency", type=positive_int, default=8,
                   help="Batch API lines in flight at most (cold tier; default %(default)s)")
    p.add_argument("--batch-accept-infeasible", action="store_true",
                   help="accept, with a warning, batch jobs the latency model says cannot meet their window "
                        "(default: reject them with the predicted completion time)")
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up request before serving")
    _add_cluster_args(p)
    p.add_argument("--step-log", type=non_negative_int, default=0, metavar="N",
                   help="keep the engine's last N steps (plan, seconds, end, price; steps cut short too) for GET /engine/steps, e.g. for "
                        "benchmarks/sim_vs_real.py to fit the speed the served engine ran at; 0: none "
                        "(default %(default)s; single instance only)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default %(default)s)")
    p.set_defaults(func=cmd_serve)


def _add_cluster_args(p) -> None:
    """``serve``'s cluster options: instances as Ray actors behind the global controller."""
    from ..cli import non_negative_float, non_negative_int, positive_float, positive_int

    g = p.add_argument_group("cluster (instances as Ray actors behind the global controller)")
    g.add_argument("--prefill-instances", type=non_negative_int, default=0,
                   help="prefill instances (Ray actors; default %(default)s)")
    g.add_argument("--decode-instances", type=non_negative_int, default=0, help="decode instances (Ray actors; default %(default)s)")
    g.add_argument("--mixed-instances", type=non_negative_int, default=0,
                   help="mixed (colocated) instances (Ray actors; default %(default)s)")
    g.add_argument("--threads-per-instance", type=positive_int, default=1,
                   help="torch threads (and Ray CPUs) per instance (default %(default)s)")
    g.add_argument("--controller", default=None,
                   help="global controller: laser (default with prefill/decode instances), distserve, "
                        "colocated (default with mixed instances), colocated-laser, round_robin")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. auto) instead of starting a local one (default: a local one)")
    g.add_argument("--call-timeout", type=positive_float, default=5.0,
                   help="seconds an instance may take to answer the controller before it is marked dead "
                        "(default %(default)s)")
    g.add_argument("--step-timeout", type=positive_float, default=60.0,
                   help="seconds one instance step may take before the instance is marked dead (default %(default)s)")
    g.add_argument("--stall-timeout", type=positive_float, default=3.0,
                   help="seconds a decode instance's step (one iteration) may take before the instance counts as "
                        "stalled (frozen, hung) and its requests move; stretched to 10x its slowest recent step "
                        "when longer (default %(default)s)")
    g.add_argument("--outage-wait", type=non_negative_float, default=30.0,
                   help="seconds a request waits for an instance of a lost role that may return (a restart, a "
                        "straggler) before it fails with 503 and Retry-After; 0: answer 503 at once "
                        "(default %(default)s)")
    g.add_argument("--instance-restarts", type=non_negative_int, default=0,
                   help="times Ray restarts a dead instance actor; a restarted one rejoins the controller empty "
                        "(default %(default)s)")


def json_str_list(text: str) -> list[str]:
    """An argparse type: a JSON list of strings (vLLM's form of ``--allowed-origins`` and its
    siblings). Raises argparse.ArgumentTypeError naming what is wrong."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"want a JSON list of strings such as '[\"*\"]', got {text!r} ({e})") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"want a JSON list of strings such as '[\"*\"]', got {text!r}")
    return value


def cors_options(args) -> dict:
    """Keyword arguments of Starlette's ``CORSMiddleware`` from ``laser serve``'s CORS flags
    (vLLM's ``--allowed-origins`` / ``--allowed-methods`` / ``--allowed-headers`` /
    ``--allow-credentials``; its defaults allow every origin, method and header)."""
    return {"allow_origins": args.allowed_origins, "allow_methods": args.allowed_methods,
            "allow_headers": args.allowed_headers, "allow_credentials": args.allow_credentials}


def _warmup(engine) -> None:
    """One short request through every layer, so the first client does not pay for lazy init."""
    from ..core.request import SamplingParams

    ids = engine.tokenizer.encode("Hello")[:8] or [0]
    req = engine.add_request(ids, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                             req_id="laser-warmup")
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity(expect_empty=True)
    return req


def build_cluster(args):
    """A :class:`~laser.cluster.engine.ClusterEngine` over Ray instance actors from the CLI flags."""
    from ..cli import engine_configs, speculative_config
    from ..cluster.launch import start_cluster
    from ..core.config import ConfigError

    if min(args.prefill_instances, args.decode_instances, args.mixed_instances) < 0:
        raise SystemExit("laser: error: instance counts must be >= 0")
    name = args.controller or ("colocated" if args.mixed_instances else "laser")
    cache, sched, slo = engine_configs(args)
    if args.outage_wait < 0:
        raise SystemExit("laser: error: --outage-wait must be >= 0")
    try:
        cl = start_cluster(name, args.prefill_instances, args.decode_instances, args.mixed_instances,
                           model=args.model, dtype=args.dtype, quantization=args.quantization, cache=cache,
                           scheduler=sched, slo_classes=slo,
                           latency_profile=args.latency_profile, max_model_len=args.max_model_len,
                           threads_per_instance=args.threads_per_instance, ray_address=args.ray_address,
                           call_timeout_s=args.call_timeout, step_timeout_s=args.step_timeout,
                           stall_timeout_s=args.stall_timeout, max_restarts=args.instance_restarts, latency_calibration=args.latency_calibration,
                           jitter_margin=args.jitter_margin, speculative=speculative_config(args),
                           exits=getattr(args, "dynamic_depth", None))
    except ConfigError as e:
        raise SystemExit(f"laser: error: {e}") from None
    cl.availability.outage_wait_s = args.outage_wait
    return cl


def exit_when_node_lost(engine) -> list[str]:
    """Make the server exit (SIGTERM to itself: it drains, then ``laser serve`` returns
    ``EXIT_NODE_LOST``) when ``engine``'s cluster lost its Ray node and cannot start it again
    (:mod:`laser.cluster.node`: it joined a Ray cluster it did not start, or restarts failed), so
    that a supervisor restarts it. Returns the list the reason is appended to."""
    import signal

    lost: list[str] = []

    def on_node_lost(why: str) -> None:
        lost.append(why)
        print(f"[laser] fatal: {why}; exiting with status {EXIT_NODE_LOST} so that a supervisor restarts "
              "the server", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    engine.node_restart.on_node_lost = on_node_lost
    return lost


def port_unavailable(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on now, or None. Checked before the model loads
    (minutes on first use: dequantising, profiling), so a taken port is reported at once;
    uvicorn binds it again when it starts (SO_REUSEADDR, as uvicorn does)."""
    import socket

    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        return str(e)
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            return e.strerror or str(e)
    return None


def cmd_serve(args) -> int:
    import uvicorn

    from ..frontend.async_engine import AsyncEngine
    from ..core.owner_thread import OwnerThread
    from ..cli import build_engine
    from .app import build_app

    busy = port_unavailable(args.host, args.port)
    if busy is not None:
        print(f"laser: error: cannot listen on {args.host}:{args.port}: {busy}", file=sys.stderr)
        return 2
    data_dir = args.data_dir
    if data_dir is None:
        from ..model.loader import cache_dir

        data_dir = cache_dir() / "batches"
    from ..store import BatchStore, DataDirInUseError

    try:  # before the engine: a second server on the same data dir is refused at once
        store = BatchStore(data_dir)
    except DataDirInUseError as e:
        print(f"laser: error: --data-dir: {e}", file=sys.stderr)
        return 2
    node_lost: list[str] = []
    binding = None
    if args.prefill_instances or args.decode_instances or args.mixed_instances:
        if args.cpu_bind != "none":
            print("laser: error: --cpu-bind binds the single engine's thread; Ray instance actors are processes "
                  "Ray starts, on the CPUs Ray gives them (use --threads-per-instance)", file=sys.stderr)
            return 2
        engine = build_cluster(args)
        node_lost = exit_when_node_lost(engine)
        if not args.no_warmup:
            _warmup(engine)
        owner = None
    else:  # built, warmed up and stepped on one thread (OwnerThread: one OpenMP team)
        from ..core.cpu_bind import bind_front_end, plan_cpu_bind

        # planned on this thread's mask (ConfigError: laser: error); the front end first, then the
        # engine thread binds itself as it starts building
        binding = plan_cpu_bind(args.cpu_bind, args.threads)
        bind_front_end(binding)

        def build():
            built = build_engine(args, cpu_binding=binding, max_model_len=args.max_model_len)
            if not args.no_warmup:
                _warmup(built)
            if args.step_log:
                from ..instance.core import StepLog

                built.core.step_log = StepLog(args.step_log, clock=built.clock)
            return built

        owner = OwnerThread(build)
        engine = owner.engine()
    ae = AsyncEngine(engine, max_waiting=args.max_waiting, on_infeasible=args.on_infeasible, owner=owner)
    app = build_app(ae, served_model_names=args.served_model_name, api_key=args.api_key, batch_store=store,
                    batch_concurrency=args.batch_concurrency, batch_accept_infeasible=args.batch_accept_infeasible,
                    cors=cors_options(args))
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        # Backstop: our own drain aborts at --shutdown-timeout; uvicorn cancels a bit later.
        timeout_graceful_shutdown=args.shutdown_timeout + 5.0,
    )
    server = make_server(config, ae, args.shutdown_timeout)
    names = ", ".join(args.served_model_name or [engine.model_name])
    print(
        f"[laser] serving {names} on http://{args.host}:{args.port}/v1 ({_what(engine)}, "
        f"context {engine.max_model_len}, on-infeasible {args.on_infeasible}, "
        f"SLO classes {', '.join(engine.slo_classes.names())}, default {engine.slo_classes.default}"
        f"{', ' + binding.describe() if binding else ''})",
        file=sys.stderr,
    )
    run_server(server)
    return EXIT_NODE_LOST if node_lost else 0


def run_server(server) -> None:
    """Serve until ``server.run()`` returns (or Ctrl-C), first moving every object startup left
    alive out of the garbage collector's reach (:func:`laser.server.heap.freeze_heap`, unless
    ``$LASER_GC_FREEZE=0``): a full collection of that heap took 330-380 ms, a stall of every
    request in flight (issue 26 item 4); and setting the GIL switch interval when
    ``$LASER_SWITCH_INTERVAL_MS`` asks for one (:func:`laser.server.gil.set_switch_interval`; A/B
    runs: 0.5 ms sped up the hop to the event loop but slowed the engine's steps)."""
    from .gil import set_switch_interval
    from .heap import freeze_heap, gc_freeze_enabled

    set_switch_interval()
    if gc_freeze_enabled():
        freeze_heap()
    try:
        server.run()
    except KeyboardInterrupt:
        pass


def _what(engine) -> str:
    handles = getattr(engine, "handles", None)
    if handles is None:
        return f"policy {engine.scheduler.report().policy}"
    roles = ", ".join(f"{h.instance_id}:{h.role}" for h in handles.values())
    return f"controller {engine.controller.name} over instances {roles}"


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn, plus: on the first SIGINT/SIGTERM stop taking requests, let in-flight ones
        finish for ``drain_s`` seconds, then abort the rest (their streams end cleanly), and
        return from :meth:`run` (``laser serve`` then exits 0, as vLLM's server does).

        uvicorn (0.29+) raises a signal it handled once more after its shutdown, under the
        handler it found: the default one kills the process (status -15), Ray's driver handler
        (``sys.exit(signum)``) makes a cluster server exit 15, and ``laser serve`` could not
        exit with its own status (:data:`EXIT_NODE_LOST`). A drained server has handled it."""

        def __init__(self, config, async_engine, drain_s: float):
            super().__init__(config)
            self.async_engine = async_engine
            self.drain_s = drain_s
            self._loop = None
            self._drain_task = None

        async def startup(self, sockets=None):
            self._loop = asyncio.get_running_loop()
            await super().startup(sockets=sockets)

        def handle_exit(self, sig, frame):
            first = not self.should_exit
            super().handle_exit(sig, frame)
            getattr(self, "_captured_signals", []).clear()  # handled here: not raised again after the shutdown
            if first and self._loop is not None:
                self._loop.call_soon_threadsafe(self._begin_drain)

        def _begin_drain(self):
            log.info("draining: %d request(s) in flight, up to %.0f s", self.async_engine.num_in_flight, self.drain_s)
            self._drain_task = asyncio.ensure_future(self.async_engine.shutdown(self.drain_s))

    return Server


def make_server(config, async_engine, drain_s: float):
    """A uvicorn server that drains ``async_engine`` on SIGINT/SIGTERM (see ``_server_class``)."""
    return _server_class()(config, async_engine, drain_s)


class LiveServer:
    """An app served by uvicorn on a background thread (tests, benchmarks, notebooks).

    ``url`` is ``http://host:port``; :meth:`call` runs a coroutine on the server's event loop;
    :meth:`stop` shuts it down (the app's lifespan stops its engine).
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 timeout_graceful_shutdown: float | None = 10.0):
        import threading
        import time

        import uvicorn

        config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                timeout_graceful_shutdown=timeout_graceful_shutdown)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="laser-uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("server failed to start")
            time.sleep(0.02)
        sock = self.server.servers[0].sockets[0]
        self.host, self.port = sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.app = app

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self.app.state.async_engine._loop

    def call(self, coro, timeout: float = 60.0):
        """Run ``coro`` on the server's event loop; return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, timeout: float = 60.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> "LiveServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
