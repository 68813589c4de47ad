"""Token texts of the OpenAI answers: log-probabilities in the chat and legacy completions
shapes, and the tokenizer's own token strings (vLLM's ``/tokenize``)."""

from __future__ import annotations

import copy
import functools

#: The logprob reported for a token of probability 0 in fp32 (JSON has no -Infinity; vLLM's value).
MIN_LOGPROB = -9999.0


class TokenTexts:
    """Token id -> its text (``tokenizer.decode([id])``, as vLLM reports logprob tokens), cached;
    a private tokenizer copy used on the event loop only (a Rust tokenizer must not be shared
    between threads)."""

    def __init__(self, tokenizer):
        self.tok = tok = copy.deepcopy(tokenizer)
        self.text = functools.lru_cache(maxsize=1 << 16)(lambda i: tok.decode([i]))

    def pieces(self, ids: list[int]) -> list[str]:
        """The tokenizer's own token strings (``convert_ids_to_tokens``, vLLM's ``token_strs``)."""
        return self.tok.convert_ids_to_tokens(list(ids))

    def completion(self, ids, entries, offset: int) -> dict:
        """OpenAI's legacy completions ``logprobs`` of tokens ``ids`` (``entries``: their
        :class:`~laser.request.TokenLogprob`, None for the prompt's first token): ``tokens``,
        ``token_logprobs``, ``top_logprobs`` (token text -> logprob: the top tokens and the token
        itself, as vLLM) and ``text_offset`` (character offsets from ``offset``)."""
        tokens, lps, tops, offsets = [], [], [], []
        for i, e in zip(ids, entries):
            t = self.text(i)
            tokens.append(t)
            offsets.append(offset)
            offset += len(t)
            if e is None:
                lps.append(None)
                tops.append(None)
                continue
            lps.append(max(e.logprob, MIN_LOGPROB))
            top = {self.text(j): max(v, MIN_LOGPROB) for j, v in e.top}
            top.setdefault(t, lps[-1])
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def chat(self, ids, entries) -> list[dict]:
        """The ``logprobs.content`` list of chat: per token ``token``, ``logprob``, ``bytes`` (UTF-8)
        and ``top_logprobs`` (the same fields of the most likely tokens)."""
        def one(i, v):
            t = self.text(i)
            return {"token": t, "logprob": max(v, MIN_LOGPROB), "bytes": list(t.encode("utf-8"))}

        return [{**one(i, e.logprob), "top_logprobs": [one(j, v) for j, v in e.top]} for i, e in zip(ids, entries)]
