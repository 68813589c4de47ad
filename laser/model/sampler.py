"""Token sampling: logits processing (grammar mask, allowed token ids, bad words, bias, min_tokens, penalties), greedy, temperature, min-p,
top-k, top-p, per-request seeds, and the raw log-probabilities a request asks for.

A seeded request draws its ``k``-th token (``k`` = tokens it has generated so far) from a generator
seeded with :func:`draw_seed` ``(seed, k)``: its draws depend on nothing but its seed, its position
and its logits -- not on what it is batched with, and not on where it ran: a request handed off,
migrated or re-prefilled elsewhere after a failure (its generated tokens replayed) continues the
same stream with nothing carried along (vLLM and SGLang keep one generator per request, whose
state would have to travel). Unseeded requests share one generator. Semantics and order follow vLLM's ``SamplingParams`` and v1 sampler
(``vllm/v1/sample/sampler.py``): raw logprobs, then the allowed token ids, the bad words, logit
bias and min_tokens, then the
penalties (``apply_penalties``), then greedy argmax -- or temperature, min-p, top-k, top-p and
a draw.

The penalties' token counts follow the request's own tokens (``Request.output_token_ids``:
every generated token, including those a re-prefill replayed): a per-request cache advanced by
the new tokens at each sample and rebuilt from the request when missing, so nothing needs to
travel with the request: preemption, layer pauses, hand-off and fail-over keep them exact. A request without any of these fields takes none of this work.
"""

from __future__ import annotations

import torch

from ..core.request import Request, TokenLogprob

# Rows of prompt log-probabilities computed at once (bounds the [rows, V] fp32 temporaries).
LOGPROB_ROWS = 256
# Where a processed logit saturates: float32's largest value over ten times the largest
# 1 / temperature a sampled request divides by (temperatures below 1e-5 are greedy), so it stays
# finite after that division (float32 rounding included).
SATURATED_LOGIT = torch.finfo(torch.float32).max * 1e-6


