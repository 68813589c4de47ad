"""Lossless self-speculative decoding: draft with the first ``k`` layers and a trained exit head,
verify with layers ``k..N-1`` in one pass, reusing the draft's KV and hidden states.

The scheme is LayerSkip's (Elhoushi et al., ACL'24 §4: self-speculative decoding with KV-cache
and exit-query reuse). For a decoding request with tokens ``t_0..t_{n-1}`` (KV of positions
``0..n-2`` computed, ``t_{n-1}`` pending) and draft length ``g``:

1. **Draft**: ``g + 1`` passes over layers ``0..k-1``, feeding ``t_{n-1}, d_1, .., d_g`` at
   positions ``n-1 .. n-1+g``; after each of the first ``g`` the exit head
   (:class:`laser.model.exits.ExitHeads`) guesses the next token ``d_i``. These passes write
   layers ``0..k-1``'s KV of those positions and keep each position's hidden state at layer k.
2. **Verify**: the ``g + 1`` hidden states run layers ``k..N-1`` as one ``g + 1``-token chunk
   (writing those layers' KV) and the full LM head gives the full model's greedy tokens
   ``v_1..v_{g+1}``. Accepted: the longest prefix with ``d_i == v_i`` (``a`` tokens); the request
   gets ``v_1..v_{a+1}`` (``v_{a+1}`` is the correction, or the bonus token when all ``g``
   matched: the last draft pass fed ``d_g`` exactly so that it can be verified).

A **sampled** request drafts ``d_i ~ q_i`` instead, ``q_i`` the exit head's distribution mapped
from the draft vocabulary onto the full one (other tokens at probability 0) after the request's
own sampling transforms (:meth:`laser.model.sampler.Sampler.sampling_probs`: bias, min_tokens,
penalties counting the drafts before ``i``, temperature, min-p, top-k, top-p); verification
computes the full model's ``p_0..p_g`` the same way and keeps tokens by the speculative-sampling
rejection rule (:func:`laser.spec.rejection.rejection_sample`), so each emitted token is
distributed exactly as plain sampling's. A seeded request draws position ``j``'s (its ``j``-th
generated token's) draft, uniform and residual or bonus token from a generator seeded with
``draw_seed(seed, j)``: its output depends on its seed, its draft lengths and the logits only, not
on what it is batched with (a draft shortened for want of KV blocks, or a step decoded plainly,
draws differently: reproducible on the same setup and load, as vLLM's seeded speculation).

Every emitted token is the full model's argmax given the tokens before it, so greedy output
equals plain decoding (fp32; the same tolerance as chunked prefill vs. decode). Rejected
positions' KV lies beyond the request's context: never attended to, overwritten by the next
step's writes (from position ``n+a`` on); blocks grown only for rejected drafts are released
after the verify pass (:meth:`laser.core.block_manager.BlockManager.trim`). Drafts only take blocks
that are free: when the pool is short the draft is shortened, down to plain decoding.

Integration: :class:`SelfSpeculator` is the instance's executor. It takes a scheduler's plan,
runs every *eligible* work speculatively -- a decode token through all layers of a greedy
or sampled request (:func:`laser.core.speculation.speculates`) -- and the rest of the plan as usual
(:func:`laser.core.walk.walk`). Requests asking for logprobs or structured output, and greedy
requests with logit processing, decode normally. Under the ``laser`` policy a request Alg. 1
keeps at full depth speculates (its plan and Alg. 1 price the draft passes and the verify chunk:
:mod:`laser.core.speculation`); one it relaxed to layer groups decodes them plainly, and
prefill chunks paused at a layer boundary resume as without speculation.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..core.config import ConfigError
from ..core.plan import StepPlan, StepResult, Work
from ..core.speculation import SpecShape
from .rejection import rejection_sample

log = logging.getLogger(__name__)

#: Scheduling policies whose plans self-speculation runs: every decode work of vllm's and sarathi's
#: spans all layers; laser's full-depth ones do (its reduced plans' layer groups decode plainly) and
#: it prices them at their speculative cost (laser.core.speculation).
SUPPORTED_POLICIES = ("vllm", "sarathi", "laser")


@dataclass(frozen=True)
class SpeculativeConfig:
    """``--speculative self`` options. ``exit_layer`` / ``draft_tokens`` None: the values
    recommended when the exits were trained (measured acceptance); ``exits_path`` None: the
    model's exits in the cache (:func:`laser.model.exits.exits_path`)."""

    method: str = "self"
    exit_layer: int | None = None
    draft_tokens: int | None = None
    exits_path: str | None = None


