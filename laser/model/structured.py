"""Structured output: a grammar (JSON schema, regex or Lark) as a logits mask in the sampler.

Uses llguidance (Microsoft's grammar engine, the one behind vLLM's ``guidance`` backend and
llama.cpp's ``--llguidance``): a Rust library with no Python dependencies, installable on any
CPU next to a pinned torch. One :class:`GrammarBackend` per engine holds the tokenizer in
llguidance's form (built on first use: a few seconds for a 49k vocabulary) and one matcher per
structured request.

A request's grammar state is its matcher after consuming the request's generated tokens.
It is rebuilt by replaying ``Request.output_token_ids`` whenever the matcher is missing or
behind (a hand-off, a fail-over's re-prefill, a preemption): the state always follows the
tokens, so nothing needs to travel with the request and nothing can drift.

The grammar mask runs before the other logits processing (vLLM applies the bitmask before its
sampler too). Once the grammar is complete, only EOS is allowed.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Callable

import torch

log = logging.getLogger(__name__)

#: The kinds of ``SamplingParams.structured_output``: (kind, spec); tool calls are a ``lark`` grammar.
KINDS = ("json", "regex", "lark")


def grammar_text(kind: str, spec: str) -> str:
    """llguidance's grammar of a (kind, spec) pair. Raises ValueError for a JSON schema that is
    not JSON or an unknown kind."""
    from llguidance import LLMatcher

    if kind == "json":
        # compact separators (", " and ": "), no free whitespace between tokens: a model cannot
        # loop on whitespace (vLLM's ``disable_any_whitespace``); llguidance's default is flexible
        return LLMatcher.grammar_from_json_schema(json.loads(spec), defaults={"whitespace_flexible": False})
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec)
    if kind == "lark":
        return LLMatcher.grammar_from_lark(spec)
    raise ValueError(f"unknown structured output kind {kind!r} (one of {KINDS})")


def choice_grammar(choices: list[str]) -> str:
    """A Lark grammar matching exactly one of ``choices`` (vLLM's ``guided_choice``)."""
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def tool_call_grammar(functions: list[tuple[str, dict]], parallel: bool, open_tag: str, close_tag: str,
                      literal: Callable[[str], str] = json.dumps) -> str:
    """A Lark grammar (llguidance's dialect, with ``%json`` schema terminals) of tool calls:
    one call, or with ``parallel`` one or more separated by newlines, each written exactly as
    ``open_tag`` newline ``{"name": "<one of the functions>", "arguments": <a JSON object
    matching that function's parameters schema>}`` newline ``close_tag`` -- nothing before,
    between or after, so ``tool_choice: required`` / a named function always yields parseable
    calls (vLLM's structured-output ``required`` path; SGLang builds an EBNF the same way).
    Each function's schema is its own ``%json`` root, so its ``$ref``/``$defs`` resolve as
    written; the JSON uses ``", "`` and ``": "`` separators (what the templates' ``tojson``
    writes) and no other whitespace, so a model cannot loop on whitespace.

    Args:
        functions: (name, parameters JSON schema) of each function a call may name.
        parallel: allow more than one call.
        open_tag, close_tag: the tags around a call (``<tool_call>``, ``</tool_call>``).
        literal: the Lark form of a tag (:meth:`GrammarBackend.lark_literal`: a token of its
            own, as Qwen's tokenizers have, must be named as a token, not spelled).
    """
    fmt = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    rules = []
    for i, (name, params) in enumerate(functions):
        head = f'\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '
        schema = json.dumps({**params, "x-guidance": fmt}, ensure_ascii=False)
        rules.append(f"call_{i}: {literal(open_tag)} {json.dumps(head, ensure_ascii=False)} %json {schema} "
                     f"{json.dumps(chr(125) + chr(10))} {literal(close_tag)}")
    more = ' ("\\n" call)*' if parallel else ""
    return "\n".join([f"start: call{more}", "call: " + " | ".join(f"call_{i}" for i in range(len(functions))),
                      *rules]) + "\n"


class GrammarState:
    """One request's grammar matcher (llguidance's ``LLMatcher``) and how many of its output
    tokens it has consumed: the request's own sampling state, kept with the rest of it by the
    :class:`~laser.model.sampler.Sampler` (which forgets it when the request leaves)."""

    __slots__ = ("matcher", "consumed")

    def __init__(self, matcher):
        self.matcher = matcher
        self.consumed = 0


class GrammarBackend:
    """Grammar masks of one engine's structured requests (the tokenizer in llguidance's form,
    grammars compiled against it; each request's matcher is its :class:`GrammarState`).

    Args:
        tokenizer: the engine's Hugging Face tokenizer (a fast one), or the model directory
            (``str`` / ``os.PathLike``) to load it from on first use (a cluster instance, which
            has no front end, loads the model's tokenizer only once a structured request
            reaches it).
        vocab_size: the model's vocabulary (logits row length, >= the tokenizer's).
        eos_ids: ids that end a request (allowed once the grammar is complete).
    """

    def __init__(self, tokenizer, vocab_size: int, eos_ids=()):
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self._tok = None
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self):
        """The tokenizer in llguidance's form (built once, thread-safe)."""
        with self._lock:
            if self._tok is None:
                import llguidance.hf

                if isinstance(self._hf, (str, os.PathLike)):  # the model directory (see __init__)
                    from .loader import load_tokenizer

                    self._hf = load_tokenizer(self._hf)
                eos = self._hf.eos_token_id if self._hf.eos_token_id is not None else (self.eos_ids or [None])[0]
                self._tok = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size, eos_token=eos)
            return self._tok

    def lark_literal(self, text: str) -> str:
        """``text`` as a Lark terminal: a quoted string, or ``<[id]>`` when it is one token that
        llguidance counts as special (an added token such as Qwen's ``<tool_call>``: spelled as
        a string, llguidance would force that token and then refuse it)."""
        ids = self.ll_tokenizer.tokenize_str(text)
        if len(ids) == 1 and self.ll_tokenizer.is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return json.dumps(text, ensure_ascii=False)

    def validate(self, kind: str, spec: str) -> str | None:
        """None when (kind, spec) compiles against this tokenizer, else the grammar's error."""
        from llguidance import LLMatcher

        try:
            err = LLMatcher.validate_grammar(grammar_text(kind, spec), self.ll_tokenizer)
        except (ValueError, TypeError) as e:
            return str(e)
        return err or None

    def prepare(self) -> None:
        """Build :attr:`ll_tokenizer` in a helper thread now unless built (a cluster instance
        that just got a structured request: its next step does not wait the whole build)."""
        if self._tok is None:
            threading.Thread(target=lambda: self.ll_tokenizer, name="llguidance-tokenizer", daemon=True).start()

    def _caught_up(self, req, st: GrammarState | None) -> GrammarState:
        from llguidance import LLMatcher

        out = req.output_token_ids
        if st is None or st.consumed > len(out):
            kind, spec = req.sampling_params.structured_output
            st = GrammarState(LLMatcher(self.ll_tokenizer, grammar_text(kind, spec)))
        m = st.matcher
        if st.consumed < len(out):  # replay: tokens generated since (or before a hand-off / re-prefill)
            new = out[st.consumed:]
            if not m.is_stopped():
                m.consume_tokens(new)
            st.consumed = len(out)
        return st

    def mask(self, row: torch.Tensor, req, state: GrammarState | None = None) -> GrammarState:
        """Set the logits of tokens ``req``'s grammar does not allow next to -inf (``row``: [V]
        float32, modified in place). Once the grammar is complete only EOS stays; a matcher in
        error (never expected) masks nothing and logs it.

        ``state``: the request's :class:`GrammarState` from the previous call (None at first);
        returns it caught up with ``req.output_token_ids`` -- a new one when there was none or
        the request's output is shorter than it consumed (re-prefilled after a preemption)."""
        import llguidance.torch as lt

        st = self._caught_up(req, state)
        m = st.matcher
        if m.is_error():
            log.error("grammar of %s in error: %s", req.req_id, m.get_error())
            return st
        if m.is_stopped():
            keep = torch.full_like(row, float("-inf"))
            ids = torch.tensor([t for t in self.eos_ids if t < row.shape[0]], dtype=torch.long)
            keep[ids] = row[ids]
            row.copy_(keep)
            return st
        bits = lt.allocate_token_bitmask(1, self.ll_tokenizer.vocab_size)
        lt.fill_next_token_bitmask(m, bits, 0)
        lt.apply_token_bitmask_inplace(row.view(1, -1), bits)
        return st
