"""The instance core: what a controller talks to. Token ids in, token outputs out.

One :class:`InstanceCore` is one serving instance (role ``mixed``, ``prefill`` or ``decode``)
without any front-end work: no tokenizer, detokenizer, stop strings or SSE. It owns

* the scheduler (torch-free; its clock injected at construction),
* an executor that runs a plan by the walker's rules (:mod:`laser.core.walk`): the torch
  model runner (:class:`laser.model.runner.ModelRunner`) or the latency-model one
  (:class:`laser.sim.instance.SimExecutor`),
* the finished-request rule (:meth:`finish_reason`: EOS, stop token ids, ``max_tokens``, context),
* the prefill -> decode hand-off (:meth:`export` on a prefill instance, :meth:`adopt` on a
  decode one).

``step()`` = schedule -> execute -> update (nano-vllm ``llm_engine.py``); the front end
(:class:`laser.frontend.engine.Engine`) turns its :class:`TokenEvent` s into text. The same core is the
body of a simulated instance and of a Ray actor (:mod:`laser.instance.worker`).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from ..core.config import SchedulerConfig
from ..core.plan import StepPlan, StepResult
from ..core.pricing import quiet_step, warm_streak
from ..core.request import Phase, Request
from ..scheduler import Scheduler, get_policy


class Executor(Protocol):
    """Runs plans for an instance (torch model runner or latency-model simulator)."""

    def execute(self, plan: StepPlan, requests: dict[str, Request],
                stop_at: Callable[[int], bool] | None = None) -> StepResult:
        """Run ``plan`` (see :func:`laser.core.walk.walk`)."""

    def export_kv(self, req: Request) -> list | None:
        """Per layer (K, V) of ``req``'s computed tokens (``None`` where no tensors exist)."""

    def import_kv(self, req: Request, kv: list | None) -> None:
        """Write a handed-off request's KV into blocks allocated for it here.
        Raises OutOfBlocksError (nothing kept) when the pool cannot hold it."""

    def release(self, req_id: str) -> None:
        """Forget per-request executor state (e.g. a seeded sampling generator)."""


@dataclass
class Handoff:
    """A prefilled request leaving a prefill instance: its state and its KV, one (K, V) per layer
    (``[T, kv_heads, head_dim]`` each, T = computed tokens; ``None`` in the simulator)."""

    request: Request
    kv: list | None
    # seconds on the sender's clock when the hand-off was exported (a seeded request's sampling
    # needs nothing carried: its draws are a function of its seed and position, laser.model.sampler)
    time: float = 0.0


@dataclass
class TokenEvent:
    """One request's progress in a step: it got ``token`` (and maybe finished or left)."""

    request: Request
    token: int
    finish_reason: str | None  # stop | length | None (running)
    handed_off: bool = False  # prefill role: left for a decode instance after this token
    # tokens the request got in this step, ``token`` the last of them (> 1: a self-speculative step)
    num_tokens: int = 1
    # SamplingParams.logprobs: ``token``'s raw TokenLogprob (None when not asked)
    logprob: object = None
    # SamplingParams.prompt_logprobs: the request's prompt logprobs, complete, on the event of the
    # step whose prefill chunk computed the last of them (None otherwise): a front end that keeps
    # no copy of the request (a cluster's) gets them with its first token
    prompt_logprobs: list | None = None

    def wire(self) -> list[tuple]:
        """The event as a cluster instance's step answer carries it
        (:meth:`laser.instance.worker.InstanceWorker.step`): one tuple per token it got, in
        order, ``(req_id, token, finish_reason, handed_off, cached prompt tokens, logprob,
        prompt logprobs, depth)`` -- the reason and hand-off on the last token only, the prompt
        logprobs on the first; ``depth``: the request's dynamic-depth totals
        ``(decode tokens, layers they ran)`` so far (None when it has none), which the front
        end reports (:attr:`laser.core.request.Request.mean_depth`)."""
        req = self.request
        n = self.num_tokens
        toks = req.output_token_ids[len(req.output_token_ids) - n:] if n > 1 else [self.token]
        depth = (req.num_depth_tokens, req.depth_layers) if req.num_depth_tokens else None
        last = n - 1
        return [(req.req_id, tok, self.finish_reason if i == last else None, self.handed_off and i == last,
                 req.num_cached_tokens, self.logprob if i == last else None,
                 self.prompt_logprobs if i == 0 else None, depth) for i, tok in enumerate(toks)]


