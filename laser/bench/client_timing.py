"""Client-side token timing of a streamed OpenAI-compatible response (SSE chunks -> token times).

A chunk may carry several tokens (a multi-byte character held back until complete, a stop
string held back) or none (a special token). Timing one token per text chunk, as a naive
client does, miscounts both; this module counts tokens exactly:

1. **Per-chunk token ids** (``return_token_ids: true``, vLLM's extension, also served by Laser):
   a chunk carrying ``k`` token ids gives ``k`` token times, all at the chunk's arrival.
2. **Otherwise, the usage totals** (``stream_options: {include_usage: true}``): one token
   time per chunk with text, then, if the usage chunk reports more completion tokens, the
   missing ones at the last chunk's time.

TBT of a multi-token chunk: the gap before the chunk counts once (to its first token) and its
other tokens count 0 — the convention of vLLM's benchmark client (``benchmarks/
backend_request_func.py``: one ITL per chunk; with per-chunk usage counts, ``inc - 1`` zeros).
So TTFT is the first chunk with a token, TPOT = (last token time - first) / (tokens - 1) is
vLLM's ``(latency - ttft) / (output_len - 1)`` with the exact token count, and the P99 TBT
sees every real gap once.
"""

from __future__ import annotations


class ChunkTokenTimer:
    """Feed it every parsed SSE ``data:`` object with its arrival time; read :meth:`token_times`."""

    def __init__(self):
        self._times: list[float] = []  # one per token known from token ids (or per text chunk)
        self.exact = False  # some chunk carried token ids
        self.usage_tokens: int | None = None
        self.finish_reason: str | None = None
        self._last: float | None = None

    def feed(self, obj: dict, now: float) -> None:
        """One streamed object (``choices`` chunk or usage chunk) that arrived at ``now`` (seconds)."""
        usage = obj.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            self.usage_tokens = int(usage["completion_tokens"])
        for c in obj.get("choices") or []:
            ids = c.get("token_ids")
            if ids is not None:
                if not self.exact:  # switch to exact counting: drop guesses from text chunks
                    self.exact = True
                    self._times = []
                self._times.extend([now] * len(ids))
                if ids:
                    self._last = now
            elif not self.exact:
                text = c.get("text")
                if text is None:
                    text = (c.get("delta") or {}).get("content")
                if text:
                    self._times.append(now)
                    self._last = now
            if c.get("finish_reason"):
                self.finish_reason = c["finish_reason"]

    def token_times(self) -> list[float]:
        """Arrival time of every output token (seconds, client clock), in order."""
        times = list(self._times)
        if not self.exact and self.usage_tokens is not None and times:
            if self.usage_tokens > len(times):
                times += [times[-1]] * (self.usage_tokens - len(times))
        return times
