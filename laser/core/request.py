"""Request state: SLO, phase, layer position and timestamps.

One small class owns a request's progress (style: nano-vllm ``engine/sequence.py``).
Torch-free: schedulers and the simulator use it directly. The sampling parameters live in
:mod:`laser.core.sampling_params` (re-exported here).

Progress is explicit. ``num_computed_tokens`` tokens have KV at *every* layer. At most
one chunk is in flight: ``chunk_tokens`` tokens starting at position
``num_computed_tokens`` have run layers ``[0, next_layer)``; their hidden state at
``next_layer`` lives in the intermediate cache (never in a local variable).
"""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass, field
from typing import NamedTuple

from .sampling_params import (  # noqa: F401 - re-exported: the names every caller imports from here
    MAX_LOGPROBS,
    SEED_MAX,
    SEED_MIN,
    InvalidRequestError,
    SamplingParams,
    choice_seed,
)


class Phase(enum.Enum):
    WAITING = "waiting"  # nothing computed yet
    PREFILL = "prefill"  # part of the prompt computed
    DECODE = "decode"  # prompt done, generating
    FINISHED = "finished"
    ABORTED = "aborted"


#: Slack for float comparisons against SLO targets (seconds): a TTFT computed as 1.25 - 1.0 may
#: come out a few ulps above 0.25. One nanosecond is far below any measurable latency. The one
#: tolerance of every "within its target" judgement: the metrics' and the schedulers' own.
SLO_EPS = 1e-9


@dataclass(frozen=True)
class SLO:
    """Latency objectives in seconds; ``None`` means unconstrained. ``name`` is the SLO class.

    ``tier`` (``hot``, ``warm``, ``cold``, ``best_effort``; None: not given) is the class's tier
    (:mod:`laser.core.slo`). ``demotable``: a hot request that may be served as warm under pressure.
    ``deadline`` (engine clock, seconds; cold requests of a batch job only) is the queue key the
    schedulers order the request by instead of arrival + TTFT target: the job's latest start time
    (:func:`laser.batch.estimate.start_by`).
    """

    ttft: float | None = None
    tbt: float | None = None
    name: str = "best_effort"
    tier: str | None = None
    demotable: bool = False
    deadline: float | None = None

    def __post_init__(self):
        for k in ("ttft", "tbt"):
            v = getattr(self, k)
            if v is not None and not (v > 0 and math.isfinite(v)):
                raise InvalidRequestError(f"SLO {k} must be a positive number of seconds, got {v!r}")

    @property
    def is_best_effort(self) -> bool:
        return self.ttft is None and self.tbt is None

    @property
    def ttft_or_inf(self) -> float:
        return math.inf if self.ttft is None else self.ttft

    @property
    def tbt_or_inf(self) -> float:
        return math.inf if self.tbt is None else self.tbt


BEST_EFFORT = SLO()