@dataclass
class StepStats:
    """Cumulative time split of ``step`` (seconds): scheduling+bookkeeping vs execution."""

    steps: int = 0
    schedule_s: float = 0.0  # schedule() + update() + outputs
    execute_s: float = 0.0  # executor.execute (layer calls + composition changes)
    compute_s: float = 0.0  # model compute inside execute: layer calls, embedding, LM head, sampling
    layer_calls: int = 0

    @property
    def scheduler_share(self) -> float:
        total = self.schedule_s + self.execute_s
        return self.schedule_s / total if total else 0.0


class StepLog:
    """A bounded :attr:`InstanceCore.step_log`: the last ``capacity`` complete steps, numbered
    from 0 in the order they ran, so a reader on another thread (a server's ``GET /engine/steps``)
    takes the steps since one it saw. Appended by the engine thread; :meth:`since` copies under
    the GIL (a deque copy runs no Python code), so it is safe from any thread.
    Raises ValueError for ``capacity < 1``."""

    def __init__(self, capacity: int, clock: Callable[[], float] | None = None):
        if capacity < 1:
            raise ValueError(f"step log capacity must be >= 1, got {capacity}")
        self._items: collections.deque = collections.deque(maxlen=capacity)
        self.total = 0  # steps appended so far (the next step's number)
        # when each step ended (seconds; the engine's clock: so a slow step lines up with the
        # requests it delayed); time.monotonic by default
        self.clock = clock or time.monotonic

    def append(self, step: tuple) -> None:
        """Keep ``step`` = (plan, seconds) of a step that ran its plan to the end, or (plan,
        seconds, stopped layer) of one cut short (a preemption at a layer boundary, an early
        exit), as the next numbered step, stamped with :attr:`clock` now (its end), dropping the
        oldest when full."""
        plan, secs, *cut = step
        self._items.append((self.total, plan, secs, self.clock(), cut[0] if cut else None))
        self.total += 1

    def since(self, first: int) -> list[tuple]:
        """(number, plan, seconds, ended, stopped layer or None when it ran to the end) of the kept
        steps numbered ``first`` or later, oldest first."""
        return [it for it in list(self._items) if it[0] >= first]


def make_scheduler(config: SchedulerConfig, num_layers: int, block_manager, icache, latency_model,
                   clock: Callable[[], float]) -> Scheduler:
    """A scheduler of ``config.policy`` over an instance's KV pool and intermediate cache."""
    return get_policy(config.policy)(config, num_layers, block_manager, icache, latency_model, clock)


