"""The one output path: token ids -> text, stop strings, :class:`RequestOutput`.

Every front end (the in-process :class:`~laser.frontend.engine.Engine`, the cluster's
:class:`~laser.cluster.engine.ClusterEngine`, the asyncio server, offline ``LLM``) turns the
token events of its instances into client outputs through one :class:`OutputProcessor`. The
instances judge token ids only (EOS, stop token ids, ``max_tokens``, context); a stop *string*
is judged here, and the front end then stops the request on its instance. The model is vLLM
v1's ``OutputProcessor`` (``vllm/v1/engine/output_processor.py``).

Detokenization is incremental: a short window of recent tokens is decoded each step instead of
the whole output, and text that ends in an incomplete UTF-8 sequence (U+FFFD) is held back
until the next token completes it (the prefix/read-offset scheme of vLLM's
``detokenize_incrementally`` and TGI).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.request import SLO, Request


class IncrementalDetokenizer:
    """Per-request detokenizer state. ``text`` is the output decoded so far."""

    __slots__ = ("tokenizer", "ids", "prefix_offset", "read_offset", "text", "skip_ids", "decode_kw")

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        """``skip_special_tokens``: leave special tokens out of the text (vLLM's default);
        ``spaces_between_special_tokens``: passed to a slow tokenizer's ``decode`` when False
        (fast tokenizers ignore it, as in vLLM)."""
        self.tokenizer = tokenizer
        # Start with a few prompt tokens as context so leading spaces decode right.
        self.ids = list(prompt_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.skip_ids = set(getattr(tokenizer, "all_special_ids", ()) or ()) if skip_special_tokens else set()
        self.decode_kw = {} if spaces_between_special_tokens else {"spaces_between_special_tokens": False}

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (may be empty)."""
        if token_id in self.skip_ids:
            return ""
        self.ids.append(token_id)
        dec = self.tokenizer.decode
        prefix = dec(self.ids[self.prefix_offset : self.read_offset], **self.decode_kw)
        full = dec(self.ids[self.prefix_offset :], **self.decode_kw)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""


def find_stop(text: str, stops: tuple[str, ...], new_len: int, include: bool = False) -> int | None:
    """Index in ``text`` where the earliest stop string starts (``include``: where it ends, the
    longest of those starting there; vLLM's ``include_stop_str_in_output``), searching only where
    the last ``new_len`` characters could complete one; None if none matched."""
    best = end = None
    for s in stops:
        start = max(0, len(text) - new_len - len(s) + 1)
        i = text.find(s, start)
        if i != -1 and (best is None or i < best or (i == best and i + len(s) > end)):
            best, end = i, i + len(s)
    return end if include else best


class OutputText:
    """A request's output text as the client sees it: incremental detokenization, stop strings,
    and the hold-back that keeps streamed deltas consistent (the one owner of that rule).

    Text that could still turn out to be the start of a stop string (its length - 1
    characters) is held back until the request finishes, so the streamed deltas always add up
    to the final, cut text.
    """

    __slots__ = ("detok", "stop", "include_stop", "hold", "sent", "min_tokens", "num_tokens", "detokenize")

    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...] = (),
                 output_ids: list[int] = (), min_tokens: int = 0, include_stop: bool = False,
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True,
                 detokenize: bool = True):
        """``detokenize=False``: token ids only, the text stays empty (vLLM's ``detokenize``);
        the other switches: :class:`IncrementalDetokenizer`'s."""
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens, spaces_between_special_tokens)
        self.detokenize = detokenize
        self.stop = stop
        self.include_stop = include_stop  # the text is cut after the matched stop string, not before
        self.hold = max((len(s) for s in stop), default=1) - 1
        # stop strings are matched only once more than min_tokens tokens are out (as vLLM)
        self.min_tokens = min_tokens
        self.num_tokens = len(output_ids)
        for t in output_ids if detokenize else ():  # a request continuing here (hand-off): its text so far was sent
            self.detok.add(t)
        self.sent = max(0, len(self.detok.text) - self.hold)

    @property
    def text(self) -> str:
        return self.detok.text

    def add(self, token_id: int) -> bool:
        """Append a token. True when a stop string matched (the text is cut before it, or after it
        with ``include_stop``)."""
        delta = self.detok.add(token_id) if self.detokenize else ""
        self.num_tokens += 1
        if self.stop and delta and self.num_tokens > self.min_tokens:
            cut = find_stop(self.detok.text, self.stop, len(delta), self.include_stop)
            if cut is not None:
                self.detok.text = self.detok.text[:cut]
                return True
        return False

    def visible(self, finished: bool) -> str:
        """The text a client may see now (all of it once finished)."""
        t = self.detok.text
        return t if finished else t[: max(0, len(t) - self.hold)]

    def delta(self, finished: bool) -> str:
        """Visible text not streamed yet; marks it streamed."""
        t = self.visible(finished)
        d = t[self.sent :]
        self.sent = max(self.sent, len(t))
        return d


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
    # The front end's request: only the thread that steps the engine may read it (in-process
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
    # Copied when it finishes: :attr:`laser.core.request.Request.miss_causes` (why it may have missed).
    miss_causes: tuple[str, ...] = ()
    # Times it failed over (cluster: moved after an instance holding it failed) and whether its
    # seeded sampled stream was kept (None: no fail-over, or no seed); see Request.seed_kept.
    num_failovers: int = 0
    seed_kept: bool | None = None
    # Dynamic depth (SamplingParams.dynamic_depth): decode tokens so far and the mean layers they
    # ran (Request.mean_depth); 0 / None when the request did not opt in.
    num_depth_tokens: int = 0
    mean_depth: float | None = None
    # SamplingParams.logprobs: one TokenLogprob per output token so far (None when not asked).
    logprobs: list | None = None
    # SamplingParams.prompt_logprobs: per prompt position, None at position 0 (None when not asked).
    prompt_logprobs: list | None = None
    # LLM.generate / LLM.chat: the prompt's SamplingParams.n choices, each a finished output
    # (choice 0 is this one), as vLLM's RequestOutput.outputs; empty from an engine's step.
    outputs: list = field(default_factory=list, repr=False, compare=False)

    @property
    def request_id(self) -> str:
        """vLLM's name of :attr:`req_id` (``RequestOutput.request_id``)."""
        return self.req_id

    @property
    def cumulative_logprob(self) -> float | None:
        """Sum of the output tokens' raw log-probabilities (natural log), as vLLM's
        ``CompletionOutput.cumulative_logprob``; None when ``SamplingParams.logprobs`` was not asked."""
        return None if self.logprobs is None else float(sum(t.logprob for t in self.logprobs))

    def slo_outcome(self) -> tuple[bool, bool]:
        """(TTFT met, P99 TBT met) of this finished request, by the rule of
        :class:`laser.core.metrics.RequestRecord` (one owner), on the copies this output holds."""
        from ..core.metrics import SLO_EPS, RequestRecord

        rec = RequestRecord(req_id=self.req_id, slo_class=self.slo.name, ttft_slo=self.slo.ttft,
                            tbt_slo=self.slo.tbt, arrival_time=self.arrival_time,
                            token_times=list(self.token_times), finished=True)
        ttft_ok = rec.ttft_slo is None or (rec.ttft is not None and rec.ttft <= rec.ttft_slo + SLO_EPS)
        p99 = rec.p99_tbt
        tbt_ok = rec.tbt_slo is None or p99 is None or p99 <= rec.tbt_slo + SLO_EPS
        return ttft_ok, tbt_ok


