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
