"""The parser of tool calls in a model's output: ``<tool_call>{"name": ..., "arguments": ...}
</tool_call>`` blocks (the Hermes / Qwen2 / Qwen2.5 / Qwen3 format, and the fallback prompt's,
see :mod:`laser.frontend.tool_prompt`) among free text.

One incremental state machine serves both answers: a stream feeds it each text delta and sends
what it returns as OpenAI ``delta.content`` / ``delta.tool_calls`` chunks; a whole answer is the
same machine fed the whole text (:func:`parse_tool_calls`), so a streamed answer adds up to
exactly the non-streamed one however the text was split (tested at every split position).

What it does (vLLM's ``hermes`` parser and SGLang's ``qwen25`` detector do the same job with a
partial-JSON library; this one scans the JSON itself):

* Text outside blocks is content, streamed as it comes, except a tail that may begin
  ``<tool_call>`` and trailing whitespace (held until it is known whether a call follows):
  whitespace next to a call block is dropped (text before and after calls is joined by one
  newline); without any call the content is the text as written.
* A block whose JSON starts ``{"name": "<name>", "arguments": `` (the order every template and
  the tool grammar write) is streamed: a header delta (``index``, ``id``, ``type``,
  ``function.name``, empty ``arguments``) as soon as the name is complete, then the arguments'
  JSON text as written, fragment by fragment, up to its closing bracket. A stream cut short
  (``max_tokens``) leaves the arguments incomplete, as OpenAI's do.
* Any other block (``"arguments"`` first, extra keys) is held until ``</tool_call>`` and then
  parsed as JSON: an object with a string ``name`` is a call (its arguments re-serialised),
  anything else stays text.
* Without ``parallel`` only the first call is reported (later blocks are dropped).
"""

from __future__ import annotations

import json
import re
import uuid

from ..frontend.tool_prompt import CALL_CLOSE, CALL_OPEN

# the start of a block in the streamed order; the name may not hold '<', so a match never
# reaches into a closing tag (that keeps the result independent of how the text was split)
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\<]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')
_SCALAR_END = set(",}] \t\r\n<")