def failover_fields(req: Request) -> dict:
    """The fail-over fields of a :class:`RequestOutput` of ``req`` (nothing when it never failed over)."""
    return {"num_failovers": req.num_failovers, "seed_kept": req.seed_kept} if req.num_failovers else {}


def depth_fields(req: Request) -> dict:
    """The dynamic-depth fields of a :class:`RequestOutput` of ``req`` (nothing when it ran none)."""
    return {"num_depth_tokens": req.num_depth_tokens, "mean_depth": req.mean_depth} if req.num_depth_tokens else {}


def logprob_fields(req: Request) -> dict:
    """The ``logprobs`` / ``prompt_logprobs`` fields of a :class:`RequestOutput` of ``req``:
    copies of what the request asked for, nothing when it asked for none."""
    sp = req.sampling_params
    out = {}
    if sp.logprobs is not None:
        out["logprobs"] = list(req.output_logprobs)
    if sp.prompt_logprobs is not None and req.prompt_logprobs is not None:
        out["prompt_logprobs"] = list(req.prompt_logprobs)
    return out


def aborted_output(req_id: str, prompt_token_ids: list[int], slo: SLO, last: RequestOutput | None) -> RequestOutput:
    """The final ``finish_reason="abort"`` output of a request that ends without a new token
    (server shutdown), from its ``last`` output (None: it had none)."""
    return RequestOutput(
        req_id=req_id, prompt=None, prompt_token_ids=prompt_token_ids, text=last.text if last else "",
        token_ids=list(last.token_ids) if last else [], delta_text="", new_token_ids=[], finished=True,
        finish_reason="abort", slo=slo, request=last.request if last else None,
        arrival_time=last.arrival_time if last else 0.0, token_times=last.token_times if last else ())


