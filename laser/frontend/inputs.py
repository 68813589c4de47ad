"""The one input path: a client's prompt, sampling parameters and SLO become a validated
:class:`~laser.core.request.Request` here, once, for every front end (in process, the asyncio
server, a cluster, offline ``LLM``).

A malformed request is rejected with :class:`~laser.core.request.InvalidRequestError` naming
what is wrong, and nothing is enqueued anywhere. The instance behind the front end sees only
token ids that passed these checks. The model is vLLM v1's ``Processor.process_inputs``
(``vllm/v1/engine/processor.py``): inputs are validated and tokenized off the engine core,
which then only adds the request.

Thread-safety: a Rust tokenizer must not be used from two threads at once, so a server gives
its tokenizer thread its own :class:`InputProcessor` over a copy (:meth:`InputProcessor.copy`).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from typing import Any, Callable

from ..core.request import SLO, InvalidRequestError, Request, SamplingParams
from .tool_prompt import fallback_messages, has_tool_turns, template_knows_tools, tool_template


def check_text(text: str, where: str) -> None:
    """Raise InvalidRequestError when ``text`` is not valid Unicode text: an unpaired UTF-16
    surrogate (JSON's ``"\\ud800"`` decodes to one) cannot be UTF-8 encoded, and the
    tokenizer raises a TypeError on it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(f"{where} is not valid Unicode text (an unpaired surrogate "
                                  f"{text[e.start]!r} at character {e.start})") from None


def check_message(i: int, message: dict) -> dict:
    """Message ``i`` of a conversation as the chat template takes it: a dict with a string
    ``role`` and string ``content`` (a null or missing content of an assistant message that
    makes ``tool_calls`` becomes ``""``); every string field valid Unicode (:func:`check_text`).

    The rule is OpenAI's: ``content`` may be null only on an assistant message with
    ``tool_calls``; a user, system, developer or tool message without content is refused (a
    chat template would otherwise render ``None`` or an empty turn the client never sent).
    ``content`` may also be OpenAI's list of content parts (``[{"type": "text", "text": ...}]``,
    what vLLM's ``LLM.chat`` takes): its text parts joined by newlines, by the rule the server's
    messages follow too (:func:`join_text_parts`); other part types (images) are refused.

    Raises:
        InvalidRequestError: naming ``messages[i]`` or the field (``messages[i].content``).
    """
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise InvalidRequestError(f"messages[{i}] must be an object with a string 'role', got {message!r:.80}")
    if message.get("content") is None:
        if message["role"] != "assistant" or not message.get("tool_calls"):
            raise InvalidRequestError(f"messages[{i}].content: a {message['role']} message needs content (null "
                                      "content is only valid for an assistant message with tool_calls)")
        message = {**message, "content": ""}
    if isinstance(message["content"], (list, tuple)):
        parts = [(p.get("type"), p.get("text")) if isinstance(p, dict) else (None, None) for p in message["content"]]
        message = {**message, "content": join_text_parts(i, parts)}
    for k, v in message.items():
        if isinstance(v, str):
            check_text(v, f"messages[{i}].{k}")
    return message


class UnsupportedContentPart(InvalidRequestError):
    """A content part of a type other than ``text`` (an image, audio): the request is valid
    OpenAI, this engine does not take it (the server answers ``unsupported_parameter``)."""


def join_text_parts(i: int, parts) -> str:
    """The text of message ``i``'s content parts, joined by newlines: the one rule for
    ``LLM.chat`` (:func:`check_message`) and the server (``laser.server.tools.chat_messages``).
    ``parts``: ``(type, text)`` pairs, one a part.

    Raises:
        InvalidRequestError: an empty list (OpenAI: "Expected an array with minimum length 1"),
            a text part without its text (``messages[i].content[j].text``).
        UnsupportedContentPart: a part of another type (``messages[i].content[j]``).
    """
    if not parts:
        raise InvalidRequestError(f"messages[{i}].content: an empty list of content parts (give a string or parts)")
    texts = []
    for j, (kind, text) in enumerate(parts):
        if kind != "text":
            raise UnsupportedContentPart(f"messages[{i}].content[{j}]: only text content parts are supported "
                                         f"(got type {kind!r})")
        if not isinstance(text, str):  # (OpenAI: "Missing required parameter")
            raise InvalidRequestError(f"messages[{i}].content[{j}].text: a text content part needs its text")
        texts.append(text)
    return "\n".join(texts)


class ContextLengthError(InvalidRequestError):
    """The prompt does not leave room for one generated token in the model's context."""


class InputProcessor:
    """Tokenizes and validates requests for one served model.

    Args:
        tokenizer: the model's HF tokenizer (used for text and chat messages only).
        vocab_size: token ids must lie in ``[0, vocab_size)``.
        max_model_len: context length in tokens; a prompt must be shorter.
        slo_classes: the SLO class table that resolves a class name (``None``: the default class).
        grammars: the :class:`~laser.model.structured.GrammarBackend` that checks a request's
            structured output (``None``: structured output is refused).
    """

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, slo_classes, grammars=None,
                 serves_exits: bool = False):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.slo_classes = slo_classes
        self.grammars = grammars
        # trained exit heads are loaded (dynamic-depth requests are served; laser.core.depth)
        self.serves_exits = serves_exits
        self._token_chars: int | None = None  # the longest token's length in characters (check_text_length)

    def copy(self) -> "InputProcessor":
        """A processor over a private copy of the tokenizer (for another thread)."""
        return InputProcessor(copy.deepcopy(self.tokenizer), self.vocab_size, self.max_model_len, self.slo_classes,
                              self.grammars, self.serves_exits)

    # -- prompts ---------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int] | list[dict], tools: list[dict] | None = None,
                      keep: int | None = None, **switches) -> list[int]:
        """Token ids of a prompt: text, token ids, or chat messages (chat template applied, with
        ``tools``: OpenAI tool definitions and the template ``switches``, see
        :meth:`apply_chat_template`). ``keep``: the tokens the caller will keep of them (the
        request's ``truncate_prompt_tokens``, applied by :meth:`truncate` after this): text is
        first cut to the characters that many tokens can come from (:meth:`text_to_keep`).
        Raises InvalidRequestError (empty, not Unicode, ids out of the vocabulary, bad messages);
        ContextLengthError, before tokenizing, for text or a conversation too long for the context
        (:meth:`check_text_length`, more messages than twice the context's tokens)."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            check_text(prompt, "prompt")
            if keep is not None:
                prompt = self.text_to_keep(prompt, keep)
            self.check_text_length(len(prompt), "prompt")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            if len(prompt) > 2 * self.max_model_len:  # a template renders each message (its role at least) as tokens
                raise ContextLengthError(f"conversation has {len(prompt)} messages, more than this model's context "
                                         f"of {self.max_model_len} tokens holds (x2 for templates that drop some)")
            self.check_text_length(sum(len(m["content"]) for m in prompt if isinstance(m.get("content"), str)),
                                   "conversation")
            return self.apply_chat_template(prompt, tools, **switches)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(f"token id {bad[0]} out of range [0, {self.vocab_size})")
            return list(prompt)
        raise InvalidRequestError("prompt must be a non-empty string, token id list or message list")

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, continue_final_message: bool = False,
                            chat_template_kwargs: dict | None = None, chat_template: str | None = None) -> list[int]:
        """Token ids of a conversation (a model without a template gets ``role: content`` lines).
        ``add_generation_prompt``: open an assistant turn after the messages;
        ``continue_final_message``: leave the last message open, for the model to continue it
        (both as transformers' and vLLM's switches of the same names; both true is an error);
        ``chat_template_kwargs``: more variables for the template (vLLM's, e.g. Qwen3's
        ``{"enable_thinking": false}``); a name of the renderer's own arguments (``tokenize``,
        ``tools``, ...) is an error, not a way around the switches; ``chat_template``: a Jinja
        template used instead of the tokenizer's (vLLM's ``LLM.chat(chat_template=...)``). The server and
        :meth:`laser.frontend.llm.LLM.chat` both render through here.
        ``tools`` (OpenAI tool definitions), assistant ``tool_calls`` and ``tool`` messages are
        rendered by the template itself when it knows tools in the ``<tool_call>`` format, else
        by the fallback prompt format (:mod:`laser.frontend.tool_prompt`). Raises InvalidRequestError."""
        if not messages:
            raise InvalidRequestError("messages are empty")
        if add_generation_prompt and continue_final_message:
            raise InvalidRequestError("add_generation_prompt and continue_final_message cannot both be true "
                                      "(set add_generation_prompt to false to continue the last message)")
        extra = check_template_kwargs(chat_template_kwargs, self.tokenizer)
        messages = [check_message(i, m) for i, m in enumerate(messages)]
        if chat_template is not None and (not isinstance(chat_template, str) or not chat_template.strip()):
            raise InvalidRequestError(f"chat_template must be a non-empty Jinja template string, got "
                                      f"{chat_template!r:.80}")
        template = chat_template if chat_template is not None else self.tokenizer.chat_template
        if (tools or has_tool_turns(messages)) and not template_knows_tools(tool_template(template)):
            messages, tools = fallback_messages(messages, tools), None
        if template is None:
            text = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
            text += "\nassistant:" if add_generation_prompt else ""
            check_text(text, "messages")
            return self.tokenizer.encode(text)
        kw = {"tools": tools} if tools else {}  # a request without tools renders exactly as before
        kw.update(extra)
        if chat_template is not None:
            kw["chat_template"] = chat_template
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                    continue_final_message=continue_final_message, tokenize=True, **kw)
        except Exception as e:  # noqa: BLE001 - template errors are the caller's input
            raise InvalidRequestError(f"cannot apply chat template: {e}") from e
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def text_chars(self, tokens: int) -> int:
        """Characters of text that surely tokenize into more than ``tokens`` tokens: no token
        covers more characters than the vocabulary's longest token string (byte-level BPE: one
        character per byte; SentencePiece pieces are longer than what they cover); slack of 2 for
        normalizers that merge characters (NFC)."""
        if self._token_chars is None:
            vocab = self.tokenizer.get_vocab() if hasattr(self.tokenizer, "get_vocab") else {}
            self._token_chars = max((len(t) for t in vocab), default=0) or 1 << 30
        return 2 * self._token_chars * tokens

    def check_text_length(self, chars: int, what: str) -> None:
        """Raise :class:`ContextLengthError` before tokenizing text of ``chars`` characters that
        cannot fit the context (more than :meth:`text_chars` of ``max_model_len``). Tokenizing a
        16 MB prompt took the one tokenizer thread ~14 s, stalling every other request's
        tokenization meanwhile."""
        if chars > self.text_chars(self.max_model_len):
            raise ContextLengthError(f"{what} has {chars} characters, more tokens than this model's context of "
                                     f"{self.max_model_len} tokens holds (a token covers at most "
                                     f"{self._token_chars} characters)")

    def text_to_keep(self, text: str, keep: int) -> str:
        """The end of ``text`` whose tokens hold the last ``keep`` tokens of ``text`` (vLLM's
        ``truncate_prompt_tokens``; -1: the context length): its last :meth:`text_chars` of
        ``keep`` characters when it is longer, else ``text`` (also for a ``keep`` that
        :meth:`truncate` refuses). Such an end tokenizes into at least twice ``keep`` tokens,
        and only its first ones -- the word it cuts -- can differ from the whole text's, so the
        last ``keep`` are the same (save a word longer than ``keep`` tokens, cut in its middle).
        Main tokenized the whole text first (1 MB in 0.55 s, stalling other requests'
        tokenization) and refused text past :meth:`check_text_length` whatever ``keep`` was."""
        n = self.max_model_len if keep == -1 else keep
        if not isinstance(n, int) or not 1 <= n <= self.max_model_len:
            return text
        chars = self.text_chars(n)
        return text[len(text) - chars:] if len(text) > chars else text

    def check_length(self, ids: list[int]) -> None:
        """Raise :class:`ContextLengthError` unless the prompt leaves room for one generated token
        (and InvalidRequestError when it is empty)."""
        if not ids:
            raise InvalidRequestError("prompt is empty: it encodes to zero tokens")
        if len(ids) >= self.max_model_len:
            raise ContextLengthError(f"prompt has {len(ids)} tokens; this model's context is "
                                     f"{self.max_model_len} tokens (prompt plus at least one generated token)")

    def check_budget(self, prompt_len: int, max_tokens: int, field: str = "max_tokens") -> None:
        """Raise :class:`ContextLengthError` when a prompt of ``prompt_len`` tokens plus
        ``max_tokens`` generated ones do not fit the context (vLLM's server rule; the engine
        would otherwise stop at the context's end with ``length``, short of what was asked).
        ``field``: how the caller names max_tokens (the server's field, the CLI's flag)."""
        if prompt_len + max_tokens > self.max_model_len:
            raise ContextLengthError(f"this model's context is {self.max_model_len} tokens; the request needs "
                                     f"{prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} "
                                     f"{field}); lower {field}")

    def tokenize(self, prompt: str | list[int] | list[dict], keep: int | None = None) -> list[int]:
        """:meth:`encode_prompt` then :meth:`fit`: the ids of a servable prompt."""
        return self.fit(self.encode_prompt(prompt, keep=keep), keep)

    def fit(self, ids: list[int], keep: int | None = None) -> list[int]:
        """Prompt ``ids`` cut to their last ``keep`` tokens (:meth:`truncate`, the request's
        ``truncate_prompt_tokens``; None: as they are), then :meth:`check_length`: truncation
        comes before the length check (vLLM's order). Raises as those two."""
        ids = self.truncate(ids, keep)
        self.check_length(ids)
        return ids

    def truncate(self, ids: list[int], keep: int | None, field: str = "truncate_prompt_tokens") -> list[int]:
        """The prompt ``ids`` cut to their last ``keep`` tokens (vLLM's ``truncate_prompt_tokens``:
        the start of a long prompt is dropped; -1: the context length; None: ``ids`` as they are).
        Raises InvalidRequestError naming ``field`` for ``keep`` over the context length."""
        if keep is None:
            return ids
        SamplingParams(truncate_prompt_tokens=keep)  # the field's rule (>= 1 or -1): its one owner
        if keep > self.max_model_len:
            raise InvalidRequestError(f"{field}: {keep} is more than this model's context of {self.max_model_len} "
                                      "tokens (ask for fewer, or -1 for the context length)")
        keep = self.max_model_len if keep == -1 else keep
        return ids[len(ids) - keep:] if len(ids) > keep else ids

    def bad_words_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """The token sequences of ``bad_words`` (vLLM's ``SamplingParams.update_from_tokenizer``):
        each word (leading spaces stripped) as it tokenizes alone, and with a leading space when
        that gives another first token and as many tokens (the word in mid-text). Raises
        InvalidRequestError for a word with a token outside the vocabulary (or none)."""
        seqs: list[tuple[int, ...]] = []
        for w in words:
            check_text(w, "bad_words")
            alone = tuple(self.tokenizer.encode(w.lstrip(), add_special_tokens=False))
            spaced = tuple(self.tokenizer.encode(" " + w.lstrip(), add_special_tokens=False))
            if not alone or any(not 0 <= t < self.vocab_size for t in alone + spaced):
                raise InvalidRequestError(f"bad_words: {w!r} has no token of this model's vocabulary of "
                                          f"{self.vocab_size}")
            seqs.append(alone)
            if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
                seqs.append(spaced)
        return tuple(seqs)

    def resolve_prompt_fields(self, sp: SamplingParams, prompt_len: int) -> SamplingParams:
        """``sp`` for a prompt of ``prompt_len`` tokens (already truncated): ``max_tokens=None``
        becomes the rest of the context, ``bad_words`` get their token ids (:meth:`bad_words_ids`).
        ``sp`` itself when neither applies. Raises InvalidRequestError (a bad word)."""
        changes = {}
        if sp.max_tokens is None:
            changes["max_tokens"] = self.max_model_len - prompt_len
        if sp.bad_words and sp.bad_words_token_ids is None:
            changes["bad_words_token_ids"] = self.bad_words_ids(sp.bad_words)
        return dataclasses.replace(sp, **changes) if changes else sp

    def apply_dynamic_depth(self, sp: SamplingParams, slo: SLO) -> SamplingParams:
        """``sp`` with its SLO class's dynamic depth (:attr:`SLOClasses.dynamic_depth`) when the
        request sets none and may exit early (plain greedy) and exits are served. Raises
        InvalidRequestError (naming ``dynamic_depth``) for a request asking for it where no exit
        heads are loaded."""
        if sp.dynamic_depth is not None:
            if not self.serves_exits:
                raise InvalidRequestError("dynamic_depth: this server does not serve early exits (start it with "
                                          "--dynamic-depth; exits are trained with `laser train-exits`)")
            return sp
        dd = getattr(self.slo_classes, "dynamic_depth", {}).get(slo.name)
        if dd is None or not self.serves_exits or not sp.plain_greedy:
            return sp
        return dataclasses.replace(sp, dynamic_depth=dd)

    # -- requests --------------------------------------------------------------------------------
    def resolve_slo(self, slo: SLO | str | None) -> SLO:
        """An SLO, a class name of the table, or None (the default class). Raises InvalidRequestError."""
        return slo if isinstance(slo, SLO) else self.slo_classes.get(slo)

    def process(self, prompt: str | list[int] | list[dict], sampling_params: SamplingParams | None,
                slo: SLO | str | None, req_id: str | None, arrival_time: float | None,
                clock: Callable[[], float], in_use: Callable[[str], Any] = lambda rid: False) -> Request:
        """The validated :class:`Request` of a client's request (nothing is enqueued).

        ``prompt``: text, token ids, or chat messages; ``arrival_time``: seconds on ``clock``
        (default: now); ``in_use(req_id)``: whether that id is taken already. Raises
        InvalidRequestError (a :class:`ContextLengthError` for a prompt too long), also for
        ``sampling_params`` that is not a :class:`SamplingParams` (a dict, a list).
        """
        sp = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(sp, SamplingParams):
            raise InvalidRequestError(f"sampling_params must be a SamplingParams (or None), got "
                                      f"{type(sp).__name__}: {sp!r:.80}")
        if sp.n != 1:
            raise InvalidRequestError(f"n={sp.n}: a request carries one choice; LLM.generate and the server run "
                                      "n requests (an engine is given them one by one)")
        sp.check_vocab(self.vocab_size)
        if sp.structured_output is not None:
            if self.grammars is None:
                raise InvalidRequestError("structured_output: guided decoding is not served by this front end "
                                          "(it has no grammar backend)")
            err = self.grammars.validate(*sp.structured_output)
            if err is not None:
                raise InvalidRequestError(f"structured_output: {err}")
        ids = self.tokenize(prompt, sp.truncate_prompt_tokens)
        sp = self.resolve_prompt_fields(sp, len(ids))
        slo_obj = self.resolve_slo(slo)
        sp = self.apply_dynamic_depth(sp, slo_obj)
        if req_id is not None and in_use(req_id):
            raise InvalidRequestError(f"request id {req_id!r} is already in use")
        return Request(prompt_token_ids=ids, sampling_params=sp, slo=slo_obj,
                       arrival_time=clock() if arrival_time is None else arrival_time,
                       req_id=req_id or "", prompt=prompt if isinstance(prompt, str) else None)


def check_template_kwargs(kwargs, tokenizer) -> dict:
    """``chat_template_kwargs`` as a dict (None: empty). Raises InvalidRequestError for one that
    is not a dict of string keys, or that names an argument of the tokenizer's own
    ``apply_chat_template`` (``tokenize``, ``add_generation_prompt``, ...: those have their own
    switches, and ``tokenize`` would change what the call returns)."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise InvalidRequestError(f"chat_template_kwargs must be an object of template variables, got {kwargs!r:.80}")
    own = {n for n, p in inspect.signature(tokenizer.apply_chat_template).parameters.items()
           if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    bad = sorted(own & set(kwargs))
    if bad:
        raise InvalidRequestError(f"chat_template_kwargs: {bad[0]!r} is an argument of the renderer, not a template "
                                  "variable (use the request's own field where there is one)")
    return dict(kwargs)
