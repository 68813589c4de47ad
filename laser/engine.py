"""The engine: ``step()`` = schedule -> execute -> update (style: nano-vllm ``llm_engine.py``).

One engine is one *instance* (role mixed, prefill or decode). It owns the model runner,
the scheduler, the tokenizer and the per-request detokenizers; it validates requests
before they reach the scheduler, so a malformed request is rejected with a clear error
and everyone else keeps being served.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .config import CacheConfig, SchedulerConfig, resolve_max_model_len
from .detokenizer import IncrementalDetokenizer, find_stop
from .intermediate_cache import IntermediateCache
from .kv_cache import KVCache
from .model.llama import LlamaModel
from .model.loader import load_config, load_tokenizer, load_weights, resolve_dtype, resolve_model
from .model_runner import ModelRunner
from .request import SLO, InvalidRequestError, Phase, Request, SamplingParams
from .sampler import Sampler
from .scheduler import get_policy
from .slo import SLOClasses

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """Progress of one request after a step (cumulative text and tokens, plus the delta)."""

    req_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    delta_text: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    slo: SLO
    request: Request = field(repr=False, default=None)
    # Prefill role: the request continues on a decode instance (see Engine.handoffs).
    handed_off: bool = False

    def record(self):
        return request_record(self.request)


def request_record(req: Request):
    """Metrics view of a request: a :class:`laser.metrics.RequestRecord`."""
    from .metrics import record_from_request

    return record_from_request(req)


@dataclass
class EngineStats:
    """Cumulative time split of ``Engine.step`` (seconds): scheduling+bookkeeping vs execution."""

    steps: int = 0
    schedule_s: float = 0.0  # schedule() + update() + outputs
    execute_s: float = 0.0  # runner.execute (layer calls + composition changes)
    layer_s: float = 0.0  # inside forward_layer only
    layer_calls: int = 0

    @property
    def scheduler_share(self) -> float:
        total = self.schedule_s + self.execute_s
        return self.schedule_s / total if total else 0.0


@dataclass
class Handoff:
    """A prefilled request leaving a prefill instance: its state and KV, one (K, V) per layer."""

    request: Request
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: ([T, kv_heads, head_dim], same)
    text: str


class Engine:
    """One serving instance.

    Args:
        model: HF checkpoint dir, GGUF file, or None for the embedded SmolLM2.
        policy: scheduling policy name (``vllm``, ``sarathi``, ``laser``).
        dtype: ``auto`` (fp32 unless the CPU has native bf16), ``float32`` or ``bfloat16``.
        cache: KV/intermediate cache sizing. scheduler: scheduler config (policy overrides its name).
        slo_classes: SLO class table (the shipped one by default).
        latency_model: the model the schedulers plan with; overrides ``latency_profile``.
        latency_profile: ``None`` — use the cached profile of this setup if there is one, else
            an analytic (roofline) estimate; ``"auto"`` — the cached profile, profiling this
            machine now (< 60 s) when missing or stale; a path — that profile file, used as is
            (created there only when missing: a file that is corrupt or made for another setup
            raises ``LatencyProfileError`` and is left alone).
        clock: time source in seconds (monotonic by default).
        seed: seed of the shared sampling generator.
    Raises:
        ModelLoadError: the model path is unusable. ConfigError: bad config values.
        LatencyProfileError: ``latency_profile`` names an unusable profile file.
    """

    def __init__(
        self,
        model: str | None = None,
        policy: str = "laser",
        dtype: str | torch.dtype = "auto",
        cache: CacheConfig | None = None,
        scheduler: SchedulerConfig | None = None,
        slo_classes: SLOClasses | None = None,
        latency_model=None,
        latency_profile: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        seed: int = 0,
        max_model_len: int | None = None,
    ):
        path = resolve_model(model)
        self.model_path = path
        self.model_name = "smollm2" if model is None else str(model)
        self.model_config = load_config(path)
        self.dtype = resolve_dtype(dtype)
        self.tokenizer = load_tokenizer(path)
        weights = load_weights(path)
        self.model = LlamaModel(self.model_config, weights, self.dtype)
        del weights
        self.cache_config = cache or CacheConfig()
        self.kv_cache = KVCache(self.model_config, self.cache_config, self.dtype)
        self.icache = IntermediateCache(self.cache_config.intermediate_cache_tokens)
        self.runner = ModelRunner(self.model, self.kv_cache, self.icache, Sampler(seed))
        sched_cfg = scheduler or SchedulerConfig(policy=policy)
        if scheduler is not None and policy != sched_cfg.policy:
            sched_cfg = SchedulerConfig(**{**sched_cfg.__dict__, "policy": policy})
        self.scheduler_config = sched_cfg
        self.latency_profile = latency_profile
        self.latency_model = latency_model or self._load_latency_model(latency_profile)
        self.scheduler = get_policy(sched_cfg.policy)(
            sched_cfg, self.model_config.num_layers, self.kv_cache.block_manager, self.icache, self.latency_model
        )
        self.slo_classes = slo_classes or SLOClasses.load()
        self.clock = clock
        self.scheduler.clock = clock
        self.role = sched_cfg.role
        # Called at every layer boundary (and before scheduling): lets a server or a trace
        # driver add requests that arrive while a step runs, so the scheduler can react
        # at the next layer boundary.
        self.arrival_hook: Callable[[], None] | None = None
        # Prefill role: requests handed off after their first token, for a decode instance.
        self.handoffs: list[Handoff] = []
        self.max_model_len = resolve_max_model_len(
            max_model_len, self.model_config.max_position, self.kv_cache.num_blocks * self.cache_config.block_size
        )
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self.eos_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self.last_result = None
        self.stats = EngineStats()

    def _load_latency_model(self, profile: str | None):
        from .latency_model import AnalyticLatencyModel, LatencyProfileError, ModelShape
        from .profiler import load_or_create

        if profile == "auto":
            return load_or_create(self.runner, None, create=True)
        if profile is not None:
            # the user's own file: use it, or say why not -- never profile over it
            return load_or_create(self.runner, profile, create=not os.path.exists(profile))
        try:
            return load_or_create(self.runner, None, create=False)
        except LatencyProfileError:
            log.info("no latency profile for this setup yet: using a roofline estimate (run `laser profile`)")
        shape = ModelShape.from_hf_config(self.model_config.hf_config.to_dict())
        return AnalyticLatencyModel(shape, "cpu-2core", dtype_bytes=torch.finfo(self.dtype).bits // 8)

    def predict_prefill_seconds(self, num_tokens: int) -> float:
        """Predicted time of a prefill of ``num_tokens`` tokens running alone (latency model)."""
        return self.latency_model.predict_prefill(num_tokens)

    # -- requests ----------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int] | list[dict]) -> list[int]:
        """Token ids of a prompt: text, token ids, or chat messages (chat template applied)."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            return self.apply_chat_template(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise InvalidRequestError(f"token id {bad[0]} out of range [0, {self.model_config.vocab_size})")
            return list(prompt)
        raise InvalidRequestError("prompt must be a non-empty string, token id list or message list")

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if not messages:
            raise InvalidRequestError("messages are empty")
        if self.tokenizer.chat_template is None:
            text = "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"
            return self.tokenizer.encode(text)
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as e:  # noqa: BLE001 - template errors are the caller's input
            raise InvalidRequestError(f"cannot apply chat template: {e}") from e
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def add_request(
        self,
        prompt: str | list[int] | list[dict],
        sampling_params: SamplingParams | None = None,
        slo: SLO | str | None = None,
        req_id: str | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """Validate and enqueue a request. Raises InvalidRequestError (nothing is enqueued)."""
        sp = sampling_params or SamplingParams()
        ids = self.encode_prompt(prompt)
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; this model's context is {self.max_model_len} tokens"
            )
        if isinstance(slo, SLO):
            slo_obj = slo
        else:
            slo_obj = self.slo_classes.get(slo)
        if req_id is not None and req_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {req_id!r} is already in use")
        req = Request(
            prompt_token_ids=ids,
            sampling_params=sp,
            slo=slo_obj,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            req_id=req_id or "",
            prompt=prompt if isinstance(prompt, str) else None,
        )
        self._detok[req.req_id] = IncrementalDetokenizer(self.tokenizer, ids)
        self.scheduler.add_request(req)
        return req

    def abort(self, req_id: str) -> bool:
        """Abort a request, freeing its KV and paused state. False when unknown/finished."""
        req = self.scheduler.abort(req_id, self.clock())
        self._release(req_id)
        return req is not None

    def _release(self, req_id: str) -> None:
        self._detok.pop(req_id, None)
        self.runner.sampler.release(req_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop ------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling step: schedule -> execute -> update. Returns outputs of requests that progressed."""
        if self.arrival_hook is not None:
            self.arrival_hook()
        t0 = time.perf_counter()
        plan = self.scheduler.schedule(self.clock())
        if not plan:
            return []
        t1 = time.perf_counter()
        result = self.runner.execute(plan, self.scheduler.requests, stop_at=self._stop_at)
        self.last_result = result
        now = self.clock()
        t2 = time.perf_counter()
        updated = self.scheduler.update(plan, result.stopped_layer, result.sampled, now)
        outs = [self._emit(req, now) for req in updated]
        st = self.stats
        st.steps += 1
        st.schedule_s += t1 - t0 + time.perf_counter() - t2
        st.execute_s += t2 - t1
        st.layer_s += result.layer_seconds
        st.layer_calls += result.num_layer_calls
        return outs

    def _stop_at(self, layer: int) -> bool:
        if self.arrival_hook is not None:
            self.arrival_hook()
        return self.scheduler.stop_at(layer)

    def _emit(self, req: Request, now: float) -> RequestOutput:
        sp = req.sampling_params
        tok = req.output_token_ids[-1]
        detok = self._detok[req.req_id]
        prev_len = len(detok.text)
        delta = detok.add(tok)
        reason = None
        if not sp.ignore_eos and tok in self.eos_ids:
            reason = "stop"
        elif tok in sp.stop_token_ids:
            reason = "stop"
        elif sp.stop and delta:
            cut = find_stop(detok.text, sp.stop, len(delta))
            if cut is not None:
                detok.text = detok.text[:cut]
                reason = "stop"
        if reason is None and (req.num_output_tokens >= sp.max_tokens or req.num_tokens >= self.max_model_len):
            reason = "length"
        handoff = reason is None and self.role == "prefill"
        if handoff:
            self.handoffs.append(self._export(req))
            self.scheduler.finish(req, "handoff", now)
            self._release(req.req_id)
        elif reason is not None:
            self.scheduler.finish(req, reason, now)
            self._release(req.req_id)
        # Hold back text that could still turn out to be the start of a stop string, so the
        # streamed deltas always add up to the final (cut) text.
        hold = 0 if reason is not None or not sp.stop else max(len(x) for x in sp.stop) - 1
        hold_prev = 0 if not sp.stop else max(len(x) for x in sp.stop) - 1
        text = detok.text[: max(0, len(detok.text) - hold)]
        delta = text[max(0, prev_len - hold_prev) :]
        return RequestOutput(
            req_id=req.req_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            text=text,
            token_ids=list(req.output_token_ids),
            delta_text=delta,
            new_token_ids=[tok],
            finished=reason is not None,
            finish_reason=reason,
            handed_off=handoff,
            slo=req.slo,
            request=req,
        )

    # -- prefill -> decode hand-off ----------------------------------------------------------------------
    def _export(self, req: Request) -> "Handoff":
        n = req.num_computed_tokens
        kv = [self.kv_cache.export_layer(req.req_id, layer, n) for layer in range(self.model_config.num_layers)]
        return Handoff(req, kv, self._detok[req.req_id].text)

    def accept_handoff(self, h: "Handoff") -> Request:
        """Decode role: adopt a request prefilled elsewhere, importing its KV layer by layer.

        Raises OutOfBlocksError (nothing kept) when the KV pool cannot hold it.
        """
        src = h.request
        req = Request(
            prompt_token_ids=list(src.prompt_token_ids),
            sampling_params=src.sampling_params,
            slo=src.slo,
            arrival_time=src.arrival_time,
            req_id=src.req_id,
            prompt=src.prompt,
        )
        req.output_token_ids = list(src.output_token_ids)
        req.token_times = list(src.token_times)
        req.num_computed_tokens = src.num_computed_tokens
        req.phase = Phase.DECODE
        try:
            for layer, (k, v) in enumerate(h.kv):
                self.kv_cache.import_layer(req.req_id, layer, k, v)
        except Exception:
            self.kv_cache.block_manager.free(req.req_id)
            raise
        det = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids)
        for t in req.output_token_ids:
            det.add(t)
        self._detok[req.req_id] = det
        self.scheduler.add_running(req)
        return req

    def check_integrity(self, expect_empty: bool = False) -> None:
        """Verify block manager, intermediate cache and scheduler state (tests, idle time)."""
        self.scheduler.check_integrity(expect_empty=expect_empty)
