"""A real instance's parts without any front end: model, KV pool, intermediate cache, model
runner, latency model, scheduler and the :class:`~laser.instance.core.InstanceCore` over them.

:class:`laser.frontend.engine.Engine` (the in-process front end: tokenizer, stop strings) and
:class:`laser.instance.worker.InstanceWorker` (the body of a Ray instance actor: token ids in,
token events out) both build on it, so one place says how an instance is assembled.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Callable

import torch

from ..core.config import CacheConfig, ConfigError, SchedulerConfig, resolve_max_model_len
from ..core.intermediate_cache import IntermediateCache
from ..model.kv_cache import KVCache
from ..latency import CalibratedLatencyModel
from ..latency.calibrated import JITTER_SPREAD_QUANTILE, spread_before_calibration
from ..model.llama import LlamaModel
from ..model.loader import (load_config, load_quantized, load_weights, resolve_dtype, resolve_model,
                            resolve_quantization)
from ..model.runner import ModelRunner
from ..model.sampler import Sampler
from ..model import warm_rows
from .core import InstanceCore, make_scheduler
from ..scheduler import get_policy

log = logging.getLogger(__name__)


def check_jitter_margin(latency_calibration: bool, jitter_margin: bool | None) -> None:
    """Raises ConfigError for ``jitter_margin=True`` without ``latency_calibration``."""
    if jitter_margin and not latency_calibration:
        raise ConfigError("--jitter-margin needs the online latency calibration (it divides the margins by the "
                          "spread the calibration measures): drop --no-latency-calibration or --jitter-margin")


def planning_model(latency_model, latency_calibration: bool = True, jitter_margin: bool | None = None):
    """The model a scheduler plans with, from the profiled (or estimated) ``latency_model``:
    scaled online by how the machine runs (:class:`~laser.latency.CalibratedLatencyModel`) when
    ``latency_calibration``, and then, unless ``jitter_margin`` is False, with Laser's margins
    divided by the measured spread of slow steps (``None``, the default: on with the
    calibration). Issue 28: with fixed 10 % margins, a host where one step in ten runs 25 %
    over broke the TBT of interactive streams beside best-effort load (simulated: chat 0.79,
    code 0.11 attainment; with the spread 0.97 / 0.89). Until the calibration has its first
    steps the spread is the one the profile measured over its repeated timings
    (:func:`~laser.latency.calibrated.spread_before_calibration`). Raises ConfigError for
    ``jitter_margin=True`` without the calibration (which measures the spread)."""
    check_jitter_margin(latency_calibration, jitter_margin)
    if not latency_calibration:
        return latency_model
    on = jitter_margin is None or jitter_margin
    return CalibratedLatencyModel(latency_model, spread_quantile=JITTER_SPREAD_QUANTILE if on else None,
                                  prior_spread=spread_before_calibration(latency_model))


class ModelInstance:
    """Model + KV pool + scheduler + core of one instance (see :class:`laser.frontend.engine.Engine` for
    the arguments). ``extra_eos_ids``: end-of-sequence ids beyond the model config's (the
    tokenizer's, which a front end knows). ``speculative`` and ``exits`` (the Engine's): this
    instance decodes greedy requests self-speculatively / serves dynamic-depth requests
    (:meth:`enable_dynamic_depth`); a single engine and a cluster's instance
    (:class:`~laser.instance.worker.InstanceWorker`) both enable them here.

    Raises:
        ModelLoadError: the model path is unusable. ConfigError: bad config values, or
        ``jitter_margin`` without ``latency_calibration`` (the spread it divides the margins by
        is measured by the calibration), or speculation / exits that cannot be served (no
        exits trained, a policy or role that cannot speculate). LatencyProfileError:
        ``latency_profile`` names an unusable profile file.
    """

    def __init__(
        self,
        model: str | None = None,
        policy: str = "laser",
        dtype: str | torch.dtype = "auto",
        quantization: str = "auto",
        cache: CacheConfig | None = None,
        scheduler: SchedulerConfig | None = None,
        latency_model=None,
        latency_profile: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        seed: int = 0,
        max_model_len: int | None = None,
        extra_eos_ids: tuple[int, ...] = (),
        latency_calibration: bool = True,
        jitter_margin: bool | None = None,
        enable_prefix_caching: bool | None = None,
        speculative=None,
        exits=None,
    ):
        check_jitter_margin(latency_calibration, jitter_margin)  # before loading anything
        get_policy(policy)  # an unknown name (ValueError) too
        path = resolve_model(model)
        self.model_path = path
        self.model_name = "smollm2" if model is None else str(model)
        self.model_config = load_config(path)
        self.dtype = resolve_dtype(dtype)
        self.quantization = resolve_quantization(quantization, model)
        weights = load_weights(path)
        quant = load_quantized(model, self.model_config, weights, self.quantization)
        self.model = LlamaModel(self.model_config, weights, self.dtype, quant)
        if quant:
            kinds = {}
            for qw in quant.values():
                kinds.setdefault(qw.source if "->" in qw.source else f"{qw.source}->{qw.kind}", []).append(qw)
            log.info("weights served quantized (the decode kernels the lines above name): %s; %.1f MB read per "
                     "step", ", ".join(f"{len(v)} {k}" for k, v in sorted(kinds.items())),
                     self.model.weight_bytes() / 1e6)
        del weights, quant
        self.cache_config = cache or CacheConfig()
        if enable_prefix_caching is not None:
            self.cache_config = dataclasses.replace(self.cache_config, enable_prefix_caching=enable_prefix_caching)
        # the KV depends on the weights (path and file: a GGUF's quantization) and the dtype
        self.kv_cache = KVCache(self.model_config, self.cache_config, self.dtype, cache_salt=f"{path}|{self.quantization}")
        self.icache = IntermediateCache(self.cache_config.intermediate_cache_tokens)
        eos_ids = set(self.model_config.eos_token_ids) | set(extra_eos_ids)
        self.runner = ModelRunner(self.model, self.kv_cache, self.icache, Sampler(seed, eos_ids))
        from ..profiler.pipeline import executor_path_of

        log.info("executor path: %s (%s, %s weights: the kernels the lines above chose and why; the latency "
                 "profile is keyed by it)", executor_path_of(self.runner), str(self.dtype).removeprefix("torch."),
                 self.quantization)
        sched_cfg = scheduler or SchedulerConfig(policy=policy)
        if scheduler is not None and policy != sched_cfg.policy:
            sched_cfg = SchedulerConfig(**{**sched_cfg.__dict__, "policy": policy})
        self.scheduler_config = sched_cfg
        if warm_rows.warm_rows_mode(self.dtype):  # every row count a layer call can take, before the first step
            warmed, most = warm_rows.layer_row_counts(sched_cfg.max_num_batched_tokens, sched_cfg.max_num_seqs)
            log.info(warm_rows.warm_row_counts(
                self.model, warmed, min(sched_cfg.max_num_seqs, warm_rows.WARM_HEAD_ROWS), most))
        self.latency_profile = latency_profile
        if latency_model is None:
            latency_model = planning_model(self._load_latency_model(latency_profile), latency_calibration,
                                           jitter_margin)
        self.latency_model = latency_model
        self.clock = clock
        self.max_model_len = resolve_max_model_len(
            max_model_len, self.model_config.max_position, self.kv_cache.num_blocks * self.cache_config.block_size
        )
        sched = make_scheduler(sched_cfg, self.model_config.num_layers, self.kv_cache.block_manager,
                               self.icache, self.latency_model, clock)
        self.core = InstanceCore(sched, self.runner, clock, eos_ids=eos_ids, max_model_len=self.max_model_len)
        self.serves_exits = False
        if exits is not None:
            self.enable_dynamic_depth(exits)
        # Self-speculative decoding (laser.spec): the executor that drafts and verifies, or None.
        self.speculator = None
        if speculative is not None:
            from ..spec import enable_self_speculation

            enable_self_speculation(self, speculative)

    def enable_dynamic_depth(self, exits) -> None:
        """Serve dynamic-depth requests (lossy early exit, :mod:`laser.core.depth`) with trained
        exit heads: a :class:`laser.model.exits.ExitHeads`, a path to a file of them, or
        ``"auto"`` (the model's, from ``laser train-exits``). Raises ConfigError when there are
        none there (:func:`laser.spec.self_spec.load_exits`)."""
        from ..model.exits import ExitHeads
        from ..spec.self_spec import load_exits

        heads = exits if isinstance(exits, ExitHeads) else load_exits(self.model_path,
                                                                       None if exits == "auto" else str(exits))
        self.runner.set_exits(heads)
        # the plans price a token that may exit at its expected depth, plus its exit checks
        self.latency_model.exit_cost = heads.cost(self.model)
        self.serves_exits = True

    def _load_latency_model(self, profile: str | None):
        """The profiled model (or the roofline estimate), with a grammar mask cost per sampled
        row: the profile's measurement, else :func:`~laser.profiler.mask.estimate_mask_row_s`."""
        from ..latency import AnalyticLatencyModel, LatencyProfileError, ModelShape
        from ..profiler import load_or_create
        from ..profiler.mask import estimate_mask_row_s

        tok = getattr(self, "tokenizer", None)  # an Engine has loaded it already
        if tok is None:
            tok = self.model_path
        lm = None
        if profile == "auto":
            lm = load_or_create(self.runner, None, create=True, grammar_tokenizer=tok)
        elif profile is not None:
            # the user's own file: use it, or say why not -- never profile over it
            lm = load_or_create(self.runner, profile, create=not os.path.exists(profile), grammar_tokenizer=tok)
        else:
            try:
                lm = load_or_create(self.runner, None, create=False)
            except LatencyProfileError:
                log.info("no latency profile for this setup yet: using a roofline estimate (run `laser profile`)")
        if lm is None:
            shape = ModelShape.from_hf_config(self.model_config.hf_config.to_dict())
            lm = AnalyticLatencyModel(shape, "cpu-2core", dtype_bytes=torch.finfo(self.dtype).bits // 8)
        if not lm.mask_row_s:  # not measured (a profile made before it was, the roofline)
            lm.mask_row_s = estimate_mask_row_s(self.model_config.vocab_size)
        return lm
