"""Instances as Ray actors: the only module of Laser that imports Ray.

Each instance is one actor (the paper's system runs on Ray, one instance per actor as in
DistServe's ``ParaWorker`` and Llumnix's ``Llumlet``, CONTROLLER.md C1) whose body is an
:class:`~laser.instance.worker.InstanceWorker`: one real model, KV pool and scheduler. The
actor is threaded (``max_concurrency``) so the controller's questions are answered at the
next layer boundary of a running step instead of after it; its model is built, and all its torch
work -- steps, hand-off adoption and export -- runs, on one thread of its own (the worker's
``own_thread``: one OpenMP team per actor; the calls' threads only queue and wait). :class:`RayHandle` is the
controller's handle (every call with a timeout; a dead actor or a missed timeout raises
:class:`~laser.cluster.handles.InstanceFailure`). KV hand-offs go actor to actor through
Ray's object store, never through the front end: the prefill actor streams the layers and then
hands the request to the decode actor chosen at routing itself (:class:`RayKVSink`); the front
end's pull (``adopt.remote(take_handoff.remote(id))``) is the fall-back.
"""

from __future__ import annotations

import time

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

from .handles import Call, InstanceFailure, InstanceHandle

#: Ray's object store of a local cluster, bytes (hand-offs pass through it).
OBJECT_STORE_BYTES = 300 << 20

_ACTOR_CLASS = None


def init_local_ray(num_cpus: int, address: str | None = None) -> bool:
    """Start a local Ray cluster (no dashboard, a small object store) or join ``address``.
    A no-op when Ray is already initialised. True when this call started a local cluster."""
    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
        return False
    ray.init(num_cpus=num_cpus, include_dashboard=False, object_store_memory=OBJECT_STORE_BYTES,
             log_to_driver=False)
    return True


def shutdown() -> None:
    ray.shutdown()


def _actor_class():
    global _ACTOR_CLASS
    if _ACTOR_CLASS is None:
        from ..instance.worker import InstanceWorker

        # 4 threads: a step, plus the controller's questions answered at layer boundaries
        _ACTOR_CLASS = ray.remote(max_concurrency=4)(InstanceWorker)
    return _ACTOR_CLASS


def start_instances(specs: list[tuple[int, str]], engine_kwargs: dict, threads: int | None = None,
                    call_timeout_s: float = 5.0, start_timeout_s: float = 300.0,
                    max_restarts: int = 0) -> list["RayHandle"]:
    """Start one actor per ``(instance_id, role)`` and wait until each has loaded its model.
    ``max_restarts``: times Ray restarts a dead actor (it reloads the model, empty, and the
    front end lets it rejoin). Raises InstanceFailure when one fails to start within
    ``start_timeout_s``."""
    cls = _actor_class()
    actors = [cls.options(num_cpus=threads or 1, max_restarts=max_restarts).remote(i, role, engine_kwargs, threads,
                                                                                   own_thread=True)
              for i, role in specs]
    handles = []
    for (i, _), a in zip(specs, actors):
        try:
            desc = ray.get(a.describe.remote(), timeout=start_timeout_s)
        except (GetTimeoutError, RayActorError) as e:
            raise InstanceFailure(i, f"did not start: {e}") from e
        h = RayHandle(a, desc, call_timeout_s)
        h.restarts_left = max_restarts
        handles.append(h)
    return handles


class RayNode:
    """The Ray node a cluster's instance actors run on, and how to start them: the ``node`` of
    :class:`~laser.cluster.node.NodeRestart` (issue 28 item 5). :meth:`start` starts (or joins)
    Ray and the actors; ``owned``: this process started that local Ray cluster, so
    :meth:`restart` may start it again -- ``ray.shutdown``, then Ray and the actors with the same
    settings. Arguments: those of :func:`init_local_ray` and :func:`start_instances`."""

    def __init__(self, num_cpus: int, address: str | None, specs: list[tuple[int, str]], engine_kwargs: dict,
                 threads: int | None, call_timeout_s: float, max_restarts: int):
        self.num_cpus, self.address = num_cpus, address
        self._start_args = (specs, engine_kwargs, threads, call_timeout_s)
        self.max_restarts = max_restarts
        self.owned = False

    def start(self) -> list["RayHandle"]:
        """Start (or join) Ray, then the instance actors. Raises InstanceFailure (an actor did
        not start)."""
        self.owned = init_local_ray(self.num_cpus, self.address) or self.owned
        return start_instances(*self._start_args, max_restarts=self.max_restarts)

    def restart(self) -> list["RayHandle"]:
        """Shut this process's Ray session down and :meth:`start` again (``owned`` only: a
        local cluster; raises RuntimeError otherwise)."""
        if not self.owned:
            raise RuntimeError("this process did not start the Ray cluster: it cannot start it again")
        ray.shutdown()
        return self.start()

    def lost(self) -> str | None:
        """Why the Ray node this process runs on is gone -- its raylet or GCS process exited
        (a node this process started), its raylet refuses connections (one it joined), Ray is
        not running here -- or None while it is up (or when this Ray cannot tell: its internals
        moved)."""
        import socket

        from ray._private import ray_constants, worker

        node = worker.global_worker.node if ray.is_initialized() else None
        if node is None:
            return "Ray is not running in this process"
        fatal = (ray_constants.PROCESS_TYPE_RAYLET, ray_constants.PROCESS_TYPE_GCS_SERVER)
        try:
            dead = sorted({kind for kind, _ in node.dead_processes() if kind in fatal})
            path = node.raylet_socket_name
        except AttributeError:
            return None
        if dead:
            return f"its {' and '.join(dead)} process exited"
        if path and not path.startswith("tcp://"):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                try:
                    s.connect(path)
                except OSError as e:
                    return f"its raylet does not answer ({e.strerror or e})"
        return None


