"""Starting a cluster: its instances (Ray actors, or in process) and its front end."""

from __future__ import annotations

from ..controller.base import Controller
from .engine import ClusterEngine


def instance_roles(prefill: int, decode: int, mixed: int) -> list[tuple[int, str]]:
    """``(instance_id, role)`` of a cluster of ``prefill`` + ``decode`` + ``mixed`` instances."""
    roles = ["prefill"] * prefill + ["decode"] * decode + ["mixed"] * mixed
    return list(enumerate(roles))


def start_cluster(controller: str | Controller, prefill: int = 0, decode: int = 0, mixed: int = 0, *,
                  model: str | None = None, dtype: str = "auto", quantization: str = "auto", cache=None, scheduler=None, slo_classes=None,
                  latency_profile: str | None = None, max_model_len: int | None = None, seed: int = 0,
                  threads_per_instance: int | None = None, use_ray: bool = True, ray_address: str | None = None,
                  call_timeout_s: float = 5.0, step_timeout_s: float = 60.0, stall_timeout_s: float | None = None,
                  stream_kv: bool = True, max_restarts: int = 0, latency_calibration: bool = True,
                  jitter_margin: bool | None = None) -> ClusterEngine:
    """Start the instances (Ray actors, or in process with ``use_ray=False``) and the front end.
    ``dtype``, ``quantization``, ``latency_calibration``, ``jitter_margin``: each instance's, as :class:`~laser.frontend.engine.Engine`'s.

    The instances run the controller's ``instance_policy`` scheduler; ``scheduler`` gives the
    other scheduler knobs. With Ray, a local cluster is started with one CPU per instance
    thread unless Ray is already up or ``ray_address`` names one to join (a local cluster it
    started is started again, with the instances, if its node dies: :mod:`.node`); ``max_restarts``: times
    Ray restarts a dead instance actor (it rejoins empty; in process: ignored); ``stall_timeout_s``:
    :class:`ClusterEngine`'s (a decode step over it marks its instance stalled).
    Raises ValueError (bad layout for the controller, or a controller whose roles run different
    policies: simulator only) or InstanceFailure (an actor did not start).
    """
    import dataclasses

    from ..core.config import SchedulerConfig
    from ..controller import get_controller
    from ..model.loader import load_config, load_tokenizer, resolve_model
    from ..core.slo import SLOClasses

    ctrl = get_controller(controller)() if isinstance(controller, str) else controller
    if any(ctrl.policy_for(r) != ctrl.instance_policy for r in ("prefill", "decode", "mixed")):
        raise ValueError("per-role instance policies (the ablation options) run on the simulator only")
    specs = instance_roles(prefill, decode, mixed)
    if not specs:
        raise ValueError("a cluster needs at least one instance")
    path = resolve_model(model)
    tokenizer = load_tokenizer(path)
    sched = dataclasses.replace(scheduler or SchedulerConfig(), policy=ctrl.instance_policy)
    kwargs = dict(model=model, policy=ctrl.instance_policy, dtype=dtype, quantization=quantization, cache=cache, scheduler=sched,
                  latency_profile=latency_profile, seed=seed, max_model_len=max_model_len,
                  latency_calibration=latency_calibration, jitter_margin=jitter_margin,
                  extra_eos_ids=() if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,))
    node = None
    if use_ray:
        from . import ray_actors

        node = ray_actors.RayNode(len(specs) * (threads_per_instance or 1), ray_address, specs, kwargs,
                                  threads_per_instance, call_timeout_s, max_restarts)
        handles = node.start()
    else:
        from .handles import LocalHandle
        from ..instance.worker import InstanceWorker

        def worker(i, role):
            return InstanceWorker(i, role, kwargs, threads_per_instance)

        handles = [LocalHandle(worker(i, role), call_timeout_s, restart=lambda i=i, role=role: worker(i, role))
                   for i, role in specs]
        for h in handles:
            h.restarts_left = max_restarts
    engine = ClusterEngine(handles, ctrl, tokenizer, load_config(path), "smollm2" if model is None else str(model),
                           slo_classes or SLOClasses.load(), step_timeout_s=step_timeout_s, stream_kv=stream_kv,
                           stall_timeout_s=stall_timeout_s)
    engine.node = node  # a lost Ray node is started again (this process started it) or reported (laser.cluster.node)
    return engine
