"""The engine: the front end of one in-process instance over its :class:`InstanceCore`.

The core (:mod:`laser.instance.core`) is the instance a controller talks to: token ids in,
token events out; scheduler + model runner + finish rule + hand-off. The engine adds what a
client needs: the model and tokenizer, the input path (:mod:`laser.frontend.inputs`: a
malformed request is rejected with a clear error and everyone else keeps being served) and the
output path (:mod:`laser.frontend.outputs`: detokenization, stop strings and their hold-back,
:class:`RequestOutput` s). ``step()`` = ``core.step()`` -> outputs; a stop string stops the
request on the core.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

from ..core.config import SchedulerConfig
from .inputs import InputProcessor
from .outputs import OutputProcessor, RequestOutput
from ..core.intermediate_cache import IntermediateCache
from ..model.loader import load_config, load_tokenizer, resolve_model
from ..instance.core import Handoff, make_scheduler
from ..instance.model_instance import ModelInstance
from ..core.request import SLO, InvalidRequestError, Request, SamplingParams
from ..core.slo import SLOClasses

log = logging.getLogger(__name__)


class Engine(ModelInstance):
    """One serving instance.

    Args:
        model: HF checkpoint dir, GGUF file, or None for the embedded SmolLM2.
        policy: scheduling policy name (``vllm``, ``sarathi``, ``laser``).
        dtype: ``auto`` (fp32 unless the CPU has native bf16), ``float32`` or ``bfloat16``.
        quantization: weight format of the linear layers: ``auto`` (a GGUF file in its own
            quantization, a HF checkpoint dense), ``none`` (dense in ``dtype``), ``int8``
            (per channel) or ``int4`` (group 32); see :mod:`laser.model.quant`.
        cache: KV/intermediate cache sizing. scheduler: scheduler config (policy overrides its name).
        slo_classes: SLO class table (the shipped one by default).
        (other keyword arguments: :class:`laser.instance.model_instance.ModelInstance`'s)
        latency_model: the model the schedulers plan with; overrides ``latency_profile``.
        latency_profile: ``None`` — use the cached profile of this setup if there is one, else
            an analytic (roofline) estimate; ``"auto"`` — the cached profile, profiling this
            machine now (< 60 s) when missing or stale; a path — that profile file, used as is
            (created there only when missing: a file that is corrupt or made for another setup
            raises ``LatencyProfileError`` and is left alone).
        latency_calibration: plan with the loaded (or estimated) model scaled by how the
            machine runs now (:class:`~laser.latency.calibrated.CalibratedLatencyModel`,
            default True); a ``latency_model`` given here is used as it is.
        jitter_margin: with the calibration, divide Laser's planning margins by the measured
            timing spread of the steps (:meth:`CalibratedLatencyModel.timing_spread
            <laser.latency.calibrated.CalibratedLatencyModel.timing_spread>`, its 98th percentile
            over the factor): fewer TBT misses on a jittery machine, less prefill per iteration.
            None (default): on with the calibration; False: fixed margins
            (:func:`laser.instance.model_instance.planning_model`).
        clock: time source in seconds (monotonic by default).
        seed: seed of the shared sampling generator.
        speculative: a :class:`laser.spec.SpeculativeConfig` to decode greedy requests
            self-speculatively from trained early exits (any policy; ``laser`` prices the draft and
            verify passes in its plans).
        exits: trained exit heads that serve dynamic-depth requests (lossy early exit, opt-in per
            request or SLO class: :mod:`laser.core.depth`): a :class:`laser.model.exits.ExitHeads`,
            a path to a file of them, or ``"auto"`` (the model's, trained by ``laser train-exits``;
            ConfigError when there are none). None: no early exits (a request asking is refused).
        enable_prefix_caching: override ``cache.enable_prefix_caching`` (automatic prefix caching,
            on by default: :mod:`laser.core.block_manager`); vLLM's ``LLM(enable_prefix_caching=...)``.
    Raises:
        ModelLoadError: the model path is unusable. ConfigError: bad config values.
        LatencyProfileError: ``latency_profile`` names an unusable profile file.
    """

    def __init__(self, model: str | None = None, slo_classes: SLOClasses | None = None, **kwargs):
        path = resolve_model(model)
        load_config(path)  # a bad config is reported as such, before the tokenizer trips over it
        self.tokenizer = load_tokenizer(path)
        eos = () if self.tokenizer.eos_token_id is None else (self.tokenizer.eos_token_id,)
        super().__init__(model, extra_eos_ids=eos, **kwargs)
        self.slo_classes = slo_classes or SLOClasses.load()
        from ..model.structured import GrammarBackend

        self.grammars = self.runner.sampler.grammars = GrammarBackend(self.tokenizer, self.model_config.vocab_size,
                                                                      self.core.eos_ids)
        self.inputs = InputProcessor(self.tokenizer, self.model_config.vocab_size, self.max_model_len,
                                     self.slo_classes, self.grammars, serves_exits=self.serves_exits)
        self.outputs = OutputProcessor(self.tokenizer)

    # -- the core's state, read through (the core owns it) ------------------------------------------------
    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def role(self) -> str:
        return self.core.role

    @property
    def eos_ids(self) -> set[int]:
        return self.core.eos_ids

    @property
    def stats(self):
        """Cumulative time split of ``step`` (:class:`laser.instance.core.StepStats`)."""
        return self.core.step_stats

    @property
    def handoffs(self) -> list[Handoff]:
        """Prefill role: requests handed off after their first token, for a decode instance."""
        return self.core.handoffs

    @property
    def arrival_hook(self) -> Callable[[], None] | None:
        """Called at every layer boundary (and before scheduling): lets a server or a trace driver
        add requests that arrive while a step runs, so the scheduler can react at the next boundary."""
        return self.core.arrival_hook

    @arrival_hook.setter
    def arrival_hook(self, fn: Callable[[], None] | None) -> None:
        self.core.arrival_hook = fn

    def set_policy(self, policy: str, latency_model=None, **config_overrides) -> None:
        """Serve with a fresh scheduler of ``policy`` (this engine's scheduler config with
        ``config_overrides``); see :meth:`reconfigure`."""
        self.reconfigure(dataclasses.replace(self.scheduler_config, policy=policy, **config_overrides), latency_model)

    def reconfigure(self, scheduler: SchedulerConfig, latency_model=None, intermediate_cache_tokens: int | None = None,
                    clock: Callable[[], float] | None = None) -> None:
        """Serve with a fresh scheduler of config ``scheduler`` over the same model and KV pool
        (benchmarks and tests compare policies on one loaded model). ``latency_model``: what it
        plans with (default: the engine's); ``intermediate_cache_tokens``: a fresh intermediate
        cache of that capacity; ``clock``: a new time source. Raises AssertionError unless idle."""
        self.check_integrity(expect_empty=True)
        if self.speculator is not None:
            from ..spec.self_spec import check_policy

            check_policy(scheduler.policy)
        self.core.handoffs.clear()
        if latency_model is not None:
            self.latency_model = latency_model
        if intermediate_cache_tokens is not None:
            self.icache = self.runner.icache = IntermediateCache(intermediate_cache_tokens)
        if clock is not None:
            self.clock = self.core.clock = clock
        self.core.scheduler = make_scheduler(scheduler, self.model_config.num_layers, self.kv_cache.block_manager,
                                             self.icache, self.latency_model, self.clock)
        if self.speculator is not None:
            self.core.scheduler.set_speculation(self.speculator.shape)
        self.scheduler_config = scheduler

    def predict_prefill_seconds(self, num_tokens: int) -> float:
        """Predicted time of a prefill of ``num_tokens`` tokens running alone (latency model)."""
        return self.latency_model.predict_prefill(num_tokens)

    # -- requests ----------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int] | list[dict]) -> list[int]:
        """Token ids of a prompt: text, token ids, or chat messages (:mod:`laser.frontend.inputs`)."""
        return self.inputs.encode_prompt(prompt)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation (:meth:`InputProcessor.apply_chat_template`)."""
        return self.inputs.apply_chat_template(messages)

    def add_request(
        self,
        prompt: str | list[int] | list[dict],
        sampling_params: SamplingParams | None = None,
        slo: SLO | str | None = None,
        req_id: str | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """Validate (:meth:`InputProcessor.process`) and enqueue a request. Raises
        InvalidRequestError (nothing is enqueued)."""
        return self.add_processed(self.inputs.process(prompt, sampling_params, slo, req_id, arrival_time,
                                                      self.clock, self.core.has_request))

    def add_processed(self, req: Request) -> Request:
        """Enqueue a request the input path built (:meth:`InputProcessor.process`). Raises
        InvalidRequestError when its id is in use (nothing is enqueued)."""
        if self.core.has_request(req.req_id):
            raise InvalidRequestError(f"request id {req.req_id!r} is already in use")
        self.core.add_request(req)
        self.outputs.add_request(req)
        return req

    def abort(self, req_id: str) -> bool:
        """Abort a request, freeing its KV and paused state. False when unknown/finished."""
        self.outputs.abort(req_id)
        return self.core.abort(req_id) is not None

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def request_ids(self) -> list[str]:
        """The ids of the unfinished requests."""
        return self.core.request_ids()

    # -- the loop ------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling step of the core; returns outputs of the requests that progressed. A
        request whose text matched a stop string is stopped on the core (its hand-off dropped)."""
        outs = []
        for ev in self.core.step():
            out, stop = self.outputs.process(ev.request, ev.token, ev.finish_reason, ev.handed_off,
                                               num_tokens=ev.num_tokens)
            if stop:
                self.core.stop(ev.request)
            elif out.handed_off:  # the decode instance's engine streams it on (accept_handoff)
                self.outputs.abort(ev.request.req_id)
            outs.append(out)
        return outs

    # -- prefill -> decode hand-off ----------------------------------------------------------------------
    def accept_handoff(self, h: Handoff) -> Request:
        """Decode role: adopt a request prefilled elsewhere, importing its KV layer by layer.

        Raises OutOfBlocksError (nothing kept) when the KV pool cannot hold it.
        """
        req = self.core.adopt(h)
        self.outputs.add_request(req)
        return req

    def check_integrity(self, expect_empty: bool = False) -> None:
        """Verify block manager, intermediate cache and scheduler state (tests, idle time)."""
        self.core.check_integrity(expect_empty=expect_empty)