class InstanceCore:
    """Scheduler + executor + finish rule + hand-off of one instance.

    Args:
        scheduler: the instance's scheduler (built with the same ``clock``).
        executor: runs plans. clock: time source (seconds; virtual in the simulator).
        eos_ids: token ids that end a request (unless ``ignore_eos``).
        max_model_len: a request ends (``length``) when its tokens reach this.
        perf_counter: wall-clock timer of the step statistics.
    """

    def __init__(self, scheduler: Scheduler, executor: Executor, clock: Callable[[], float], *,
                 eos_ids: set[int] | frozenset[int] = frozenset(), max_model_len: int = 1 << 62,
                 perf_counter: Callable[[], float] | None = None):

        self.scheduler = scheduler
        self.executor = executor
        self.clock = clock
        self.eos_ids = set(eos_ids)
        self.max_model_len = max_model_len
        self.step_stats = StepStats()
        self._perf = perf_counter or time.perf_counter
        # Called at every layer boundary (and before scheduling): lets a server or a trace
        # driver add requests that arrive while a step runs.
        self.arrival_hook: Callable[[], None] | None = None
        self.handoffs: list[Handoff] = []  # prefill role: requests that left after their first token
        # A list (or a :class:`StepLog`): every step that ran its plan to the end is appended as
        # (plan, seconds on ``clock``) (the engine's measured step times, e.g. for
        # laser.latency.machine_speed); a StepLog also gets the steps cut short, as (plan,
        # seconds, stopped layer); None: not kept.
        self.step_log: list | None = None
        # steps in a row, up to the last one, that were decode steps the latency model prices warm and ran
        # to their end (laser.core.pricing.warm_streak: the next step's plan.warm)
        self._streak = 0

    @property
    def step_observer(self) -> Callable[[StepPlan, float], None] | None:
        """Told (plan, seconds on ``clock``) after every step that ran its plan to the end: the
        online calibration of the model the scheduler plans with, when it has one
        (:class:`laser.latency.CalibratedLatencyModel`); None otherwise."""
        return self.scheduler.step_observer

    @property
    def role(self) -> str:
        return self.scheduler.role

    # -- requests ----------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a validated request. Raises ValueError on a duplicate id (nothing changes)."""
        self.scheduler.add_request(req)

    def abort(self, req_id: str) -> Request | None:
        """Abort a request, freeing its KV and paused state. None when unknown/finished."""
        req = self.scheduler.abort(req_id, self.clock())
        self.executor.release(req_id)
        return req

    def finish(self, req: Request, reason: str) -> None:
        """End ``req`` now (``reason``: ``stop``, ``length`` or ``handoff``)."""
        self.scheduler.finish(req, reason, self.clock())
        self.executor.release(req.req_id)

    def stop(self, req: Request) -> None:
        """The front end matched a stop string in ``req``'s text: end it as ``stop``, also when it
        was just handed off (its hand-off is dropped from :attr:`handoffs`)."""
        for i, h in enumerate(self.handoffs):
            if h.request is req:
                del self.handoffs[i]
                req.finish_reason = "stop"
                return
        self.finish(req, "stop")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def has_request(self, req_id: str) -> bool:
        """``req_id`` is an unfinished request here."""
        return self.scheduler.has_request(req_id)

    def request_ids(self) -> list[str]:
        """The ids of the unfinished requests, oldest first."""
        return self.scheduler.request_ids()

    def finish_reason(self, req: Request) -> str | None:
        """The finished-request rule (one owner), for ``req``'s newest token: ``stop`` on EOS
        (unless ``ignore_eos``) or a stop token id; ``length`` at ``max_tokens`` or the context
        limit; else None. The instance judges token ids only: a stop *string* is the front
        end's (:mod:`laser.frontend.outputs`), which then calls :meth:`stop`."""
        sp = req.sampling_params
        tok = req.output_token_ids[-1]
        if (not sp.ignore_eos and tok in self.eos_ids) or tok in sp.stop_token_ids:
            return "stop"
        if req.num_output_tokens >= sp.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    # -- the loop ------------------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """One scheduling step: :meth:`schedule` then :meth:`execute`. Returns the requests that
        got a token (finished ones are already freed; prefill-role ones already handed off)."""
        plan = self.schedule()
        return self.execute(plan) if plan else []

    def schedule(self) -> StepPlan:
        """First half of a step: deliver arrivals, let the scheduler plan (allocates, admits)."""
        if self.arrival_hook is not None:
            self.arrival_hook()
        t0 = self._perf()
        plan = self.scheduler.schedule(self.clock())
        lm = self.scheduler.latency_model
        if plan and self._streak and lm is not None:
            plan.warm = warm_streak(lm, self._streak, plan)
        self.step_stats.schedule_s += self._perf() - t0
        return plan

    def execute(self, plan: StepPlan) -> list[TokenEvent]:
        """Second half: execute ``plan`` (from :meth:`schedule`), update the scheduler, apply
        the finish rule and the hand-off."""
        t1 = self._perf()
        observe, log = self.step_observer, self.step_log
        c1 = self.clock() if observe is not None or log is not None else 0.0
        result = self.executor.execute(plan, self.scheduler.requests_of(plan), stop_at=self._stop_fn())
        now = self.clock()
        t2 = self._perf()
        lm = self.scheduler.latency_model
        self._streak = (self._streak + 1 if lm is not None and plan and result.stopped_layer >= plan.last_layer
                        and (plan.warm > 0 or quiet_step(lm, plan)) else 0)  # (warm: warm_streak found it quiet)
        if observe is not None or log is not None:
            # (a step where tokens exited early ran fewer layers than the plan it would be judged
            # by; one priced with tokens that may exit, at their expected depth, is not judged either)
            whole = (result.stopped_layer >= plan.last_layer and not result.exit_layers
                     and not any(w.exit_from for w in plan.works))
            if whole and observe is not None:
                observe(plan, now - c1)  # the instance's clock: wall time, or virtual in the simulator
            if whole and log is not None:
                log.append((plan, now - c1))
            elif isinstance(log, StepLog):  # a served engine's log keeps cut steps too (stalls hide there)
                log.append((plan, now - c1, result.stopped_layer))
        events = []
        hands_off = self.role == "prefill"
        if result.prompt_logprobs:
            self._keep_prompt_logprobs(result.prompt_logprobs)
        extra = result.extra_tokens
        for req in self.scheduler.update(plan, result.stopped_layer, result.sampled, now, result.exit_layers):
            lp = result.logprobs.get(req.req_id)
            if lp is not None:
                req.output_logprobs.append(lp)
            plp = req.prompt_logprobs if req.req_id in result.prompt_logprobs else None
            reason = self.finish_reason(req)
            got = 1
            for tok in extra.get(req.req_id, ()) if reason is None else ():
                self.scheduler.append_token(req, tok, now)
                got += 1
                reason = self.finish_reason(req)
                if reason is not None:
                    break
            ev = TokenEvent(req, req.output_token_ids[-1], reason, num_tokens=got, logprob=lp,
                            prompt_logprobs=None if plp is None else list(plp))
            if reason is not None:
                self.finish(req, reason)
            elif hands_off:
                self.handoffs.append(self.export(req, now))
                ev.handed_off = True
            events.append(ev)
        st = self.step_stats
        st.steps += 1
        st.schedule_s += self._perf() - t2
        st.execute_s += t2 - t1
        st.compute_s += result.compute_seconds
        st.layer_calls += result.num_layer_calls
        return events

    def _keep_prompt_logprobs(self, chunks: dict) -> None:
        """Store each prefill chunk's prompt log-probabilities on its request, by position (a
        chunk recomputed after a preemption overwrites its own positions)."""
        for rid, (start, entries) in chunks.items():
            req = self.scheduler.get_request(rid)
            if req is None:
                continue
            if req.prompt_logprobs is None:
                req.prompt_logprobs = [None] * req.num_prompt_tokens
            req.prompt_logprobs[start:start + len(entries)] = entries

    def _stop_fn(self) -> Callable[[int], bool]:
        """The step's ``stop_at(layer)``: deliver arrivals (:attr:`arrival_hook`), then ask the
        scheduler. Both looked up once a step: the walker asks at every layer boundary, right after a
        layer call, where each attribute lookup is a cache miss."""
        hook, stop = self.arrival_hook, self.scheduler.stop_at
        if hook is None:
            return stop

        def stop_at(layer: int) -> bool:
            hook()
            return stop(layer)
        return stop_at

    # -- prefill -> decode hand-off ------------------------------------------------------------------
    def export(self, req: Request, now: float) -> Handoff:
        """Package ``req`` with its KV and free it here: a prefill instance's hand-off after the
        first token, or a decode->decode migration between steps."""
        h = Handoff(req, self.executor.export_kv(req), now)
        self.finish(req, "handoff")
        return h

    def adopt(self, h: Handoff) -> Request:
        """Decode role: continue a request prefilled (or decoding, migrated) elsewhere (its KV
        imported layer by layer); its TBT misses so far come with it.
        Raises OutOfBlocksError (nothing kept) when the KV pool cannot hold it."""
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
        req.output_logprobs = list(src.output_logprobs)
        req.prompt_logprobs = None if src.prompt_logprobs is None else list(src.prompt_logprobs)
        req.num_computed_tokens = src.num_computed_tokens
        req.num_tbt_misses = src.num_tbt_misses
        req.num_depth_tokens, req.depth_layers = src.num_depth_tokens, src.depth_layers
        req.expected_layers = src.expected_layers
        req.tbt_infeasible = src.tbt_infeasible
        req.phase = Phase.DECODE
        self.executor.import_kv(req, h.kv)
        self.scheduler.add_running(req)
        return req

    def check_integrity(self, expect_empty: bool = False) -> None:
        """Verify block manager, intermediate cache and scheduler state, and (the torch executor)
        that no K/V slot a request reads or holds as computed was left unwritten (tests, idle time)."""
        self.scheduler.check_integrity(expect_empty=expect_empty)
        check = getattr(self.executor, "check_integrity", None)
        if check is not None:
            check(self.scheduler.running_requests())
