"""Executes a :class:`~laser.core.plan.StepPlan` layer by layer on the model: the torch executor of
the plan walker (:mod:`laser.core.walk`, which owns every layer-boundary rule).

For layer j the runner runs, in one batched call, every work with
``layer_start <= j < layer_end``. The batch *composition* changes only at layers where
a work starts or ends; only there does the runner touch Python-level per-request state:
it parks leaving works' hidden states in the intermediate cache, embeds or restores
joining works, concatenates the residual stream and builds :class:`AttnMetadata` once
for every layer the composition runs.

Rows of the residual stream are ordered decode works first, then prefill works; each
work's rows are contiguous.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from ..core.intermediate_cache import IntermediateCache
from .kv_cache import KVCache
from ..latency.features import DEFAULT_MAX_GATHER_BYTES, decode_slices, max_gather_positions
from .attn_metadata import build_attn_metadata
from .attn_steady import SteadyDecode
from .llama import AttnMetadata, LlamaModel
from ..core.walk import walk
from ..core.plan import StepPlan, StepResult, Work
from ..core.request import Request
from .sampler import Sampler, logprob_entries


class ModelRunner:
    """Owns the model, the KV cache tensor and the intermediate cache payloads."""

    def __init__(self, model: LlamaModel, kv_cache: KVCache, icache: IntermediateCache, sampler: Sampler | None = None):
        self.model = model
        self.kv_cache = kv_cache
        self.bm = kv_cache.block_manager
        self.icache = icache
        self.sampler = sampler or Sampler()
        self.num_layers = model.config.num_layers
        model.bind_kv_cache(kv_cache.kv)
        self._group_size = model.config.num_heads // model.config.num_kv_heads
        # Per-layer KV streaming (prefill role, issue 13): req id -> send(layer, K, V), called as
        # soon as the request's final prefill chunk has written a layer; the sent copies are kept
        # here until the hand-off exports them (:meth:`export_kv`), so no layer is copied twice.
        self.kv_streams: dict[str, Callable[[int, torch.Tensor, torch.Tensor], None]] = {}
        self._streamed: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        # Dynamic depth (laser.core.depth): trained exit heads (set_exits), the boundaries the
        # walker asks early_exit at in the running step (empty unless a work opted in).
        self.exits = None
        self.exit_layers: frozenset[int] = frozenset()
        self._exit_boundaries: frozenset[int] = frozenset()
        # KV written, per request: N ints, positions 0..wm[l]-1 of layer l hold K/V this runner
        # wrote (or imported); reads past them are recorded in kv_gaps (check_integrity). Plain
        # lists: a work's update is ~1 us of Python, where numpy's cost ~30 us after a layer call.
        self._kv_written: dict[str, list[int]] = {}
        self.kv_gaps: list[tuple[str, int, int, int]] = []  # (req id, layer, written, needed)
        # Attention-metadata pieces a step's compositions share (the gather groups' KV indices and
        # masks: build_attn_metadata's memo), kept for one step (execute) only: None outside it.
        self._meta_memo: dict | None = None
        # The last decode-only batch's metadata, kept across steps: a steady decode batch's is
        # derived from it (laser.model.attn_steady), in place where every decode group runs the C++
        # decode kernel (the step's metadata is dropped when the step ends: nothing else holds it).
        f = model.fused
        self._steady = SteadyDecode(in_place=f is not None and f.attention_kernel is not None, dtype=model.dtype)
        # The step's prepared compositions (prepare): change point -> (works in row order, layers,
        # their attention metadata); empty outside a step.
        self._planned: dict[int, tuple[list[Work], range, AttnMetadata]] = {}

    @torch.inference_mode()
    def execute(
        self,
        plan: StepPlan,
        requests: dict[str, Request],
        stop_at: Callable[[int], bool] | None = None,
        return_logits: bool = False,
    ) -> StepResult:
        """Run ``plan`` by the layer-boundary rules of :func:`laser.core.walk.walk` (``stop_at(j)``
        pauses prefill work at boundary j; decode works run on to their ``layer_end``).

        Preconditions: the scheduler allocated KV blocks for every work's tokens at every
        layer it runs, and works with ``layer_start > 0`` have their hidden state in the
        intermediate cache. Postconditions: works that stopped before the last layer have
        their hidden state in the intermediate cache.
        """
        self._requests = requests
        self._return_logits = return_logits
        self._hidden = None
        self._meta = None
        self._meta_memo = {}
        self._planned = {}
        self._res = res = StepResult(stopped_layer=0)
        ex = self.exits
        self.exit_layers = (self._exit_boundaries if ex is not None and any(
            w.num_tokens == 1 and requests[w.req_id].sampling_params.dynamic_depth is not None for w in plan.works)
                            else frozenset())
        res.stopped_layer = walk(plan, self, stop_at)
        self._hidden = self._meta = self._requests = self._meta_memo = None
        self._planned = {}
        self.exit_layers = frozenset()
        return res

    # -- dynamic depth (laser.core.depth) -----------------------------------------------------------
    def set_exits(self, heads) -> None:
        """Serve dynamic-depth requests with ``heads`` (:class:`laser.model.exits.ExitHeads`, bound
        here to the model; None: no early exits, every request runs every layer)."""
        self.exits = None if heads is None else heads.bind(self.model)
        self._exit_boundaries = frozenset() if heads is None else frozenset(
            k for k in heads.depths if 0 < k < self.num_layers)

    def early_exit(self, active: list[Work], layer: int) -> list[Work]:
        """The walker's exit check at boundary ``layer`` (the hidden rows are after ``layer``
        layers). Each decode work of a dynamic-depth request that is at least its
        ``min_depth`` deep and plain greedy (:attr:`SamplingParams.plain_greedy`) exits when the
        exit head's top-1 probability (softmax over the head's draft vocabulary) is at least its
        ``threshold``: its token is that top-1 token, and layers ``layer..N-1`` get the position's
        K/V from the exit hidden state through their K/V projections only
        (:meth:`LlamaModel.kv_projection`; CALM's propagation, Schuster et al. NeurIPS'22 §3.2),
        so later tokens attend to a K/V at every layer. Records the token in the step result's
        ``sampled`` and the layer in ``exit_layers``; the exited rows leave the hidden state.
        Returns the works still active (``active`` itself when none exits)."""
        reqs, n = self._requests, self.num_layers
        rows = self._rows(active)
        cand = []
        for i, w in enumerate(active):
            if w.num_tokens != 1:
                continue
            r = reqs[w.req_id]
            sp = r.sampling_params
            dd = sp.dynamic_depth
            if (dd is None or layer < dd.min_layers(n) or not r.output_token_ids or w.token_start != r.num_tokens - 1
                    or not sp.plain_greedy or not self.bm.covers(w.req_id, w.context_len)):
                continue
            cand.append((i, w, dd.threshold))
        if not cand:
            return active
        t0 = time.perf_counter()
        hid = self._hidden
        idx = torch.tensor([rows[i][0] for i, _, _ in cand])
        h = hid.index_select(0, idx)
        logits = self.exits.draft_logits(layer, h).float()
        top, arg = torch.softmax(logits, dim=-1).max(dim=-1)
        go = [j for j, (_, _, thr) in enumerate(cand) if top[j].item() >= thr]
        if not go:
            self._res.compute_seconds += time.perf_counter() - t0
            return active
        toks = self.exits.vocab[arg[go]].tolist()
        gone = [cand[j][1] for j in go]
        hx = h[go] if len(go) < len(cand) else h
        pos = torch.tensor([w.token_start for w in gone])
        cos, sin = self.model.rope_cos[pos], self.model.rope_sin[pos]
        bs, kv = self.bm.block_size, self.kv_cache.kv
        for l in range(layer, n):
            k, v = self.model.kv_projection(l, hx, cos, sin)
            slots = torch.tensor([self.bm.table(w.req_id, l)[w.token_start // bs] * bs + w.token_start % bs
                                  for w in gone], dtype=torch.long)
            kv[l, 0].index_copy_(0, slots, k)
            kv[l, 1].index_copy_(0, slots, v)
        res = self._res
        for w, t in zip(gone, toks):
            res.sampled[w.req_id] = t
            res.exit_layers[w.req_id] = layer
            self._wrote(w, w.layer_start, n)
        res.compute_seconds += time.perf_counter() - t0
        res.num_layer_calls += n - layer  # the K/V projections of the skipped layers (one batched call each)
        ids = {id(w) for w in gone}
        keep = [w for w in active if id(w) not in ids]
        if keep:
            parts = [hid[a:b] for w, (a, b) in zip(active, rows) if id(w) not in ids]
            self._hidden = torch.cat(parts) if len(parts) > 1 else parts[0]
        else:
            self._hidden = None
        return keep

    # -- KV written (check_integrity: no later token reads a slot nothing wrote) -----------------
    def _wrote(self, w: Work, start: int, end: int) -> None:
        """``w``'s positions are written at layers ``[start, end)`` (it ran them, or an exit filled them)."""
        wm = self._kv_written.get(w.req_id)
        if wm is not None and end > start:
            ts, c = w.token_start, w.context_len
            wm[start:end] = [c if ts <= x < c else x for x in wm[start:end]]

    def _check_reads(self, w: Work) -> None:
        """Before ``w`` runs: its earlier positions must be written at every layer it runs. A request
        first seen here starts from what it holds (a prefix-cache hit); a fresh prefill from 0 restarts
        the count (after a preemption freed its KV)."""
        wm = self._kv_written.get(w.req_id)
        if wm is None or (w.token_start == 0 and w.layer_start == 0):
            self._kv_written[w.req_id] = [w.token_start] * self.num_layers
            return
        seg = wm[w.layer_start:w.layer_end]
        low = min(seg)
        if low < w.token_start:
            layer = w.layer_start + seg.index(low)
            self.kv_gaps.append((w.req_id, layer, low, w.token_start))

    def mark_kv_written(self, req_id: str, layers: range, num_tokens: int) -> None:
        """Positions ``0..num_tokens-1`` of ``req_id`` are written at ``layers`` by a caller that runs
        layers itself (self-speculation's draft and verify passes)."""
        wm = self._kv_written.get(req_id)
        if wm is not None:
            wm[layers.start:layers.stop] = [max(x, num_tokens) for x in wm[layers.start:layers.stop]]

    def check_integrity(self, running) -> None:
        """Raise AssertionError when a work read a K/V slot nothing wrote (an uninitialised slot:
        recorded as it joined a step), or a running request's computed tokens lack K/V at some
        layer (``num_computed_tokens`` at every layer, its in-flight chunk below ``next_layer``)."""
        if self.kv_gaps:
            rid, layer, have, need = self.kv_gaps[0]
            raise AssertionError(f"uninitialised KV slot: {rid} read positions 0..{need - 1} at layer {layer}, "
                                 f"only 0..{have - 1} written ({len(self.kv_gaps)} such reads)")
        for r in running:
            wm = self._kv_written.get(r.req_id)
            if wm is None or not self.bm.has(r.req_id):
                continue
            for layer in range(self.num_layers):
                need = r.num_computed_tokens + (r.chunk_tokens if layer < r.next_layer else 0)
                if wm[layer] < need:
                    raise AssertionError(f"uninitialised KV slot: {r.req_id} has {need} tokens computed at layer "
                                         f"{layer}, K/V written for {int(wm[layer])}")

    # -- the instance core's executor hooks (laser.instance.core.Executor) ---------------------------
    def export_kv(self, req: Request) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (K, V) of ``req``'s computed tokens, each ``[T, kv_heads, head_dim]``.

        Layers already streamed (:attr:`kv_streams`) are the copies sent then; any layer not
        streamed yet is copied now and, when ``req`` has a stream, sent too, so its receiver
        always ends up with every layer. The stream ends here."""
        n = req.num_computed_tokens
        have = self._streamed.pop(req.req_id, {})
        send = self.kv_streams.pop(req.req_id, None)
        out = []
        for layer in range(self.num_layers):
            kv = have.get(layer)
            if kv is None or kv[0].shape[0] != n:
                kv = self.kv_cache.export_layer(req.req_id, layer, n)
                if send is not None:
                    send(layer, *kv)
            out.append(kv)
        return out

    def import_kv(self, req: Request, kv: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Allocate ``req``'s blocks layer by layer and write its K/V; a ``None`` entry is a layer
        already written here (streamed in). Raises OutOfBlocksError when the pool cannot hold it
        (then nothing of ``req`` is kept, streamed layers included)."""
        try:
            for layer, piece in enumerate(kv):
                if piece is not None:
                    self.kv_cache.import_layer(req.req_id, layer, *piece)
        except Exception:
            self.bm.free(req.req_id)
            raise
        self._kv_written[req.req_id] = [req.num_computed_tokens] * self.num_layers

    def release(self, req_id: str) -> None:
        self.sampler.release(req_id)
        self._kv_written.pop(req_id, None)
        self.kv_streams.pop(req_id, None)
        self._streamed.pop(req_id, None)

    # -- the walker's executor hooks (laser.core.walk.LayerExecutor) --------------------------------
    def park(self, active, leaving, layer):
        """Move ``leaving`` works' rows to the intermediate cache (paused at ``layer``). The rows
        kept are cut as few runs as they form (one slice, no copy, when they are consecutive)."""
        leave_ids = {id(w) for w in leaving}
        keep, runs = [], []
        hidden = self._hidden
        r = 0
        for w in active:
            a, r = r, r + w.num_tokens
            if id(w) in leave_ids:
                self._wrote(w, w.layer_start, layer)
                if layer < self.num_layers:
                    self.icache.put(w.req_id, hidden[a:r].clone(), w.num_tokens)
            else:
                keep.append(w)
                _extend_run(runs, hidden, a, r)
        self._hidden = _cat_runs(hidden, runs) if keep else None
        return keep

    def join(self, active, joining):
        """Add ``joining`` works (rows in :func:`_join_order`): the embedded ones are embedded in that
        order, so their rows, the kept rows and each restored work's rows make a few runs (one
        tensor, no copy, at a step's start)."""
        for w in joining:
            self._check_reads(w)
        order = _join_order(active, joining)
        new = {id(w) for w in joining}
        embed_works = [w for w in order if w.layer_start == 0 and id(w) in new]
        emb = None
        if embed_works:
            reqs, ids = self._requests, []
            for w in embed_works:
                ids.extend(reqs[w.req_id].token_ids(w.token_start, w.token_start + w.num_tokens))
            tokens = torch.from_numpy(np.array(ids, dtype=np.int64))
            t0 = time.perf_counter()
            emb = self.model.embed(tokens)  # row by row: the order of the ids is the order of the rows
            self._res.compute_seconds += time.perf_counter() - t0
            if len(embed_works) == len(order):
                self._hidden = emb  # a step's start: the embedded rows are the batch
                return order
        hidden, runs = self._hidden, []
        at = {id(w): a for w, (a, _) in zip(active, self._rows(active))}
        e = 0
        for w in order:
            n = w.num_tokens
            if id(w) not in new:
                a = at[id(w)]
                _extend_run(runs, hidden, a, a + n)
            elif w.layer_start == 0:
                _extend_run(runs, emb, e, e + n)
                e += n
            else:
                t = self.icache.pop(w.req_id)
                runs.append([t, 0, t.shape[0]])
        self._hidden = _cat_runs(None, runs)
        return order

    def prepare(self, compositions) -> None:
        """The walker's compositions of this step ahead of time (:func:`laser.core.walk.compositions`):
        build each one's attention metadata now, in one burst, where one build right after a layer
        call costs several times more (its Python and numpy code cache-cold: ~370 us against ~80 us
        warm for a few decode rows, AMD EPYC, 1 thread). The rows take the order :meth:`park` and
        :meth:`join` give them; :meth:`compose` uses a prepared one only for that very batch."""
        active: list[Work] = []
        planned = self._planned = {}
        for j, leaving, joining, layers in compositions:
            if leaving:
                gone = {id(w) for w in leaving}
                active = [w for w in active if id(w) not in gone]
            if joining:
                active = _join_order(active, joining)
            if active:
                planned[j] = (active, layers, self._build_metadata(active, layers))

    def compose(self, active, layers):
        got = self._planned.get(layers.start)
        if (got is not None and got[1] == layers and len(got[0]) == len(active)
                and all(a is b for a, b in zip(got[0], active))):
            self._meta = got[2]
        else:
            self._meta = self._build_metadata(active, layers)

    def run_layer(self, layer, active):
        """Layer ``layer`` of the prepared composition: a span of one layer (:meth:`run_span`)."""
        self.run_span(layer, layer + 1, active, None)

    def run_span(self, start, end, active, stop_at):
        """Layers ``start..end-1`` of one composition (the walker's span mode,
        :func:`laser.core.walk.walk`): ``stop_at(k)`` is asked before each layer ``k > start``
        (``stop_at`` None: never); returns ``end``, or the first ``k`` where it said True (layers
        ``start..k-1`` ran). Each layer's call, compute timing and K/V streaming, from one loop with
        its names bound once; the one owner of them (:meth:`run_layer` is a span of one layer)."""
        fwd, meta, streams, pc = self.model.forward_layer, self._meta, self.kv_streams, time.perf_counter
        h, spent, k = self._hidden, 0.0, start
        while True:
            t = pc()
            h = fwd(k, h, meta)
            spent += pc() - t
            if streams:
                self._stream_layer(k, active)
            k += 1
            if k == end or (stop_at is not None and stop_at(k)):
                break
        self._hidden = h
        res = self._res
        res.compute_seconds += spent
        res.num_layer_calls += k - start
        return k

    def _stream_layer(self, layer: int, active: list[Work]) -> None:
        """Layer ``layer`` of every active work is written: send it for each streamed request
        whose final prefill chunk this is (its KV at this layer is now complete)."""
        for w in active:
            send = self.kv_streams.get(w.req_id)
            if send is not None and w.context_len == self._requests[w.req_id].num_tokens:
                kv = self.kv_cache.export_layer(w.req_id, layer, w.context_len)
                self._streamed.setdefault(w.req_id, {})[layer] = kv
                send(layer, *kv)

    def finish(self, active, layer):
        t0 = time.perf_counter()
        self._finish(active, self._hidden, layer, self._requests, self._res, self._return_logits)
        self._res.compute_seconds += time.perf_counter() - t0

    # -- composition helpers -------------------------------------------------------------------
    def _rows(self, active: list[Work]) -> list[tuple[int, int]]:
        out, r = [], 0
        for w in active:
            out.append((r, r + w.num_tokens))
            r += w.num_tokens
        return out

    def _finish(self, active, hidden, layer, requests, res: StepResult, return_logits: bool) -> None:
        """Works at their last layer: park (layer < N) or sample from the last position."""
        if layer < self.num_layers:
            self.park(active, active, layer)
            return
        for w in active:
            self._wrote(w, w.layer_start, layer)
        rows = self._rows(active)
        for w, (a, b) in zip(active, rows):
            if requests[w.req_id].sampling_params.prompt_logprobs is not None:
                self._prompt_logprobs(w, hidden[a:b], requests[w.req_id], res)
        want = [(w, b - 1) for w, (a, b) in zip(active, rows) if w.sample or return_logits]
        if not want:
            return
        logits = self.model.compute_logits(hidden[torch.tensor([r for _, r in want])])
        reqs = [requests[w.req_id] for w, _ in want]
        if any(r.sampling_params.logprobs is not None for r in reqs):
            toks = self.sampler.sample(logits, reqs, res.logprobs)
        else:
            toks = self.sampler.sample(logits, reqs)
        for k, (w, _) in enumerate(want):
            if w.sample:
                res.sampled[w.req_id] = toks[k]
            if return_logits:
                res.logits[w.req_id] = logits[k]

    def _prompt_logprobs(self, w: Work, hidden: torch.Tensor, req: Request, res: StepResult) -> None:
        """Raw log-probabilities of the prompt tokens ``w``'s rows predict (``hidden``: its
        [num_tokens, H] rows at the last layer): row at position p gives token p + 1's, for
        p + 1 inside the prompt. Chunk by chunk, as each prefill chunk finishes the last layer
        (vLLM computes them the same way, per chunk); a decode row predicts none."""
        end = min(w.context_len, req.num_prompt_tokens - 1)
        n = end - w.token_start
        if n <= 0:
            return
        logits = self.model.compute_logits(hidden[:n])
        targets = torch.tensor(req.prompt_token_ids[w.token_start + 1:end + 1], dtype=torch.long)
        res.prompt_logprobs[w.req_id] = (w.token_start + 1, logprob_entries(logits, targets,
                                                                            req.sampling_params.prompt_logprobs))

    # -- attention metadata ----------------------------------------------------------------------
    def build_metadata(self, active: list[Work], layers: range) -> AttnMetadata:
        """Attention metadata for ``active`` (rows in this order: each work's ``num_tokens``
        rows, contiguous), valid for every layer in ``layers``: for callers that run layers
        themselves (self-speculative drafting, exit training). The works' KV blocks must be
        allocated. The result stays valid while the caller holds it (never derived in place)."""
        return self._build_metadata(active, layers, steady=not self._steady.in_place)

    #: Largest padded K (or V) gather of one decode group, bytes (see
    #: :data:`laser.latency.features.DEFAULT_MAX_GATHER_BYTES`).
    max_gather_bytes = DEFAULT_MAX_GATHER_BYTES

    def _split_decode(self, active: list[Work], dec: list[int]) -> list[list[int]]:
        """Split decode rows (sorted by context) into consecutive groups whose padded gather
        fits: the rule the latency model prices (:func:`laser.latency.features.decode_slices`)."""
        cfg = self.model.config
        limit = max_gather_positions(cfg.num_kv_heads, cfg.head_dim, self.kv_cache.kv.element_size(),
                                     self.max_gather_bytes)
        return [dec[a:b] for a, b in decode_slices([active[i].context_len for i in dec], limit)]

    def _build_metadata(self, active: list[Work], layers: range, steady: bool = True) -> AttnMetadata:
        """Metadata for ``active`` (rows in order) valid for every layer in ``layers``
        (:func:`laser.model.attn_metadata.build_attn_metadata`; with ``steady``, a steady decode
        batch's derived from the previous one's, :class:`laser.model.attn_steady.SteadyDecode`)."""
        m = self.model
        build = self._steady.build if steady else build_attn_metadata
        # a model whose prefill groups run the C++ prefill kernel never reads their masks
        return build(active, layers, self.bm, (m.rope_cos, m.rope_sin), m.dtype, self._group_size,
                     lambda dec: self._split_decode(active, dec), self._meta_memo,
                     prefill_masks=getattr(m, "prefill_kernel", None) is None)