@dataclass
class SpecStats:
    """Cumulative counts of speculative steps (per request-step)."""

    steps: int = 0  # request-steps run speculatively
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    emitted: int = 0  # tokens produced (accepted + one correction/bonus per step)
    fallbacks: int = 0  # eligible decode works run normally (no free block for the draft)
    sampled_steps: int = 0  # of ``steps``, those of sampled (non-greedy) requests

    @property
    def acceptance(self) -> float:
        """Fraction of draft tokens accepted."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0


class SelfSpeculator:
    """An instance executor that decodes greedy requests self-speculatively (see the module doc).

    Args:
        runner: the instance's :class:`laser.model.runner.ModelRunner` (every other executor
            call is passed to it).
        heads: trained exits with an exit at ``exit_layer`` (bound here to the runner's model).
        exit_layer: ``k``, layers run before the exit (1..N-1).
        draft_tokens: ``g``, tokens drafted per step (>= 1).
        max_model_len: the instance's context limit (drafts never write past it).
    Raises:
        ConfigError: no exit at ``exit_layer`` or ``draft_tokens < 1``.
    """

    def __init__(self, runner, heads, exit_layer: int, draft_tokens: int, max_model_len: int):
        if exit_layer not in heads.adapters:
            raise ConfigError(f"no trained exit after layer {exit_layer}; the exits have {heads.depths} "
                              "(laser train-exits --depths ...)")
        if draft_tokens < 1:
            raise ConfigError(f"speculative draft length must be >= 1, got {draft_tokens}")
        self.runner = runner
        self.heads = heads.bind(runner.model)
        self.shape = SpecShape(exit_layer, draft_tokens, max_model_len)  # what the schedulers price too
        self.stats = SpecStats()

    @property
    def k(self) -> int:
        """Layers run before the exit (``shape.exit_layer``)."""
        return self.shape.exit_layer

    def __getattr__(self, name):  # export_kv, import_kv, release, sampler state, kv_streams, ...
        return getattr(self.runner, name)

    # -- the executor interface --------------------------------------------------------------------
    def execute(self, plan: StepPlan, requests: dict, stop_at=None, return_logits: bool = False) -> StepResult:
        """Run ``plan``: eligible decode works self-speculatively, the rest through the runner.
        The result's ``extra_tokens`` holds the tokens after the first of each speculated work."""
        N = self.runner.num_layers
        spec: list[tuple[Work, int]] = []
        rest: list[Work] = []
        for w in plan.works:
            g = 0 if return_logits else self._draft_len(w, requests[w.req_id], N)
            (spec.append((w, g)) if g else rest.append(w))
        if not spec:
            return self.runner.execute(plan, requests, stop_at, return_logits)
        if rest:
            res = self.runner.execute(StepPlan(plan.num_layers, rest), requests, stop_at, return_logits)
        else:
            res = StepResult(stopped_layer=plan.last_layer)
        self._speculate(spec, requests, res)
        return res

    def _draft_len(self, w: Work, req, N: int) -> int:
        """Draft length for work ``w`` (0: run it normally), its blocks grown for the drafts."""
        g = g_max = self.shape.work_draft_len(w, req, N)
        if not g:
            return 0
        n = req.num_tokens
        bm = self.runner.bm
        while g > 0 and not bm.can_allocate(req.req_id, n + g):
            g -= 1
        if g <= 0:
            self.stats.fallbacks += g_max > 0
            return 0
        bm.allocate(req.req_id, n + g)
        return g

    @torch.inference_mode()
    def _speculate(self, spec: list[tuple[Work, int]], requests: dict, res: StepResult) -> None:
        t0 = time.perf_counter()
        runner, model, k = self.runner, self.runner.model, self.k
        N = runner.num_layers
        spec.sort(key=lambda e: e[0].context_len)  # decode rows ordered by context (padded groups)
        ws = [w for w, _ in spec]
        gs = [g for _, g in spec]
        R = len(ws)
        reqs = [requests[w.req_id] for w in ws]
        feed = [req.all_token_ids[w.token_start] for req, w in zip(reqs, ws)]
        drafts: list[list[int]] = [[] for _ in range(R)]
        rows: list[list[torch.Tensor]] = [[] for _ in range(R)]
        # sampled requests: each drafted position's q [V] and generator (module doc)
        sampled = [not req.sampling_params.greedy for req in reqs]
        qs: list[list[torch.Tensor]] = [[] for _ in range(R)]
        gens: list[list[torch.Generator]] = [[] for _ in range(R)]
        layer_calls = 0
        for i in range(max(gs) + 1):  # pass i feeds position token_start + i
            act = [r for r in range(R) if i <= gs[r]]
            works = [Work(ws[r].req_id, ws[r].token_start + i, 1, 0, k) for r in act]
            h = model.embed(torch.tensor([feed[r] for r in act], dtype=torch.long))
            meta = runner.build_metadata(works, range(k))
            for layer in range(k):
                h = model.forward_layer(layer, h, meta)
            layer_calls += k
            for j, r in enumerate(act):
                rows[r].append(h[j])
            head = [j for j, r in enumerate(act) if i < gs[r]]
            if head:
                lg = self.heads.draft_logits(k, h[head] if len(head) < len(act) else h)
                toks = self.heads.vocab[lg.argmax(dim=-1)].tolist()
                for n, (j, t) in enumerate(zip(head, toks)):
                    r = act[j]
                    if sampled[r]:
                        t = self._draw_draft(reqs[r], lg[n], drafts[r], qs[r], gens[r])
                        if t is None:  # the transforms left no draft token: verify what was drafted
                            gs[r] = i
                            continue
                    drafts[r].append(t)
                    feed[r] = t
        # verify: g + 1 positions per request, layers k..N-1, one chunk each
        works = [Work(w.req_id, w.token_start, g + 1, k, N) for w, g in zip(ws, gs)]
        hv = torch.stack([x for r in range(R) for x in rows[r]])
        meta = runner.build_metadata(works, range(k, N))
        for layer in range(k, N):
            hv = model.forward_layer(layer, hv, meta)
        layer_calls += N - k
        logits = model.compute_logits(hv)
        verified = logits.argmax(dim=-1).tolist()
        st = self.stats
        off = 0
        for r, w in enumerate(ws):
            g = gs[r]
            if sampled[r]:
                v = self._verify_sampled(reqs[r], logits[off : off + g + 1], drafts[r], qs[r], gens[r])
                a = len(v) - 1
                st.sampled_steps += 1
            else:
                v = verified[off : off + g + 1]
                a = 0
                while a < g and drafts[r][a] == v[a]:
                    a += 1
            off += g + 1
            res.sampled[w.req_id] = v[0]
            if a:
                res.extra_tokens[w.req_id] = v[1 : a + 1]
            # the blocks grown for rejected drafts go back (the request now has n + a + 1 tokens)
            runner.bm.trim(w.req_id, w.token_start + a + 2)
            runner.mark_kv_written(w.req_id, range(N), w.token_start + a + 1)
            st.steps += 1
            st.drafted += g
            st.accepted += a
            st.emitted += a + 1
        res.compute_seconds += time.perf_counter() - t0
        res.num_layer_calls += layer_calls

    def _draw_draft(self, req, draft_logits: torch.Tensor, drafted: list[int], qs: list, gens: list) -> int | None:
        """Draw a sampled request's next draft token from ``q``: ``draft_logits`` [K] (the exit
        head's, over its draft vocabulary) scattered onto the full vocabulary (-inf elsewhere) and
        put through the request's sampling transforms with ``drafted`` taken as generated. Appends
        ``q`` [V] float32 and the position's generator to ``qs`` / ``gens``. None (nothing
        appended) when no token is left."""
        sampler = self.runner.sampler
        row = torch.full((self.runner.model.lm_head_w.shape[0],), float("-inf"))
        row[self.heads.vocab] = draft_logits.float()
        q = sampler.sampling_probs(row, req, drafted)
        if not bool(torch.isfinite(q).all()):
            return None
        gen = sampler.generator_at(req, req.num_output_tokens + len(drafted))
        qs.append(q)
        gens.append(gen)
        return int(torch.multinomial(q, 1, generator=gen))

    def _verify_sampled(self, req, logits: torch.Tensor, drafted: list[int], qs: list, gens: list) -> list[int]:
        """The tokens a sampled request keeps: ``logits`` [g + 1, V] (the full model's at the
        drafted positions) -> the target distributions, then the rejection rule."""
        sampler = self.runner.sampler
        g = len(drafted)
        p = torch.stack([sampler.sampling_probs(logits[i], req, drafted[:i]) for i in range(g + 1)])
        q = torch.stack(qs) if g else p.new_zeros((0, p.shape[1]))
        bonus = sampler.generator_at(req, req.num_output_tokens + g)
        return rejection_sample(torch.tensor(drafted, dtype=torch.long), q, p, [*gens, bonus])


def check_policy(policy: str) -> None:
    """Raise ConfigError when ``policy`` cannot run self-speculation."""
    if policy not in SUPPORTED_POLICIES:
        raise ConfigError(f"--speculative self runs with --policy {', '.join(SUPPORTED_POLICIES)}, not {policy!r}")


def load_exits(model_dir: Path, path: str | None = None):
    """The trained exits of the model in ``model_dir`` (``path``: a file of its own).
    Raises ConfigError when none were trained (naming the command that trains them)."""
    from ..model.exits import ExitHeads, exits_path, model_key

    p = Path(path) if path else exits_path(model_dir)
    try:
        return ExitHeads.load(p, model_key(model_dir) if path is None else None)
    except FileNotFoundError:
        raise ConfigError(f"no trained exits at {p}: run `laser train-exits` first") from None
    except ValueError as e:
        raise ConfigError(str(e)) from None


def enable_self_speculation(instance, config: SpeculativeConfig, heads=None) -> SelfSpeculator:
    """Make ``instance`` (a :class:`laser.instance.model_instance.ModelInstance`) decode greedy
    requests self-speculatively (its core's executor and ``instance.speculator`` become the
    returned :class:`SelfSpeculator`). ``heads``: exits to use (default: :func:`load_exits`).
    Raises ConfigError: unknown method, unsupported policy or role, no exits."""
    if config.method != "self":
        raise ConfigError(f"unknown speculative method {config.method!r}; the one implemented is 'self'")
    check_policy(instance.scheduler_config.policy)
    if instance.scheduler_config.role == "prefill":
        raise ConfigError("--speculative self is for instances that decode (role mixed or decode), not prefill")
    heads = heads if heads is not None else load_exits(instance.model_path, config.exits_path)
    rec = heads.report.get("recommended", {})
    k = config.exit_layer or rec.get("exit_layer") or heads.depths[len(heads.depths) // 2]
    g = config.draft_tokens or rec.get("draft_tokens") or 3
    spec = SelfSpeculator(instance.runner, heads, int(k), int(g), instance.max_model_len)
    instance.core.executor = instance.speculator = spec
    instance.core.scheduler.set_speculation(spec.shape)
    log.info("self-speculative decoding: exit after layer %d, %d draft tokens", k, g)
    return spec
