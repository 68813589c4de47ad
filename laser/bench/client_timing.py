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

:func:`sse_data` reads the stream's ``data:`` payloads from its raw byte chunks: the benchmark's
client shares the host with the server it times, so it splits lines on bytes itself instead of
httpx's text line decoder (and :class:`~laser.bench.client.ClientTarget` copies no token times per chunk).
"""

from __future__ import annotations


async def sse_data(chunks, clock):
    """``(payload, t)`` for every ``data:`` line of a server-sent event stream, in order: the
    payload as bytes, stripped, and ``t`` = ``clock()`` (seconds) when the byte chunk that
    completed the line arrived -- every line of one chunk arrived together, so parsing one does
    not make the next look later. ``chunks``: an async iterable of ``bytes`` (httpx's
    ``aiter_bytes()``). A line may span chunks; lines end in a newline (a carriage return before
    it goes with the strip); other fields (``event:``, ``id:``, comments) and blank lines are
    skipped; a last line without its newline is still read when the stream ends."""
    rest, t = b"", None
    async for chunk in chunks:
        if not chunk:
            continue
        t = clock()
        lines = (rest + chunk if rest else chunk).split(b"\n")
        rest = lines.pop()
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].strip(), t
    if rest.startswith(b"data:"):
        yield rest[5:].strip(), t


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

    @property
    def first(self) -> float | None:
        """Arrival time of the first output token known so far (seconds), or None."""
        return self._times[0] if self._times else None

    def token_times(self) -> list[float]:
        """Arrival time of every output token (seconds, client clock), in order."""
        times = list(self._times)
        if not self.exact and self.usage_tokens is not None and times:
            if self.usage_tokens > len(times):
                times += [times[-1]] * (self.usage_tokens - len(times))
        return times
