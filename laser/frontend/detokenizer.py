"""Incremental detokenization and stop-string matching.

Decodes a short window of recent tokens each step instead of the whole output, and holds
back text that ends in an incomplete UTF-8 sequence (U+FFFD) until the next token
completes it (the prefix/read-offset scheme of vLLM's ``detokenize_incrementally`` and
TGI).
"""

from __future__ import annotations


class IncrementalDetokenizer:
    """Per-request detokenizer state. ``text`` is the output decoded so far."""

    __slots__ = ("tokenizer", "ids", "prefix_offset", "read_offset", "text", "skip_ids")

    def __init__(self, tokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        # Start with a few prompt tokens as context so leading spaces decode right.
        self.ids = list(prompt_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.skip_ids = set(getattr(tokenizer, "all_special_ids", ()) or ())

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (may be empty)."""
        if token_id in self.skip_ids:
            return ""
        self.ids.append(token_id)
        dec = self.tokenizer.decode
        prefix = dec(self.ids[self.prefix_offset : self.read_offset])
        full = dec(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""


def find_stop(text: str, stops: tuple[str, ...], new_len: int) -> int | None:
    """Index in ``text`` where the earliest stop string starts, searching only where the
    last ``new_len`` characters could complete one; None if none matched."""
    best = None
    for s in stops:
        start = max(0, len(text) - new_len - len(s) + 1)
        i = text.find(s, start)
        if i != -1 and (best is None or i < best):
            best = i
    return best


class OutputText:
    """A request's output text as the client sees it: incremental detokenization, stop strings,
    and the hold-back that keeps streamed deltas consistent (the one owner of that rule).

    Text that could still turn out to be the start of a stop string (its length - 1
    characters) is held back until the request finishes, so the streamed deltas always add up
    to the final, cut text.
    """

    __slots__ = ("detok", "stop", "hold", "sent")

    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...] = (),
                 output_ids: list[int] = ()):
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        for t in output_ids:  # a request continuing here (hand-off): its text so far was sent
            self.detok.add(t)
        self.sent = max(0, len(self.detok.text) - self.hold)

    @property
    def text(self) -> str:
        return self.detok.text

    def add(self, token_id: int) -> bool:
        """Append a token. True when a stop string matched (the text is cut before it)."""
        delta = self.detok.add(token_id)
        if self.stop and delta:
            cut = find_stop(self.detok.text, self.stop, len(delta))
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
