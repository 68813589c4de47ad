"""Request state: sampling parameters, SLO, phase, layer position and timestamps.

One small class owns a request's progress (style: nano-vllm ``engine/sequence.py``).
Torch-free: schedulers and the simulator use it directly.

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


class Phase(enum.Enum):
    WAITING = "waiting"  # nothing computed yet
    PREFILL = "prefill"  # part of the prompt computed
    DECODE = "decode"  # prompt done, generating
    FINISHED = "finished"
    ABORTED = "aborted"


class InvalidRequestError(ValueError):
    """A request is malformed (empty prompt, too long, bad sampling parameters...)."""


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


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters (vLLM names and semantics).

    ``temperature < 1e-5`` is greedy. ``top_k <= 0`` disables top-k; ``top_p == 1`` disables
    top-p. ``seed`` gives the request its own generator, so a seeded request samples the
    same tokens whatever it is batched with.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        """Normalise ``stop``/``stop_token_ids`` to tuples and check every field.

        Raises:
            InvalidRequestError: a field of the wrong type (a bool is not a number here) or
                out of range; the message names the field and what it wants.
        """
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))

        def integer(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def number(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        if not integer(self.max_tokens) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (number(self.temperature) and self.temperature >= 0 and math.isfinite(self.temperature)):
            raise InvalidRequestError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not (number(self.top_p) and 0 < self.top_p <= 1):
            raise InvalidRequestError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not integer(self.top_k) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and not (integer(self.seed) and -(2**63) <= self.seed < 2**64):
            raise InvalidRequestError(f"seed must be an integer in [-2^63, 2^64), got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        if any(not isinstance(s, str) for s in self.stop):
            raise InvalidRequestError(f"stop must be a string or a list of strings, got {list(self.stop)!r}")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty")
        if any(not integer(t) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be non-negative integers, got {list(self.stop_token_ids)!r}")

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 are greedy (as vLLM): dividing logits by ~0 overflows."""
        return self.temperature < 1e-5


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
    # Prompt tokens whose KV came from the prefix cache at its first admission (OpenAI's
    # ``usage.prompt_tokens_details.cached_tokens``); a re-admission after preemption that
    # re-finds its own blocks does not count.
    num_cached_tokens: int = 0
    # Hashes of its full blocks so far (laser.core.block_manager.hash_blocks; grows with the tokens).
    block_hashes: list = field(default_factory=list, repr=False)

    def __post_init__(self):
        if not self.req_id:
            self.req_id = f"req-{next(_ids)}"
        if not self.prompt_token_ids:
            raise InvalidRequestError("prompt is empty")

    # -- derived counts -------------------------------------------------------------
    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

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
        ``floor((g - 1) / 100)`` for ``g`` gaps, ``g`` from ``max_tokens`` (an upper bound)."""
        return (self.sampling_params.max_tokens - 2) // 100

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
