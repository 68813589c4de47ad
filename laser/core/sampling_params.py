"""A request's sampling parameters (vLLM's ``SamplingParams``: names, defaults and semantics).

Torch-free; checked once when built (a bad field is an :class:`InvalidRequestError` naming it).
The sampler (:mod:`laser.model.sampler`) applies the logits controls, the output path
(:mod:`laser.frontend.outputs`) the text ones, the input path (:mod:`laser.frontend.inputs`)
the prompt ones (truncation, ``max_tokens=None``, the bad words' token ids).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class InvalidRequestError(ValueError):
    """A request is malformed (empty prompt, too long, bad sampling parameters...)."""


#: Most log-probabilities per token a request may ask for (vLLM's default ``max_logprobs``).
MAX_LOGPROBS = 20
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # a seed's range (vLLM and OpenAI accept the int64/uint64 union)


def _integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters (vLLM names and semantics).

    ``max_tokens`` (>= 1, default 16; None: up to the context's end, resolved by the input path
    to ``max_model_len`` minus the prompt). ``temperature < 1e-5`` is greedy. ``top_k <= 0``
    disables top-k; ``top_p == 1`` disables top-p. ``seed`` gives the request its own generator,
    so a seeded request samples the same tokens whatever it is batched with.

    Logits processing (vLLM's order and formulas, ``vllm/v1/sample/sampler.py``):
    ``allowed_token_ids`` (every other token masked), ``bad_words`` (strings: each is tokenized
    with and without a leading space, as vLLM's ``update_from_tokenizer``; a word's last token is
    masked when the output so far ends with the tokens before it -- a one-token word is always
    masked), ``logit_bias`` (token id -> value added to its logit, in [-100, 100]) and
    ``min_tokens`` (EOS -- unless ``ignore_eos`` -- and ``stop_token_ids`` masked while fewer
    than ``min_tokens`` tokens are generated; stop strings are matched only past ``min_tokens``
    tokens), then the penalties: ``repetition_penalty`` (> 0, 1 = off; a logit of a token seen
    in the prompt *or* the output is divided by it when positive, multiplied when not),
    ``frequency_penalty`` (in [-2, 2]; minus penalty x the token's count in the output) and
    ``presence_penalty`` (in [-2, 2]; minus penalty once the token is in the output). The output
    counts every generated token, including those replayed by a re-prefill. Then temperature,
    ``min_p`` (in [0, 1]; tokens of probability below ``min_p`` x the top token's are dropped),
    top-k, top-p. Greedy requests take the argmax after the penalties and the bias (as vLLM).

    ``structured_output`` (kind, spec): a grammar (:mod:`laser.model.structured`) masks every token
    it does not allow, before the rest of the processing; once it is complete only EOS is left.

    ``n`` (>= 1): choices per prompt, as vLLM's parallel sampling. One request carries one choice:
    :meth:`laser.frontend.llm.LLM.generate` and the server run ``n`` requests, choice ``j`` with
    :func:`choice_seed` (``seed + j``); the engine refuses a request with ``n`` > 1. ``best_of``:
    only ``n`` (or None) -- more candidates than choices is refused, as vLLM V1 refuses it.

    ``logprobs`` (0..20, None = off): the log-probability of each generated token and the
    ``logprobs`` most likely tokens' ones; ``prompt_logprobs`` (0..20): the same for every
    prompt token but the first. Both are the model's raw log-probabilities (log-softmax of
    the fp32 logits before any processing above, vLLM's default ``raw_logprobs``).

    Output text: ``skip_special_tokens`` (default True: special tokens are left out of the
    text), ``spaces_between_special_tokens`` (default True; a slow tokenizer's switch, passed to
    its ``decode``; fast tokenizers ignore it, as in vLLM), ``detokenize`` (False: token ids only,
    the text stays empty; stop strings then cannot be matched and are refused, as vLLM).
    ``truncate_prompt_tokens`` (>= 1, or -1 for the context length): the prompt is cut to its
    last that many tokens before admission. ``logits_processors``: per-request callables are
    refused (vLLM V1 refuses them too); use the controls above.
    """

    max_tokens: int | None = 16
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
    best_of: int | None = None
    bad_words: tuple[str, ...] = ()  # a list (or one string) is accepted
    allowed_token_ids: tuple[int, ...] | None = None  # a list is accepted; None: every token
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    truncate_prompt_tokens: int | None = None
    logits_processors: object = None  # refused unless empty (vLLM V1)
    # The bad words' token sequences (vLLM's ``_bad_words_token_ids``), set by the input path
    # (laser.frontend.inputs.InputProcessor.bad_words_ids) from ``bad_words``; None: not yet.
    bad_words_token_ids: tuple[tuple[int, ...], ...] | None = None

    def _normalise(self) -> None:
        """List fields to tuples, ``logit_bias`` to sorted (token, bias) pairs.

        Raises:
            InvalidRequestError: a field that is not a list (or a mapping for ``logit_bias``).
        """
        for field in ("stop", "stop_token_ids", "bad_words", "allowed_token_ids"):
            v = getattr(self, field)
            if isinstance(v, str) and field in ("stop", "bad_words"):
                v = (v,)
            elif v is not None and not isinstance(v, (list, tuple)):  # tuple(5) would be a TypeError
                raise InvalidRequestError(f"{field} must be a list, got {v!r:.80}")
            object.__setattr__(self, field, None if v is None and field == "allowed_token_ids" else tuple(v or ()))
        bias = self.logit_bias or ()
        if isinstance(bias, dict):
            bias = bias.items()
        try:
            object.__setattr__(self, "logit_bias", tuple(sorted((k, v) for k, v in bias)))
        except (TypeError, ValueError):
            raise InvalidRequestError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r:.80}") from None

    def __post_init__(self):
        """Normalise the list fields to tuples and check every field.

        Raises:
            InvalidRequestError: a field of the wrong type (a bool is not a number here) or
                out of range, or a field vLLM V1 refuses too (``best_of`` > ``n``,
                ``logits_processors``); the message names the field and what it wants.
        """
        self._normalise()
        self._check_numbers()
        self._check_lists()
        self._check_vllm_fields()
        if self.dynamic_depth is not None:
            from .depth import DynamicDepth

            object.__setattr__(self, "dynamic_depth", DynamicDepth.parse(self.dynamic_depth))
        so = self.structured_output
        if so is not None and not (isinstance(so, tuple) and len(so) == 2 and so[0] in ("json", "regex", "lark")
                                   and isinstance(so[1], str)):
            raise InvalidRequestError(f"structured_output must be (kind, spec) with kind json, regex or lark, "
                                      f"got {so!r:.80}")
        # computed once: the sampler asks every step, for every request (its fast path)
        object.__setattr__(self, "_processes_logits", bool(
            self.logit_bias or self.min_tokens or self.presence_penalty or self.frequency_penalty
            or self.repetition_penalty != 1.0 or self.structured_output is not None
            or self.allowed_token_ids is not None or self.bad_words))
        if self.dynamic_depth is not None and not (self.temperature < 1e-5 and self.logprobs is None
                                                   and not self.processes_logits):
            raise InvalidRequestError("dynamic_depth needs greedy decoding (temperature 0) without logprobs, "
                                      "logit_bias, penalties, min_tokens, allowed_token_ids, bad_words or "
                                      "structured output")

    def _check_numbers(self) -> None:
        """The numeric fields' types and ranges. Raises InvalidRequestError naming the field."""
        for f in ("n",) if self.max_tokens is None else ("max_tokens", "n"):
            if not _integer(getattr(self, f)) or getattr(self, f) < 1:
                raise InvalidRequestError(f"{f} must be an integer >= 1, got {getattr(self, f)!r}")
        if not (_number(self.temperature) and self.temperature >= 0 and math.isfinite(self.temperature)):
            raise InvalidRequestError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not (_number(self.top_p) and 0 < self.top_p <= 1):
            raise InvalidRequestError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not _integer(self.top_k) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and not (_integer(self.seed) and SEED_MIN <= self.seed <= SEED_MAX):
            raise InvalidRequestError(f"seed must be an integer in [-2^63, 2^64), got {self.seed!r}")
        for f in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, f)
            if not (_number(v) and -2 <= v <= 2):
                raise InvalidRequestError(f"{f} must be a number in [-2, 2], got {v!r}")
        rp = self.repetition_penalty
        if not (_number(rp) and 0 < rp and math.isfinite(rp)):
            raise InvalidRequestError(f"repetition_penalty must be a number > 0, got {rp!r}")
        limit = "max_tokens" if self.max_tokens is None else f"max_tokens={self.max_tokens}"
        if not _integer(self.min_tokens) or self.min_tokens < 0 or (self.max_tokens is not None
                                                                    and self.min_tokens > self.max_tokens):
            raise InvalidRequestError(f"min_tokens must be an integer in [0, {limit}], got {self.min_tokens!r}")
        if not (_number(self.min_p) and 0 <= self.min_p <= 1):
            raise InvalidRequestError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        for f in ("logprobs", "prompt_logprobs"):
            v = getattr(self, f)
            if v is not None and not (_integer(v) and 0 <= v <= MAX_LOGPROBS):
                raise InvalidRequestError(f"{f} must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")
        t = self.truncate_prompt_tokens
        if t is not None and not (_integer(t) and (t >= 1 or t == -1)):
            raise InvalidRequestError(f"truncate_prompt_tokens must be an integer >= 1, or -1 (the context "
                                      f"length), got {t!r}")

    def _check_lists(self) -> None:
        """The list fields' items and the switches. Raises InvalidRequestError naming the field."""
        for f in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
                  "detokenize"):
            if not isinstance(getattr(self, f), bool):
                raise InvalidRequestError(f"{f} must be true or false, got {getattr(self, f)!r}")
        for f in ("stop", "bad_words"):
            if any(not isinstance(s, str) for s in getattr(self, f)):
                raise InvalidRequestError(f"{f} must be a string or a list of strings, got {list(getattr(self, f))!r}")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty")
        if any(not s.strip() for s in self.bad_words):
            raise InvalidRequestError(f"bad_words must be non-blank strings, got {list(self.bad_words)!r}")
        if self.stop and not self.detokenize:
            raise InvalidRequestError("stop strings are only matched in the text: they need detokenize=True "
                                      "(use stop_token_ids for token ids)")
        if any(not _integer(t) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be non-negative integers, got {list(self.stop_token_ids)!r}")
        a = self.allowed_token_ids
        if a is not None and not a:
            raise InvalidRequestError("allowed_token_ids must not be empty (None: every token is allowed)")
        if a is not None and any(not _integer(t) or t < 0 for t in a):
            raise InvalidRequestError(f"allowed_token_ids must be non-negative integers, got {list(a)!r:.120}")
        for t, b in self.logit_bias:
            if not _integer(t) or t < 0:
                raise InvalidRequestError(f"logit_bias: keys must be token ids (non-negative integers), got {t!r}")
            if not (_number(b) and -100 <= b <= 100):
                raise InvalidRequestError(f"logit_bias: the bias of token {t} must be a number in [-100, 100], "
                                          f"got {b!r}")

    def _check_vllm_fields(self) -> None:
        """``best_of`` and ``logits_processors``: what vLLM's V1 engine refuses is refused here too
        (a clear error, not a silent no-op). Raises InvalidRequestError naming the field."""
        b = self.best_of
        if b is not None and not (_integer(b) and b >= 1):
            raise InvalidRequestError(f"best_of must be an integer >= 1, got {b!r}")
        if b is not None and b < self.n:
            raise InvalidRequestError(f"best_of must be >= n, got n={self.n} and best_of={b}")
        if b is not None and b > self.n:
            raise InvalidRequestError(f"best_of: {b} > n={self.n} is not supported (vLLM V1 does not support best_of "
                                      "either): ask for n choices")
        if self.logits_processors:
            raise InvalidRequestError("logits_processors: per-request logits processors are not supported (vLLM V1 "
                                      "refuses them too); use logit_bias, allowed_token_ids, bad_words or "
                                      "structured output")

    @property
    def processes_logits(self) -> bool:
        """Whether the logits are changed before sampling (bias, min_tokens, a penalty, a grammar,
        allowed token ids or bad words): False for a request without these fields, which then
        takes no extra work (computed once, when the parameters are built)."""
        return self._processes_logits

    @property
    def plain_greedy(self) -> bool:
        """Greedy, with no logit processing and no log-probabilities: the argmax of the raw
        logits is the whole sampling step (what self-speculation's verification and a dynamic-depth
        exit may replace with their own argmax)."""
        return self.greedy and not self._processes_logits and self.logprobs is None

    def check_vocab(self, vocab_size: int) -> None:
        """Raise InvalidRequestError (naming the field) for a ``logit_bias``, ``stop_token_ids`` or
        ``allowed_token_ids`` token id outside ``[0, vocab_size)`` (a stop id no token can match
        would be silently ignored)."""
        for t, _ in self.logit_bias:
            if t >= vocab_size:
                raise InvalidRequestError(f"logit_bias: token id {t} out of range [0, {vocab_size})")
        for f in ("stop_token_ids", "allowed_token_ids"):
            for t in getattr(self, f) or ():
                if t >= vocab_size:
                    raise InvalidRequestError(f"{f}: token id {t} out of range [0, {vocab_size})")

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