class RayHandle(InstanceHandle):
    """The controller's handle on an instance actor."""

    def __init__(self, actor, describe: dict, call_timeout_s: float = 5.0):
        super().__init__(describe, call_timeout_s)
        self.actor = actor

    def _get(self, ref, timeout: float | None):
        """``ray.get`` of one of this instance's calls. Raises InstanceFailure for a missed
        timeout (``timed_out``), a dead actor, and every other failure of Ray itself (the memory
        monitor killed the worker -- ``OutOfMemoryError`` --, a crashed worker, a lost object,
        a dead node); the instance's own exceptions (bad input) pass through unchanged."""
        try:
            return ray.get(ref, timeout=timeout)
        except GetTimeoutError as e:
            raise InstanceFailure(self.instance_id, f"no answer within {timeout:.3g} s", timed_out=True) from e
        except RayActorError as e:
            raise InstanceFailure(self.instance_id, f"actor died: {type(e).__name__}") from e
        except RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, RayError):  # an argument's producer died (hand-off source)
                raise InstanceFailure(self.instance_id, f"dependency lost: {type(cause).__name__}") from e
            # the instance's own exception, as it raised it: its message, not Ray's wrapper (whose
            # text carries the remote traceback, ANSI colours, pid, IP and actor id into an HTTP error)
            raise (cause if isinstance(cause, Exception) else e.as_instanceof_cause()) from None
        except RayError as e:  # OutOfMemoryError, WorkerCrashedError, ObjectLostError, NodeDiedError, ...
            raise InstanceFailure(self.instance_id, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}") from e

    def call(self, method: str, *args, timeout: float | None = None):
        ref = getattr(self.actor, method).remote(*args)
        return self._get(ref, self.timeout_for(timeout))

    def submit(self, method: str, *args) -> Call:
        args = tuple(a.ref if isinstance(a, Call) else a for a in args)
        ref = getattr(self.actor, method).remote(*args)
        return Call(ref.future(), ref, self, method, time.monotonic())

    def result(self, call: Call, timeout: float | None = 0.0):
        return self._get(call.ref, timeout)

    def kill(self, restart: bool = False) -> None:
        ray.kill(self.actor, no_restart=not restart)

    def kv_sink(self) -> "RayKVSink":
        return RayKVSink(self.actor)


class RayKVSink:
    """A :class:`~laser.instance.kv_stream.KVSink` into an instance actor, used by another actor:
    one fire-and-forget actor call per streamed layer, its K/V as numpy arrays (Ray moves them
    through the object store and the receiver reads them without a copy), then one for the
    hand-off itself (``adopt``) and one back for its ``confirm``. The calls are submitted in
    order by one thread per process, off the sender's layer loop; a dead receiver is ignored (the
    front end sees it fail and re-sends the hand-off from the prefill instance's outbox)."""

    _sender = None  # one thread per process submits the calls, off the prefill's layer loop

    def __init__(self, actor):
        self.actor = actor

    def send(self, req_id, key, layer, k, v) -> None:
        import torch

        if k.dtype != torch.bfloat16:  # numpy has no bfloat16: those go as tensors
            k, v = k.numpy(), v.numpy()
        self._send_call("receive_kv_layer", req_id, key, layer, k, v)

    def adopt(self, sent, attempt, epoch, reply) -> None:
        self._send_call("adopt", sent, attempt, epoch, reply)

    def confirm(self, req_id, attempt=None) -> None:
        self._send_call("confirm", req_id, attempt)

    def _send_call(self, method: str, *args) -> None:
        if RayKVSink._sender is None:
            import concurrent.futures

            RayKVSink._sender = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-stream")
        RayKVSink._sender.submit(self._submit, method, *args)

    def _submit(self, method: str, *args) -> None:
        try:
            getattr(self.actor, method).remote(*args)
        except RayActorError:
            pass

    def __getstate__(self):
        return {"actor": self.actor}