class TokenLogprob(NamedTuple):
    """A token's raw log-probability (natural log, fp32 logits' log-softmax) and the ``top``
    most likely tokens at its position as (token id, logprob), most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


_ids = itertools.count()


@dataclass(eq=False)
class Request:
    """One generation request and its progress through the model."""

    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    slo: SLO = BEST_EFFORT
    arrival_time: float = 0.0
    req_id: str = ""
    prompt: str | None = None

    output_token_ids: list[int] = field(default_factory=list)
    phase: Phase = Phase.WAITING
    # Tokens whose KV exists at every layer.
    num_computed_tokens: int = 0
    # In-flight chunk: tokens [num_computed_tokens, +chunk_tokens) have run layers [0, next_layer).
    chunk_tokens: int = 0
    next_layer: int = 0
    # Absolute time of every output token (first = first token).
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    # Times this request was preempted (its KV freed and recomputed later).
    num_preemptions: int = 0
    # Waiting, and running requests of looser SLO classes were preempted to make room for
    # it: it is admitted before any other waiting request (Scheduler.preempt_for_stricter).
    boosted: bool = False
    # Token gaps over the TBT target so far (the P99-TBT allowance a scheduler may spend).
    num_tbt_misses: int = 0
    # The TBT target cannot be met even by this request alone (latency model): it is served
    # as fast as possible instead of the schedule being cut toward an impossible target.
    tbt_infeasible: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    # Served best effort: queued after every request with a deadline (the controller's
    # fallback when no prefill instance can meet its TTFT, PPoPP'26 §7.1). Its SLO is
    # still what it is judged against.
    demoted: bool = False
    # Laser's overload triage gave up its prefill at some point (its TTFT was judged out of
    # reach beside the savable prompts): served anyway; kept for the record (why it missed).
    given_up: bool = False
    # Times the cluster front end moved it after an instance holding it failed (re-prefilled
    # elsewhere from prompt + tokens so far, or its hand-off re-sent to another decode instance).
    num_failovers: int = 0
    # SamplingParams.logprobs: one TokenLogprob per output token (appended with the token).
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    # SamplingParams.prompt_logprobs: one entry per prompt position (None at position 0,
    # which nothing predicts); filled chunk by chunk as the prefill reaches the last layer.
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def miss_causes(self) -> tuple[str, ...]:
        """What the scheduler knows of why this request may miss its SLO: ``given_up`` (Laser's
        overload triage put its prefill behind the savable ones), ``preempted`` (its KV was freed
        and recomputed), ``demoted`` (served best effort by the cluster controller),
        ``tbt_infeasible`` (its TBT target is out of reach even alone), ``failed_over`` (an
        instance holding it failed and it moved). Empty: none of those."""
        return tuple(c for c, on in (("given_up", self.given_up), ("preempted", self.num_preemptions > 0),
                                     ("demoted", self.demoted), ("tbt_infeasible", self.tbt_infeasible),
                                     ("failed_over", self.num_failovers > 0)) if on)

    @property
    def seed_kept(self) -> bool | None:
        """Whether a failed-over seeded sampled request kept its seeded stream: True (a draw is a
        function of seed and position, :func:`laser.model.sampler.draw_seed`, and the tokens
        replayed by a re-prefill count as generated); None when it never failed over or has no
        seed to keep (greedy or unseeded)."""
        sp = self.sampling_params
        if not self.num_failovers or sp.greedy or sp.seed is None:
            return None
        return True
    # Prompt tokens whose KV came from the prefix cache at its first admission (OpenAI's
    # ``usage.prompt_tokens_details.cached_tokens``); a re-admission after preemption that
    # re-finds its own blocks does not count.
    num_cached_tokens: int = 0
    # Hashes of its full blocks so far (laser.core.block_manager.hash_blocks; grows with the tokens).
    block_hashes: list = field(default_factory=list, repr=False)
    # Dynamic depth (SamplingParams.dynamic_depth): decode tokens counted and the layers they ran
    # (an early exit at layer k counts k); ``expected_layers`` the depth the scheduler plans its
    # next tokens with (running mean, seeded by its SLO class's: laser.core.depth). None: full.
    num_depth_tokens: int = 0
    depth_layers: int = 0
    expected_layers: float | None = None

    @property
    def mean_depth(self) -> float | None:
        """Mean layers run per decode token so far (None before any, or when not opted in)."""
        return self.depth_layers / self.num_depth_tokens if self.num_depth_tokens else None

    def copy_for_instance(self) -> "Request":
        """What a cluster instance gets of this front-end request: the same id, prompt,
        sampling, SLO and arrival; with output so far, a request to re-prefill prompt + output
        (its token times and dynamic-depth totals carried, so TBT and the mean depth continue)."""
        r = Request(prompt_token_ids=list(self.prompt_token_ids), sampling_params=self.sampling_params, slo=self.slo,
                    arrival_time=self.arrival_time, req_id=self.req_id)
        if self.output_token_ids:
            r.output_token_ids = list(self.output_token_ids)
            r.token_times = list(self.token_times)
            r.phase = Phase.PREFILL
            r.num_depth_tokens, r.depth_layers = self.num_depth_tokens, self.depth_layers
            r.expected_layers = self.mean_depth
        return r

    def __post_init__(self):
        if not self.req_id:
            self.req_id = f"req-{next(_ids)}"
        if not self.prompt_token_ids:
            raise InvalidRequestError("prompt is empty")

    # -- derived counts -------------------------------------------------------------
    @property
    def masked(self) -> bool:
        """Its sampled rows go through a grammar mask (``structured_output``): plans price it
        (:attr:`laser.core.plan.Work.masked`, ``LatencyModel.mask_time``)."""
        return self.sampling_params.structured_output is not None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` (``0 <= start <= end``) without building the whole list
        (the runner embeds a decode token per step: one id, not a copy of the context)."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens not yet at every layer and not in flight."""
        return self.num_tokens - self.num_computed_tokens - self.chunk_tokens

    @property
    def in_flight(self) -> bool:
        return self.chunk_tokens > 0

    @property
    def is_finished(self) -> bool:
        return self.phase in (Phase.FINISHED, Phase.ABORTED)

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def tbt_miss_allowance(self) -> int:
        """Token gaps over the TBT target this request may take and still meet its P99 TBT:
        ``floor((g - 1) / 100)`` for ``g`` gaps (then every miss ranks above the linear P99's
        upper rank, :mod:`laser.metrics`), ``g`` the fewest gaps it will have: ``max_tokens - 1``
        when it cannot stop earlier (``ignore_eos``, no stop strings or stop tokens), else the gaps
        it has once its next token is out. ``max_tokens`` alone is an upper bound the judge need
        not count (a chat request whose ``max_tokens`` defaults to the rest of an 8k context was
        let miss up to 80 gaps, then ended at EOS after 60 tokens: its P99 was its largest gap)."""
        sp = self.sampling_params
        if sp.ignore_eos and not sp.stop and not sp.stop_token_ids:
            gaps = sp.max_tokens - 1
        else:
            gaps = min(len(self.output_token_ids), sp.max_tokens - 1)
        return max(0, gaps - 1) // 100

    @property
    def ttft_missed(self) -> bool:
        """Whether its first token came after its TTFT target (False before the first token
        and without a target): its SLO is lost whatever comes next."""
        ttft = self.slo.ttft
        return (ttft is not None and bool(self.token_times)
                and self.token_times[0] - self.arrival_time > ttft + SLO_EPS)  # laser.core.metrics' judgement

    @property
    def p99_tbt_broken(self) -> bool:
        """Whether its P99 TBT, hence its SLO, is lost whatever comes next: at least
        ``g - floor(0.99 (g - 1))`` of its gaps missed the target, ``g`` from ``max_tokens``
        (the most gaps it may have; the count only grows with ``g``). Then the gap at the
        linear P99's lower rank (:mod:`laser.core.metrics`) is over the target. One miss fewer (e.g.
        one miss below 102 tokens) may still leave the P99 within it -- the P99 lies between
        the two largest gaps -- so the request is not given up for it; the stricter
        :attr:`tbt_miss_allowance` is what it may spend knowingly."""
        g = self.sampling_params.max_tokens - 1
        return self.num_tbt_misses >= g - 99 * (g - 1) // 100

    @property
    def ttft_deadline(self) -> float:
        """Arrival + TTFT target (EDF key); inf for best effort."""
        return self.arrival_time + self.slo.ttft_or_inf

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id}, {self.phase.value}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, "
            f"chunk={self.chunk_tokens}@L{self.next_layer})"
        )
