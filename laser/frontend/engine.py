"""The engine: the front end of one in-process instance over its :class:`InstanceCore`.

The core (:mod:`laser.instance.core`) is the instance a controller talks to: token ids in,
token events out; scheduler + model runner + finish rule + hand-off. The engine adds what a
client needs: the model and tokenizer, prompt encoding and validation (a malformed request
is rejected with a clear error and everyone else keeps being served), detokenization, stop
strings and their hold-back (:class:`laser.frontend.detokenizer.OutputText`), and
:class:`RequestOutput` s. ``step()`` = ``core.step()`` -> text.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Callable

from ..core.config import SchedulerConfig
from .detokenizer import OutputText
from ..core.intermediate_cache import IntermediateCache
from ..model.loader import load_config, load_tokenizer, resolve_model
from ..instance.core import Handoff, make_scheduler
from ..instance.model_instance import ModelInstance
from ..core.request import SLO, InvalidRequestError, Request, SamplingParams
from ..core.slo import SLOClasses

log = logging.getLogger(__name__)


def check_text(text: str, where: str) -> None:
    """Raise InvalidRequestError when ``text`` is not valid Unicode text: an unpaired UTF-16
    surrogate (JSON's ``"\\ud800"`` decodes to one) cannot be UTF-8 encoded, and the
    tokenizer raises a TypeError on it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(f"{where} is not valid Unicode text (an unpaired surrogate "
                                  f"{text[e.start]!r} at character {e.start})") from None


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
    # The engine's live request: only the thread that steps the engine may read it (in-process
    # drivers such as ``LLM``); other threads use the copies below.
    request: Request = field(repr=False, default=None)
    # Prefill role: the request continues on a decode instance (see Engine.handoffs).
    handed_off: bool = False
    # Copies taken when the output was made (safe to read from any thread): the request's arrival
    # time and the time of every output token so far (seconds, engine clock).
    arrival_time: float = 0.0
    token_times: tuple[float, ...] = ()
    # Prompt tokens whose KV came from the prefix cache (``usage.prompt_tokens_details.cached_tokens``).
    num_cached_tokens: int = 0


class Engine(ModelInstance):
    """One serving instance.

    Args:
        model: HF checkpoint dir, GGUF file, or None for the embedded SmolLM2.
        policy: scheduling policy name (``vllm``, ``sarathi``, ``laser``).
        dtype: ``auto`` (fp32 unless the CPU has native bf16), ``float32`` or ``bfloat16``.
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
        clock: time source in seconds (monotonic by default).
        seed: seed of the shared sampling generator.
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
        self._text: dict[str, OutputText] = {}
        self.core.on_token = lambda req: self._text[req.req_id].add(req.output_token_ids[-1])

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
        self.core.handoffs.clear()
        if latency_model is not None:
            self.latency_model = latency_model
        if intermediate_cache_tokens is not None:
            self.icache = self.runner.icache = IntermediateCache(intermediate_cache_tokens)
        if clock is not None:
            self.clock = self.core.clock = clock
        self.core.scheduler = make_scheduler(scheduler, self.model_config.num_layers, self.kv_cache.block_manager,
                                             self.icache, self.latency_model, self.clock)
        self.scheduler_config = scheduler

    def predict_prefill_seconds(self, num_tokens: int) -> float:
        """Predicted time of a prefill of ``num_tokens`` tokens running alone (latency model)."""
        return self.latency_model.predict_prefill(num_tokens)

    # -- requests ----------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int] | list[dict]) -> list[int]:
        """Token ids of a prompt: text, token ids, or chat messages (chat template applied)."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            check_text(prompt, "prompt")
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
        for i, m in enumerate(messages):
            for k, v in m.items():
                if isinstance(v, str):
                    check_text(v, f"messages[{i}].{k}")
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
        """Validate and enqueue a request. Raises InvalidRequestError (nothing is enqueued),
        also for ``sampling_params`` that is not a :class:`SamplingParams` (a dict, a list)."""
        sp = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(sp, SamplingParams):
            raise InvalidRequestError(f"sampling_params must be a SamplingParams (or None), got "
                                      f"{type(sp).__name__}: {sp!r:.80}")
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
        text = OutputText(self.tokenizer, ids, sp.stop)  # before enqueueing: nothing is left if it raises
        self.core.add_request(req)
        self._text[req.req_id] = text
        return req

    def abort(self, req_id: str) -> bool:
        """Abort a request, freeing its KV and paused state. False when unknown/finished."""
        self._text.pop(req_id, None)
        return self.core.abort(req_id) is not None

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    # -- the loop ------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling step of the core; returns outputs of the requests that progressed."""
        outs = []
        for ev in self.core.step():
            req = ev.request
            text = self._text[req.req_id]
            reason = ev.finish_reason
            finished = reason is not None
            if finished or ev.handed_off:
                del self._text[req.req_id]
            outs.append(RequestOutput(
                req_id=req.req_id,
                prompt=req.prompt,
                prompt_token_ids=req.prompt_token_ids,
                text=text.visible(finished),
                token_ids=list(req.output_token_ids),
                delta_text=text.delta(finished),
                new_token_ids=[ev.token],
                finished=finished,
                finish_reason=reason,
                handed_off=ev.handed_off,
                slo=req.slo,
                request=req,
                arrival_time=req.arrival_time,
                token_times=tuple(req.token_times),
                num_cached_tokens=req.num_cached_tokens,
            ))
        return outs

    # -- prefill -> decode hand-off ----------------------------------------------------------------------
    def accept_handoff(self, h: Handoff) -> Request:
        """Decode role: adopt a request prefilled elsewhere, importing its KV layer by layer.

        Raises OutOfBlocksError (nothing kept) when the KV pool cannot hold it.
        """
        req = self.core.adopt(h)
        self._text[req.req_id] = OutputText(self.tokenizer, req.prompt_token_ids, req.sampling_params.stop,
                                            req.output_token_ids)
        return req

    def check_integrity(self, expect_empty: bool = False) -> None:
        """Verify block manager, intermediate cache and scheduler state (tests, idle time)."""
        self.core.check_integrity(expect_empty=expect_empty)
