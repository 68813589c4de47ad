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
from typing import NamedTuple


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

#: Most log-probabilities per token a request may ask for (vLLM's default ``max_logprobs``).
MAX_LOGPROBS = 20
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # a seed's range (vLLM and OpenAI accept the int64/uint64 union)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters (vLLM names and semantics).

    ``temperature < 1e-5`` is greedy. ``top_k <= 0`` disables top-k; ``top_p == 1`` disables
    top-p. ``seed`` gives the request its own generator, so a seeded request samples the
    same tokens whatever it is batched with.

    Logits processing (vLLM's order and formulas, ``vllm/v1/sample/sampler.py``): ``logit_bias``
    (token id -> value added to its logit, in [-100, 100]) and ``min_tokens`` (EOS -- unless
    ``ignore_eos`` -- and ``stop_token_ids`` masked while fewer than ``min_tokens`` tokens are
    generated; stop strings are matched only past ``min_tokens`` tokens), then the penalties:
    ``repetition_penalty`` (> 0, 1 = off; a logit of a token seen in the prompt *or* the output
    is divided by it when positive, multiplied when not), ``frequency_penalty`` (in [-2, 2];
    minus penalty x the token's count in the output) and ``presence_penalty`` (in [-2, 2]; minus
    penalty once the token is in the output). The output counts every generated token,
    including those replayed by a re-prefill. Then temperature, ``min_p`` (in [0, 1]; tokens of
    probability below ``min_p`` x the top token's are dropped), top-k, top-p. Greedy requests
    take the argmax after the penalties and the bias (as vLLM).

    ``structured_output`` (kind, spec): a grammar (:mod:`laser.model.structured`) masks every token
    it does not allow, before the rest of the processing; once it is complete only EOS is left.

    ``n`` (>= 1): choices per prompt, as vLLM's parallel sampling. One request carries one choice:
    :meth:`laser.frontend.llm.LLM.generate` and the server run ``n`` requests, choice ``j`` with
    :func:`choice_seed` (``seed + j``); the engine refuses a request with ``n`` > 1.

    ``logprobs`` (0..20, None = off): the log-probability of each generated token and the
    ``logprobs`` most likely tokens' ones; ``prompt_logprobs`` (0..20): the same for every
    prompt token but the first. Both are the model's raw log-probabilities (log-softmax of
    the fp32 logits before any processing above, vLLM's default ``raw_logprobs``).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # vLLM's: the matched stop string ends the text
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); a dict is accepted
    min_tokens: int = 0
    min_p: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Structured output: (kind, spec), kind "json" (a JSON schema as JSON text), "regex" or
    # "lark" (laser.model.structured); None: free text.
    structured_output: tuple[str, str] | None = None
    # Lossy dynamic depth (laser.core.depth.DynamicDepth; a dict or True is accepted): decode
    # tokens may leave the model at a trained exit. None: every token runs every layer.
    dynamic_depth: object = None
    n: int = 1

    def _normalise(self) -> None:
        """``stop``/``stop_token_ids`` to tuples, ``logit_bias`` to sorted (token, bias) pairs.

        Raises:
            InvalidRequestError: a field that is not a list (or a mapping for ``logit_bias``).
        """
        for field in ("stop", "stop_token_ids"):
            v = getattr(self, field)
            if isinstance(v, str) and field == "stop":
                v = (v,)
            elif v is not None and not isinstance(v, (list, tuple)):  # tuple(5) would be a TypeError
                raise InvalidRequestError(f"{field} must be a list, got {v!r:.80}")
            object.__setattr__(self, field, tuple(v or ()))
        bias = self.logit_bias or ()
        if isinstance(bias, dict):
            bias = bias.items()
        try:
            object.__setattr__(self, "logit_bias", tuple(sorted((k, v) for k, v in bias)))
        except (TypeError, ValueError):
            raise InvalidRequestError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r:.80}") from None

    def __post_init__(self):
        """Normalise ``stop``/``stop_token_ids`` to tuples and check every field.

        Raises:
            InvalidRequestError: a field of the wrong type (a bool is not a number here) or
                out of range; the message names the field and what it wants.
        """
        self._normalise()

        def integer(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def number(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        for f in ("max_tokens", "n"):
            if not integer(getattr(self, f)) or getattr(self, f) < 1:
                raise InvalidRequestError(f"{f} must be an integer >= 1, got {getattr(self, f)!r}")
        if not (number(self.temperature) and self.temperature >= 0 and math.isfinite(self.temperature)):
            raise InvalidRequestError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not (number(self.top_p) and 0 < self.top_p <= 1):
            raise InvalidRequestError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not integer(self.top_k) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and not (integer(self.seed) and SEED_MIN <= self.seed <= SEED_MAX):
            raise InvalidRequestError(f"seed must be an integer in [-2^63, 2^64), got {self.seed!r}")
        for f in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, f), bool):
                raise InvalidRequestError(f"{f} must be true or false, got {getattr(self, f)!r}")
        if any(not isinstance(s, str) for s in self.stop):
            raise InvalidRequestError(f"stop must be a string or a list of strings, got {list(self.stop)!r}")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty")
        if any(not integer(t) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be non-negative integers, got {list(self.stop_token_ids)!r}")
        for f in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, f)
            if not (number(v) and -2 <= v <= 2):
                raise InvalidRequestError(f"{f} must be a number in [-2, 2], got {v!r}")
        rp = self.repetition_penalty
        if not (number(rp) and 0 < rp and math.isfinite(rp)):
            raise InvalidRequestError(f"repetition_penalty must be a number > 0, got {rp!r}")
        for t, b in self.logit_bias:
            if not integer(t) or t < 0:
                raise InvalidRequestError(f"logit_bias: keys must be token ids (non-negative integers), got {t!r}")
            if not (number(b) and -100 <= b <= 100):
                raise InvalidRequestError(f"logit_bias: the bias of token {t} must be a number in [-100, 100], "
                                          f"got {b!r}")
        if not integer(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                                      f"got {self.min_tokens!r}")
        if not (number(self.min_p) and 0 <= self.min_p <= 1):
            raise InvalidRequestError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        for f in ("logprobs", "prompt_logprobs"):
            v = getattr(self, f)
            if v is not None and not (integer(v) and 0 <= v <= MAX_LOGPROBS):
                raise InvalidRequestError(f"{f} must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")
        if self.dynamic_depth is not None:
            from .depth import DynamicDepth

            object.__setattr__(self, "dynamic_depth", DynamicDepth.parse(self.dynamic_depth))
        so = self.structured_output
        if self.dynamic_depth is not None and not (self.temperature < 1e-5 and self.logprobs is None
                                                   and not self.processes_logits):
            raise InvalidRequestError("dynamic_depth needs greedy decoding (temperature 0) without logprobs, "
                                      "logit_bias, penalties, min_tokens or structured output")
        if so is not None and not (isinstance(so, tuple) and len(so) == 2 and so[0] in ("json", "regex", "lark")
                                   and isinstance(so[1], str)):
            raise InvalidRequestError(f"structured_output must be (kind, spec) with kind json, regex or lark, "
                                      f"got {so!r:.80}")

    @property
    def processes_logits(self) -> bool:
        """Whether the logits are changed before sampling (bias, min_tokens or a penalty):
        False for a request without these fields, which then takes no extra work."""
        return bool(self.logit_bias or self.min_tokens or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.structured_output is not None)

    @property
    def plain_greedy(self) -> bool:
        """Greedy, with no logit processing and no log-probabilities: the argmax of the raw
        logits is the whole sampling step (what self-speculation's verification and a dynamic-depth
        exit may replace with their own argmax)."""
        return self.greedy and not self.processes_logits and self.logprobs is None

    def check_vocab(self, vocab_size: int) -> None:
        """Raise InvalidRequestError (naming the field) for a ``logit_bias`` or ``stop_token_ids``
        token id outside ``[0, vocab_size)`` (a stop id no token can match would be silently ignored)."""
        for t, _ in self.logit_bias:
            if t >= vocab_size:
                raise InvalidRequestError(f"logit_bias: token id {t} out of range [0, {vocab_size})")
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise InvalidRequestError(f"stop_token_ids: token id {t} out of range [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 are greedy (as vLLM): dividing logits by ~0 overflows."""
        return self.temperature < 1e-5


def choice_seed(seed: int | None, index: int) -> int | None:
    """Seed of choice ``index`` (0-based) of a request with ``seed`` and ``n > 1``: ``seed + index``
    (as vLLM's parallel sampling), wrapped into the accepted range, so each choice is its own
    reproducible stream and choice 0 equals the ``n=1`` answer. None stays None (unseeded)."""
    if seed is None or index == 0:
        return seed
    s = seed + index
    return s - 2**64 if s > SEED_MAX else s


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
