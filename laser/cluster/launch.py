"""Starting a cluster: its instances (Ray actors, or in process) and its front end."""

from __future__ import annotations

import os

from ..controller.base import Controller
from .engine import ClusterEngine


def instance_roles(prefill: int, decode: int, mixed: int) -> list[tuple[int, str]]:
    """``(instance_id, role)`` of a cluster of ``prefill`` + ``decode`` + ``mixed`` instances."""
    roles = ["prefill"] * prefill + ["decode"] * decode + ["mixed"] * mixed
    return list(enumerate(roles))


def check_speculation(ctrl: Controller, model_dir, speculative=None, exits=None) -> None:
    """Refuse, before any instance starts, what its instances would refuse as they start:
    ``speculative`` with a controller whose instance policy cannot speculate
    (:func:`laser.spec.self_spec.check_policy`), and speculation or ``exits`` without trained
    exits where they are looked for (:func:`laser.spec.self_spec.load_exits`). Raises ConfigError."""
    named = isinstance(exits, (str, os.PathLike))  # a file (or "auto"), not heads already loaded
    if speculative is None and not named:
        return
    from ..core.config import ConfigError
    from ..spec.self_spec import check_policy, load_exits

    if speculative is not None:
        try:
            check_policy(ctrl.instance_policy)
        except ConfigError as e:
            raise ConfigError(f"{e} (the {ctrl.name} controller's instances run {ctrl.instance_policy!r}: use "
                              "--controller distserve or colocated)") from None
        load_exits(model_dir, speculative.exits_path)
    if named:
        load_exits(model_dir, None if exits == "auto" else str(exits))


def start_cluster(controller: str | Controller, prefill: int = 0, decode: int = 0, mixed: int = 0, *,
                  model: str | None = None, dtype: str = "auto", quantization: str = "auto", cache=None, scheduler=None, slo_classes=None,
                  latency_profile: str | None = None, max_model_len: int | None = None, seed: int = 0,
                  threads_per_instance: int | None = None, use_ray: bool = True, ray_address: str | None = None,
                  call_timeout_s: float = 5.0, step_timeout_s: float = 60.0, stall_timeout_s: float | None = None,
                  stream_kv: bool = True, max_restarts: int = 0, latency_calibration: bool = True,
                  jitter_margin: bool | None = None, speculative=None, exits=None) -> ClusterEngine:
    """Start the instances (Ray actors, or in process with ``use_ray=False``) and the front end.
    ``dtype``, ``quantization``, ``latency_calibration``, ``jitter_margin``: each instance's, as :class:`~laser.frontend.engine.Engine`'s.
    ``speculative`` (a :class:`laser.spec.SpeculativeConfig`): the decode and mixed instances
    decode greedy requests self-speculatively; ``exits`` (as the Engine's: heads, a file or
    ``"auto"``): every instance serves dynamic-depth requests (so a prefill instance serving as
    mixed does too).

    The instances run the controller's ``instance_policy`` scheduler; ``scheduler`` gives the
    other scheduler knobs. With Ray, a local cluster is started with one CPU per instance
    thread unless Ray is already up or ``ray_address`` names one to join (a local cluster it
    started is started again, with the instances, if its node dies: :mod:`.node`); ``max_restarts``: times
    Ray restarts a dead instance actor (it rejoins empty; in process: ignored); ``stall_timeout_s``:
    :class:`ClusterEngine`'s (a decode step over it marks its instance stalled).
    Raises ValueError (bad layout for the controller, or a controller whose roles run different
    policies: simulator only), ConfigError (``speculative`` with a controller whose instance
    policy cannot speculate) or InstanceFailure (an actor did not start: e.g. no exits there).
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
    check_speculation(ctrl, path, speculative, exits)
    tokenizer = load_tokenizer(path)
    sched = dataclasses.replace(scheduler or SchedulerConfig(), policy=ctrl.instance_policy)
    kwargs = dict(model=model, policy=ctrl.instance_policy, dtype=dtype, quantization=quantization, cache=cache, scheduler=sched,
                  latency_profile=latency_profile, seed=seed, max_model_len=max_model_len,
                  latency_calibration=latency_calibration, jitter_margin=jitter_margin,
                  speculative=speculative, exits=exits,
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
    engine.node_restart.node = node  # a lost Ray node is started again (this process started it) or reported (laser.cluster.node)
    return engine