class OutputProcessor:
    """Turns the token events of a front end's requests into :class:`RequestOutput` s.

    Holds one :class:`OutputText` per request between :meth:`add_request` and its last output.
    Not thread-safe: used by the thread that steps the instances.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._text: dict[str, OutputText] = {}

    def add_request(self, req: Request) -> None:
        """Track ``req`` (its tokens so far count as streamed already: a request continuing
        here after a hand-off)."""
        sp = req.sampling_params
        self._text[req.req_id] = OutputText(self.tokenizer, req.prompt_token_ids, sp.stop, req.output_token_ids,
                                            sp.min_tokens, sp.include_stop_str_in_output, sp.skip_special_tokens,
                                            sp.spaces_between_special_tokens, sp.detokenize)

    def abort(self, req_id: str) -> None:
        """Forget a request (no output)."""
        self._text.pop(req_id, None)

    def process(self, req: Request, token: int, finish_reason: str | None,
                handed_off: bool = False, num_tokens: int = 1) -> tuple[RequestOutput, bool]:
        """The output of ``req`` after it got ``token`` (already appended to
        ``req.output_token_ids``), with the instance's ``finish_reason`` (EOS, stop id, length;
        None: running) and whether the instance handed it off after this token. A finished
        request is forgotten; a handed-off one is kept (a cluster front end streams it on).

        Returns ``(output, stop)``: ``stop`` is True when a stop string matched while the
        instance still holds the request (running, or in its hand-off outbox): the caller must
        stop it there. A stop string ends the request as ``stop`` whatever the instance said
        (vLLM's output processor does the same), and cuts its text before the string.
        """
        text = self._text[req.req_id]
        # ``num_tokens`` > 1: the step gave several tokens (self-speculative decoding), the last
        # of them ``token``; each is judged in turn and a stop string ends the run there.
        new = req.output_token_ids[-num_tokens:] if num_tokens > 1 else [token]
        matched = False
        for k, t in enumerate(new):
            if text.add(t):
                matched, new = True, new[:k + 1]
                break
        stop = matched and finish_reason is None
        if matched:
            finish_reason, handed_off = "stop", False
        finished = finish_reason is not None
        if finished:
            del self._text[req.req_id]
        return RequestOutput(
            req_id=req.req_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            text=text.visible(finished), token_ids=list(req.output_token_ids), delta_text=text.delta(finished),
            new_token_ids=new, finished=finished, finish_reason=finish_reason, slo=req.slo, request=req,
            handed_off=handed_off, arrival_time=req.arrival_time, token_times=tuple(req.token_times),
            miss_causes=req.miss_causes if finished else (), num_cached_tokens=req.num_cached_tokens,
            **failover_fields(req), **depth_fields(req), **logprob_fields(req)), stop

    def final(self, req: Request, reason: str) -> RequestOutput:
        """The last output of a tracked request that ends without a new token (``reason``,
        e.g. ``abort`` when no instance can serve it any more); it is forgotten."""
        text = self._text.pop(req.req_id)
        return RequestOutput(
            req_id=req.req_id, prompt=None, prompt_token_ids=req.prompt_token_ids, text=text.visible(True),
            token_ids=list(req.output_token_ids), delta_text=text.delta(True), new_token_ids=[], finished=True,
            finish_reason=reason, slo=req.slo, request=req, arrival_time=req.arrival_time,
            token_times=tuple(req.token_times), miss_causes=req.miss_causes, num_cached_tokens=req.num_cached_tokens,
            **failover_fields(req), **depth_fields(req), **logprob_fields(req))