def new_call_id() -> str:
    """A tool call id (``call_`` and 24 hex digits, OpenAI's shape)."""
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallParser:
    """Incremental parser of one choice's output (see the module docstring).

    :meth:`feed` takes each new piece of text and :meth:`finish` ends it; both return
    ``(content, tool_calls)``: the content text to send now and the ``delta.tool_calls`` items
    (``{"index", "id", "type", "function": {"name", "arguments"}}`` for a new call, then
    ``{"index", "function": {"arguments": fragment}}``). :attr:`calls` holds the calls so far.
    """

    def __init__(self, parallel: bool = True, calls_only: bool = False):
        self.parallel = parallel
        # tool_choice required / named: the grammar lets the model write only call blocks, so any
        # text is a block cut short by the length limit and is dropped, never sent as content
        self.calls_only = calls_only
        self.calls: list[dict] = []  # {"id", "type", "function": {"name", "arguments"}}
        self._buf = ""  # text not consumed yet
        self._state = "text"  # text | head (after <tool_call>) | args (in the arguments) | tail (to </tool_call>)
        self._ws = ""  # whitespace held back in the text (dropped next to a call)
        self._strip = False  # after a call: drop leading whitespace of the text
        self._said = False  # some content was sent
        self._emit = True  # the current block's call is reported (False: dropped, not parallel)
        self._value = ""  # args: the arguments' first character once seen ("" before)
        self._depth, self._in_str, self._esc = 0, False, False

    # -- public ---------------------------------------------------------------------------------
    def feed(self, text: str) -> tuple[str, list[dict]]:
        """Consume ``text``; returns (content delta, tool call deltas) ready to send."""
        self._buf += text
        content, deltas = [], []
        while self._step(content, deltas):
            pass
        return "" if self.calls_only else "".join(content), _merge(deltas)

    def finish(self) -> tuple[str, list[dict]]:
        """End of the output: flush held text, resolve an unterminated block."""
        content, deltas = [], []
        if self._state == "head":  # a block without </tool_call>: a call if its JSON is complete
            self._block(self._buf, False, content, deltas)
        elif self._state == "text":
            self._text(self._buf, content)
        self._buf, self._state = "", "text"
        if not self.calls:
            content.append(self._ws)
        self._ws = ""
        return "" if self.calls_only else "".join(content), _merge(deltas)

    # -- the state machine ---------------------------------------------------------------------
    def _step(self, content: list, deltas: list) -> bool:
        """One move; False when more text is needed."""
        buf = self._buf
        if self._state == "text":
            i = buf.find(CALL_OPEN)
            if i < 0:
                keep = _partial_suffix(buf, CALL_OPEN)
                self._text(buf[:len(buf) - keep], content)
                self._buf = buf[len(buf) - keep:]
                return False
            self._text(buf[:i], content)
            self._buf, self._state = buf[i + len(CALL_OPEN):], "head"
            return True
        if self._state == "head":
            close = buf.find(CALL_CLOSE)
            m = _HEAD.match(buf)
            if m is not None and (close < 0 or m.end() <= close):
                try:
                    name = json.loads(f'"{m.group(1)}"')
                except ValueError:
                    name = None
                if isinstance(name, str):
                    self._open_call(name, None, deltas)
                    self._buf, self._state, self._value = buf[m.end():], "args", ""
                    return True
            if close < 0:
                return False
            self._block(buf[:close], True, content, deltas)
            self._buf, self._state = buf[close + len(CALL_CLOSE):], "text"
            return True
        if self._state == "args":
            n = self._scan(buf)
            if n and self._emit:
                self.calls[-1]["function"]["arguments"] += buf[:n]
                deltas.append({"index": len(self.calls) - 1, "function": {"arguments": buf[:n]}})
            self._buf = buf[n:]
            return self._state != "args"
        close = buf.find(CALL_CLOSE)  # tail: whatever follows the arguments up to </tool_call>
        if close < 0:
            self._buf = buf[len(buf) - _partial_suffix(buf, CALL_CLOSE):]
            return False
        self._buf, self._state, self._strip = buf[close + len(CALL_CLOSE):], "text", True
        return True

    def _scan(self, buf: str) -> int:
        """How many characters of ``buf`` belong to the arguments' JSON value (bracket depth and
        strings tracked); moves to the tail state once the value is complete."""
        for i, c in enumerate(buf):
            if not self._value:
                if c == "<":  # no value at all: "arguments": </tool_call>
                    self._state = "tail"
                    return i
                self._value = c
                self._depth, self._in_str = (1, False) if c in "{[" else (0, c == '"')
                continue
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif c == '"':
                    self._in_str = False
                    if self._depth == 0:  # a string value ends here
                        self._state = "tail"
                        return i + 1
                continue
            if self._depth == 0:  # a number, true, false or null
                if c in _SCALAR_END:
                    self._state = "tail"
                    return i
                continue
            if c == '"':
                self._in_str = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._state = "tail"
                    return i + 1
            elif c == "<":  # a closing tag inside an unfinished value: the arguments stop here
                self._state = "tail"
                return i
        return len(buf)

    def _text(self, text: str, content: list) -> None:
        """Text outside blocks: trailing whitespace held, whitespace right after a call dropped."""
        if self._strip:
            text = text.lstrip()
            if not text:
                return
            self._strip = False
            if self._said:  # text before and after calls: one newline between
                text = "\n" + text
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body):]
        if body:
            content.append(body)
            self._said = True

    def _block(self, body: str, closed: bool, content: list, deltas: list) -> None:
        """A block held whole: a call when its JSON is an object with a string ``name``, else text."""
        try:
            obj = json.loads(body)
        except ValueError:
            obj = None
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            args = obj.get("arguments", obj.get("parameters", {}))
            self._open_call(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
                            deltas)
            self._strip = True
            return
        self._text(CALL_OPEN + body + (CALL_CLOSE if closed else ""), content)

    def _open_call(self, name: str, arguments: str | None, deltas: list) -> None:
        """A new call: whitespace held before it is dropped; reported unless a second one
        without ``parallel``."""
        self._ws = ""
        self._emit = self.parallel or not self.calls
        if not self._emit:
            return
        call = {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments or ""}}
        self.calls.append(call)
        deltas.append({"index": len(self.calls) - 1, **call, "function": dict(call["function"])})


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def _merge(deltas: list[dict]) -> list[dict]:
    """Consecutive deltas of one call joined (a header and its fragments in one item)."""
    out: list[dict] = []
    for d in deltas:
        if out and out[-1]["index"] == d["index"] and "id" not in d:
            prev = out[-1] = {**out[-1], "function": dict(out[-1]["function"])}
            prev["function"]["arguments"] = prev["function"].get("arguments", "") + d["function"]["arguments"]
        else:
            out.append({**d, "function": dict(d["function"])})
    return out


def parse_tool_calls(text: str, parallel: bool = True, calls_only: bool = False) -> tuple[str | None, list[dict]]:
    """(content, calls) of a whole output: the content None when calls were found and no text
    is left, or always with ``calls_only`` (see :class:`ToolCallParser`); each call
    ``{"id", "type": "function", "function": {"name", "arguments"}}``."""
    p = ToolCallParser(parallel, calls_only)
    head, _ = p.feed(text)
    tail, _ = p.finish()
    content = head + tail
    return (content or None) if p.calls or calls_only else content, p.calls