def logprob_entries(logits: torch.Tensor, targets: torch.Tensor, k: int) -> list[TokenLogprob]:
    """Raw log-probabilities of ``targets`` under ``logits``.

    Args:
        logits: [T, V] float32 (raw model logits, one row per position).
        targets: [T] int64, the token whose log-probability each row gives.
        k: how many most likely tokens to list per row (0: none).
    Returns:
        T :class:`~laser.request.TokenLogprob` (natural log; top ``k`` most likely first).
    """
    out: list[TokenLogprob] = []
    for a in range(0, logits.shape[0], LOGPROB_ROWS):
        lp = logits[a:a + LOGPROB_ROWS].float().log_softmax(-1)
        tgt = lp.gather(1, targets[a:a + LOGPROB_ROWS, None]).squeeze(1).tolist()
        if k > 0:
            vals, idx = torch.topk(lp, min(k, lp.shape[1]), dim=-1)
            tops = [tuple(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
        else:
            tops = [()] * len(tgt)
        out.extend(TokenLogprob(t, top) for t, top in zip(tgt, tops))
    return out


def mask_token_lists(row: torch.Tensor, req: Request, extra: list[int] = ()) -> torch.Tensor:
    """``req``'s ``allowed_token_ids`` and bad words applied to one row of logits (vLLM's v1
    sampler: the allowed-ids mask, then ``apply_bad_words``): every token outside the allowed ids
    at -inf, and the last token of each bad word (``SamplingParams.bad_words_token_ids``) at -inf
    when the output so far (plus ``extra``, a speculative step's drafts) ends with the word's other
    tokens -- a one-token word always. A mask that would leave no token (the allowed ids all
    banned, or none of them allowed by the request's grammar) is not applied at this step: the
    grammar wins, as it does over ``min_tokens``.

    Args:
        row: [V] float32 logits (a copy the caller owns); modified in place and returned.
        req: the request (``output_token_ids``: the tokens generated so far).
        extra: tokens taken as generated after them.
    Raises:
        RuntimeError: ``bad_words`` without their token ids (a request that skipped the input
            path, :meth:`laser.frontend.inputs.InputProcessor.process`).
    """
    sp = req.sampling_params
    before = row.clone()
    if sp.allowed_token_ids is not None:
        idx = torch.tensor(sp.allowed_token_ids, dtype=torch.long)
        kept = row[idx]
        row.fill_(float("-inf"))
        row[idx] = kept
    if sp.bad_words:
        if sp.bad_words_token_ids is None:
            raise RuntimeError("bad_words need their token ids (laser.frontend.inputs.InputProcessor.process)")
        out, extra = req.output_token_ids, list(extra)
        for ids in sp.bad_words_token_ids:
            k = len(ids) - 1  # the tokens before the banned one
            if k > len(out) + len(extra):
                continue
            tail = extra[len(extra) - k:] if k <= len(extra) else out[len(out) - (k - len(extra)):] + extra
            if k == 0 or tail == list(ids[:-1]):
                row[ids[-1]] = float("-inf")
    if not torch.isfinite(row).any():
        row.copy_(before)
    return row


_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, k: int) -> int:
    """The generator seed of a seeded request's ``k``-th draw (``k`` = tokens generated before it,
    replayed ones included): SplitMix64 (Steele, Lea and Flood, OOPSLA'14) of the pair, so
    nearby seeds and positions give unrelated streams. Returns an int in [0, 2**63)."""
    z = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + k + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class Sampler:
    """Samples one token per row. ``eos_ids``: the ids ``min_tokens`` masks (with each
    request's ``stop_token_ids``) until enough tokens are generated."""

    def __init__(self, seed: int = 0, eos_ids=()):
        self._shared = torch.Generator().manual_seed(seed)
        self._gens: dict[str, torch.Generator] = {}  # seeded requests: one generator each, re-seeded per draw
        # req id -> [output counts [V] f32, seen in prompt or output [V] bool, tokens counted]
        self._pen: dict[str, list] = {}
        self.eos_ids = frozenset(eos_ids)
        # Structured output's masks (laser.model.structured.GrammarBackend; set by a front end that
        # has the tokenizer). None: a structured request is an error here.
        self.grammars = None
        self._grammar: dict = {}  # structured requests: req id -> GrammarState (their matcher)

    def release(self, req_id: str) -> None:
        """Forget ``req_id``'s sampling state (generator, penalty counts, grammar matcher)."""
        self._gens.pop(req_id, None)
        self._pen.pop(req_id, None)
        self._grammar.pop(req_id, None)

    def process_logits(self, row: torch.Tensor, req: Request, extra: list[int] = ()) -> torch.Tensor:
        """``req``'s grammar mask, allowed token ids and bad words (:func:`mask_token_lists`), logit
        bias, min_tokens mask and penalties applied to one row (vLLM's order and formulas:
        ``apply_bad_words``, ``LogitBiasLogitsProcessor``, ``MinTokensLogitsProcessor``,
        ``apply_penalties``).

        Args:
            row: [V] float32 logits of ``req``'s next token; modified in place and returned
                (the caller passes a copy).
            req: the request; ``output_token_ids`` are the tokens generated so far.
            extra: tokens taken as generated after them (a speculative step's drafts before this
                position: :mod:`laser.spec`); they count for min_tokens and the penalties.
                Not valid with structured output (the grammar state is the request's own).
        """
        sp = req.sampling_params
        V = row.shape[0]
        if sp.structured_output is not None:
            if self.grammars is None:
                raise RuntimeError("structured output needs a grammar backend (laser.model.structured) on this sampler")
            self._grammar[req.req_id] = self.grammars.mask(row, req, self._grammar.get(req.req_id))
        if sp.allowed_token_ids is not None or sp.bad_words:
            row = mask_token_lists(row, req, extra)
        if sp.logit_bias:
            ids = torch.tensor([t for t, _ in sp.logit_bias], dtype=torch.long)
            row.index_add_(0, ids, torch.tensor([b for _, b in sp.logit_bias], dtype=row.dtype))
        if sp.min_tokens and req.num_output_tokens + len(extra) < sp.min_tokens:
            stop = set(sp.stop_token_ids) | (set() if sp.ignore_eos else self.eos_ids)
            ids = [t for t in stop if t < V]
            if ids:
                idx = torch.tensor(ids, dtype=torch.long)
                kept = row[idx].clone()
                row[idx] = float("-inf")
                if sp.structured_output is not None and not torch.isfinite(row).any():
                    row[idx] = kept  # a complete grammar allows only EOS: the grammar wins
        rp, fp, pp = sp.repetition_penalty, sp.frequency_penalty, sp.presence_penalty
        if rp != 1.0 or fp or pp:
            counts, seen_any = self._counts(req, V, extra)
            if rp != 1.0:  # prompt and output tokens (vLLM: prompt_mask | output_mask)
                # an extreme penalty must not make the softmax NaN (that failed every request in the
                # step): the scale is a finite non-zero float32 (0 * inf, -inf * 0 are NaN), and a
                # finite logit it moves past float32 (1e-38: +inf) saturates at +-SATURATED_LOGIT;
                # a masked token's -inf stays
                fin = torch.finfo(row.dtype)
                rp32 = torch.tensor(min(max(rp, fin.tiny), fin.max), dtype=row.dtype)
                scale = torch.where(seen_any, rp32, torch.tensor(1.0, dtype=row.dtype))
                pen = torch.where(row > 0, row / scale, row * scale)
                row = torch.where(row.isinf(), row, pen.clamp(-SATURATED_LOGIT, SATURATED_LOGIT))
            if fp:
                row -= fp * counts
            if pp:
                row -= pp * (counts > 0).to(row.dtype)
        return row

    def _counts(self, req: Request, V: int, extra: list[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """(output token counts [V] float32, seen in prompt or output [V] bool) of ``req``: a cache
        advanced by the tokens generated since the last call, rebuilt from the request's own
        tokens when missing (a hand-off, a re-prefill) -- the request's tokens are the truth.
        ``extra``: tokens counted on top, in fresh tensors (the cache keeps the request's own)."""
        out = req.output_token_ids
        st = self._pen.get(req.req_id)
        if st is None or st[2] > len(out) or st[0].shape[0] != V:
            seen = torch.zeros(V, dtype=torch.bool)
            prompt = torch.tensor(req.prompt_token_ids, dtype=torch.long)
            seen[prompt[prompt < V]] = True
            st = self._pen[req.req_id] = [torch.zeros(V, dtype=torch.float32), seen, 0]
        if st[2] < len(out):
            new = torch.tensor(out[st[2]:], dtype=torch.long)
            st[0].index_put_((new,), torch.ones(len(new)), accumulate=True)
            st[1][new] = True
            st[2] = len(out)
        if not extra:
            return st[0], st[1]
        new = torch.tensor(list(extra), dtype=torch.long)
        seen = st[1].clone()
        seen[new] = True
        return st[0].index_add(0, new, torch.ones(len(new))), seen

    def sample(self, logits: torch.Tensor, reqs: list[Request],
               logprobs: dict[str, TokenLogprob] | None = None) -> list[int]:
        """logits [R, V] float32 (row r belongs to reqs[r]) -> R token ids.

        ``logprobs``: when given, filled with req id -> the sampled token's raw
        :class:`~laser.request.TokenLogprob` (top ``logprobs`` tokens) for every request that asks
        for logprobs (``SamplingParams.logprobs`` not None)."""
        want_lp = [r for r, req in enumerate(reqs) if req.sampling_params.logprobs is not None] \
            if logprobs is not None else []
        raw = logits[want_lp] if want_lp else None  # advanced indexing: a copy of the raw rows
        proc = [r for r, req in enumerate(reqs) if req.sampling_params.processes_logits]
        if proc:
            logits = logits.clone()
            for r in proc:
                logits[r] = self.process_logits(logits[r], reqs[r])
        # the first maximum per row, as argmax; max's vectorized reduction: 32 x 49152 fp32 rows in ~1/3
        # of argmax's time on the AMX Xeon, 1 thread (3.4 ms a batch-32 step was argmax)
        out = logits.max(dim=-1).indices.tolist()
        for r, req in enumerate(reqs):
            sp = req.sampling_params
            if sp.greedy:
                continue
            row = self.filter_logits(logits[r], sp)
            gen = self._generator(req)
            out[r] = int(torch.multinomial(row.softmax(-1), 1, generator=gen))
        for k, r in enumerate(want_lp):
            sp = reqs[r].sampling_params
            logprobs[reqs[r].req_id] = logprob_entries(raw[k:k + 1], torch.tensor([out[r]]), sp.logprobs)[0]
        return out

    @staticmethod
    def filter_logits(row: torch.Tensor, sp) -> torch.Tensor:
        """Temperature, min-p, top-k and top-p (vLLM's v1 sampler's order) applied to one row of
        processed logits (:meth:`process_logits`) of a non-greedy request with sampling params
        ``sp``: [V] float32 -> a new [V] float32 row whose softmax is the distribution drawn from
        (removed tokens at -inf; the top-1 token always kept)."""
        row = row / sp.temperature
        if sp.min_p > 0:
            probs = row.softmax(-1)
            row = row.masked_fill(probs < sp.min_p * probs.max(), float("-inf"))
        if sp.top_k > 0 and sp.top_k < row.shape[0]:
            kth = torch.topk(row, sp.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if sp.top_p < 1.0:
            # stable: equal logits keep index order, so the first kept token is exactly
            # row.argmax() (the first maximum), the greedy token when temperature is 1
            sorted_logits, idx = torch.sort(row, descending=True, stable=True)
            probs = sorted_logits.softmax(-1)
            # keep the smallest prefix whose mass reaches top_p, and always the top-1 token
            # (its exclusive cumulative mass is 0, but a top_p below float32's range, e.g.
            # 1e-300, compares as 0 >= 0: without this, every token would be masked)
            drop = probs.cumsum(-1) - probs >= sp.top_p
            drop[0] = False
            sorted_logits[drop] = float("-inf")
            row = torch.full_like(row, float("-inf")).scatter(0, idx, sorted_logits)
        return row

    def sampling_probs(self, logits: torch.Tensor, req: Request, extra: list[int] = ()) -> torch.Tensor:
        """The distribution :meth:`sample` draws ``req``'s next token from: [V] float32 raw logits
        -> [V] float32 probabilities after the logits processing (:meth:`process_logits`, with
        ``extra`` tokens taken as generated) and :meth:`filter_logits`. For a non-greedy request
        (speculative sampling's target and draft distributions, :mod:`laser.spec`)."""
        row = logits.float().clone()
        if req.sampling_params.processes_logits:
            row = self.process_logits(row, req, extra)
        return self.filter_logits(row, req.sampling_params).softmax(-1)

    def generator_at(self, req: Request, k: int) -> torch.Generator:
        """The generator of ``req``'s ``k``-th draw: the shared one for an unseeded request, else
        a fresh generator seeded with :func:`draw_seed` ``(seed, k)`` (a speculative step holds
        one per position it drafts)."""
        seed = req.sampling_params.seed
        return self._shared if seed is None else torch.Generator().manual_seed(draw_seed(seed, k))

    def _generator(self, req: Request) -> torch.Generator:
        """The shared generator, or a seeded request's generator set for its next draw."""
        seed = req.sampling_params.seed
        if seed is None:
            return self._shared
        g = self._gens.get(req.req_id)
        if g is None:
            g = self._gens[req.req_id] = torch.Generator()
        return g.manual_seed(draw_seed(seed, req.num_output_tokens))