def _extend_run(runs: list, src: torch.Tensor, a: int, b: int) -> None:
    """Append rows ``a:b`` of ``src`` to ``runs`` (``[tensor, start, end]`` each): grows the last run
    when it ends at ``a`` of the same tensor."""
    if runs and runs[-1][0] is src and runs[-1][2] == a:
        runs[-1][2] = b
    else:
        runs.append([src, a, b])


def _cat_runs(whole: torch.Tensor | None, runs: list) -> torch.Tensor:
    """The rows of ``runs`` (:func:`_extend_run`) in order [R, H]: ``whole`` itself when they are all
    of it, one slice (a view) when one run, else one ``torch.cat``."""
    if len(runs) == 1:
        t, a, b = runs[0]
        return t if t is whole and a == 0 and b == t.shape[0] else t[a:b]
    return torch.cat([t[a:b] for t, a, b in runs])


def _join_order(active: list[Work], joining) -> list[Work]:
    """Row order after ``joining`` joins ``active``: decode works first, by context length (so
    padded decode groups waste little), then prefill works; ties keep ``active``'s order, then the
    embedded joiners (``layer_start == 0``), then the restored ones, each in ``joining``'s order."""
    order = list(active)
    order.extend(w for w in joining if w.layer_start == 0)
    order.extend(w for w in joining if w.layer_start > 0)
    order.sort(key=lambda w: (w.num_tokens > 1, w.context_len if w.num_tokens == 1 else 0))
    return order
