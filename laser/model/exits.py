"""Trained early exits: small adapters that turn the residual stream after layer ``k`` into
a guess of the full model's next token, and a cheap reduced-vocabulary draft head.

An untrained exit (final norm + LM head applied after layer ``k``) agrees with SmolLM2-135M's
greedy token on 4-43 % of positions (k = 6..27), and its tied 49,152-row head costs as much
as ~4 layers. So each exit here is

* an adapter on the frozen model, a residual SwiGLU-free MLP (LayerSkip trains the whole model
  with an early-exit loss, Elhoushi et al. ACL'24 §3; Kangaroo, Liu et al. 2024, trains a small
  adapter on a frozen model instead -- what this does)::

      a = h + W2 silu(W1 rmsnorm(h; g1))           h [T, H], W1 [r, H], W2 [H, r]
      draft_logits = rmsnorm(a; g2) @ E_K.T        E_K [K, H]: rows of the LM head

  initialised at ``W2 = 0``, ``g2 =`` the final norm (exactly the untrained exit), and
* a reduced vocabulary ``vocab`` [K] (the tokens the model emits most on the training text)
  whose LM-head rows ``E_K`` score the draft: K = 4-8k of 49k rows costs ~1/8 of the head.
  The full head stays for verification, so a token outside ``vocab`` is only a rejected draft.

Training (:func:`train_exits`) distils the final layer's distribution restricted to ``vocab``
(KL(teacher || student), teacher = softmax of the full model's logits over ``vocab``) on the
model's own greedy continuations of prompts from the shipped datasets (ShareGPT, HumanEval):
the positions a self-speculative decoder drafts at. The result is saved beside the model cache,
keyed by the model (:func:`exits_path`).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

FORMAT_VERSION = 1


def model_key(model_dir: Path) -> str:
    """Cache key of a model: its directory name plus a hash of its config and weight file sizes
    (the embedded model's directory name already carries the GGUF's content hash)."""
    h = hashlib.sha256()
    for p in sorted(Path(model_dir).glob("*")):
        if p.name == "config.json":
            h.update(p.read_bytes())
        elif p.suffix == ".safetensors":
            h.update(f"{p.name}:{p.stat().st_size}".encode())
    return f"{Path(model_dir).name}-{h.hexdigest()[:10]}"


def exits_path(model_dir: Path) -> Path:
    """Where the exits of the model in ``model_dir`` are saved:
    ``$LASER_CACHE_DIR/exits/<model key>.pt`` (``~/.cache/laser`` by default)."""
    from .loader import cache_dir

    return cache_dir() / "exits" / f"{model_key(model_dir)}.pt"


@dataclass
class ExitHeads:
    """Exit adapters at a few depths plus the shared reduced draft vocabulary.

    ``adapters[k]`` holds float32 tensors ``g1`` [H], ``w1`` [r, H], ``w2`` [H, r], ``g2`` [H]
    for the exit after layer ``k`` (hidden state after ``k`` layers, ``1 <= k < N``).
    ``vocab`` [K] int64: draft vocabulary (token ids). ``report``: measurements made when
    trained (agreement per depth, recommended speculation settings).
    """

    depths: list[int]
    vocab: torch.Tensor
    adapters: dict[int, dict[str, torch.Tensor]]
    eps: float = 1e-5
    report: dict = field(default_factory=dict)
    # filled by bind(): E_K.T [H, K] in the model's dtype, and per-depth adapters in that dtype
    _head_t: torch.Tensor | None = field(default=None, repr=False)
    _bound: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict, repr=False)

    @classmethod
    def init(cls, model, depths: list[int], vocab: torch.Tensor, rank: int = 256, seed: int = 0) -> "ExitHeads":
        """Untrained exits (each equal to final norm + LM head restricted to ``vocab``).

        Raises ValueError for a depth outside ``1..N-1``."""
        N, H = model.config.num_layers, model.config.hidden_size
        bad = [k for k in depths if not 1 <= k < N]
        if bad:
            raise ValueError(f"exit depths must be in 1..{N - 1} (layers run before the exit), got {bad}")
        g = torch.Generator().manual_seed(seed)
        ad = {}
        for k in depths:
            ad[k] = {
                "g1": torch.ones(H),
                "w1": torch.randn(rank, H, generator=g) / math.sqrt(H),
                "w2": torch.zeros(H, rank),
                "g2": model.norm_w.float().clone(),
            }
        return cls(sorted(depths), vocab.long(), ad, eps=model.config.rms_norm_eps)

    # -- inference ---------------------------------------------------------------------------
    def bind(self, model) -> "ExitHeads":
        """Prepare for drafting on ``model`` (its dtype; E_K taken from its LM head). Returns self."""
        self._head_t = model.lm_head_w[self.vocab].t().contiguous()  # [H, K]
        self._bound = {k: {n: t.to(model.dtype).contiguous() for n, t in a.items()} for k, a in self.adapters.items()}
        self._bound_t = {k: (a["w1"].t().contiguous(), a["w2"].t().contiguous()) for k, a in self._bound.items()}
        return self

    def draft_logits(self, depth: int, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states after ``depth`` layers [R, H] -> draft logits [R, K] (the model's dtype).
        Raises KeyError for a depth without an exit. Needs :meth:`bind` first."""
        a = self._bound[depth]
        w1t, w2t = self._bound_t[depth]
        x = F.rms_norm(hidden, (hidden.shape[-1],), a["g1"], self.eps)
        h = hidden + torch.mm(F.silu(torch.mm(x, w1t)), w2t)
        return torch.mm(F.rms_norm(h, (h.shape[-1],), a["g2"], self.eps), self._head_t)

    def draft_tokens(self, depth: int, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states after ``depth`` layers [R, H] -> draft token ids [R] int64 (greedy)."""
        return self.vocab[self.draft_logits(depth, hidden).argmax(dim=-1)]

    def cost(self, model):
        """What these exits add to the price of a decode token that may exit on ``model``
        (:class:`laser.core.depth.ExitCost`, by weights read): a check reads the adapter
        (``2 x rank x H``) and the draft head (``K x H``) where the LM head reads ``V x H``; a
        skipped layer's K/V fill reads the K/V rows of its QKV weight of the layer's weights."""
        from ..core.depth import ExitCost
        from .linear import Linear

        cfg = model.config
        H = cfg.hidden_size
        L = model.layers[0]
        layer_params = sum(m.numel() for m in (L.qkv, L.o, L.gate_up, L.down))
        rank = next(iter(self.adapters.values()))["w1"].shape[0]
        return ExitCost(frozenset(self.depths),
                        head_fraction=(self.vocab.numel() * H + 2 * rank * H) / model.lm_head_w.numel(),
                        fill_fraction=(2 * cfg.kv_size * H if isinstance(L.qkv, Linear) and L.qkv.sliceable
                                       else L.qkv.numel())
                        / layer_params)

    # -- persistence --------------------------------------------------------------------------
    def save(self, path: Path, model_key: str) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({"version": FORMAT_VERSION, "model_key": model_key, "depths": self.depths, "vocab": self.vocab,
                    "adapters": self.adapters, "eps": self.eps, "report": self.report}, tmp)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path, model_key: str | None = None) -> "ExitHeads":
        """Load exits saved by :meth:`save`. Raises FileNotFoundError when missing and
        ValueError when the file is for another model (``model_key``) or format, or is not an
        exits file at all."""
        import pickle

        try:
            d = torch.load(Path(path), map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as e:
            if isinstance(e, FileNotFoundError):
                raise
            raise ValueError(f"{path} is not a trained exits file (made by `laser train-exits`): "
                             f"{type(e).__name__}") from None
        if not isinstance(d, dict) or d.get("version") != FORMAT_VERSION:
            d = d if isinstance(d, dict) else {}
            raise ValueError(f"{path}: exit heads of format {d.get('version')}, expected {FORMAT_VERSION} "
                             "(re-run `laser train-exits`)")
        if model_key is not None and d["model_key"] != model_key:
            raise ValueError(f"{path}: exit heads trained for {d['model_key']}, not {model_key}")
        return cls([int(k) for k in d["depths"]], d["vocab"], {int(k): v for k, v in d["adapters"].items()},
                   eps=d["eps"], report=d.get("report", {}))


# -- hidden states of whole sequences -------------------------------------------------------------
@torch.inference_mode()
def collect_hidden(runner, token_ids: list[int], depths: list[int]) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """Run one sequence through the model (a prefill on ``runner``'s KV pool, freed after) and
    return ({k: hidden after k layers [T, H] float32}, hidden after the last layer [T, H])."""
    from ..core.plan import Work

    model, bm = runner.model, runner.bm
    N, T = model.config.num_layers, len(token_ids)
    rid = f"__exit-train-{id(token_ids)}"
    bm.allocate(rid, T)
    try:
        w = Work(rid, 0, T, 0, N)
        meta = runner.build_metadata([w], range(N))
        h = model.embed(torch.tensor(token_ids, dtype=torch.long))
        out = {}
        want = set(depths)
        for i in range(N):
            h = model.forward_layer(i, h, meta)
            if i + 1 in want:
                out[i + 1] = h.float().clone()
        return out, h.float()
    finally:
        bm.free(rid)


# -- training --------------------------------------------------------------------------------------
def training_prompts(tokenizer, count: int, offset: int = 0, max_prompt_tokens: int = 128) -> list[list[int]]:
    """``count`` prompts as token ids, alternating ShareGPT first human turns (chat template applied)
    and HumanEval problems, from item ``offset`` on (held-out sets use another offset)."""
    from ..bench.workloads import load_humaneval, load_sharegpt

    chats, code = load_sharegpt(), load_humaneval()
    out = []
    i = offset
    while len(out) < count:
        if i % 2 == 0:
            text = chats[(i // 2) % len(chats)].prompt[:2000]
            if tokenizer.chat_template:
                ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                    tokenize=True)
                ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            else:
                ids = tokenizer.encode(text)
        else:
            ids = tokenizer.encode(code[(i // 2) % len(code)].prompt)
        out.append(ids[-max_prompt_tokens:])
        i += 1
    return out


def greedy_continuations(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt followed by the model's own greedy continuation (``max_tokens`` at most)."""
    from ..core.request import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    reqs = [engine.add_request(p, sp) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [list(r.prompt_token_ids) + list(r.output_token_ids) for r in reqs]


def draft_vocab(token_lists: list[list[int]], greedy: list[torch.Tensor], size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` tokens to draft from: ranked by how often the full model predicts them
    (greedy) plus how often they occur in the text; the rest filled with the lowest ids
    (BPE merge order: the commonest tokens first). Returns [min(size, V)] int64, sorted."""
    counts = torch.zeros(vocab_size)
    for g in greedy:
        counts.index_add_(0, g, torch.full((g.numel(),), 2.0))
    for t in token_lists:
        ids = torch.tensor(t, dtype=torch.long)
        counts.index_add_(0, ids, torch.ones(ids.numel()))
    size = min(size, vocab_size)
    # ties (count 0 in particular) broken by id: a tiny bias towards low ids
    score = counts - torch.arange(vocab_size, dtype=torch.float32) / (vocab_size * 10.0)
    return score.topk(size).indices.sort().values


@dataclass
class Corpus:
    """Hidden states of a set of sequences (P positions): ``hidden[k]`` [P, H] float32 after
    ``k`` layers, ``final`` [P, H] after the last layer (the teacher's logits over the draft
    vocabulary are computed from it per batch: [P, V] logits would not fit), ``greedy`` [P] the
    full model's greedy token, ``decode`` [P] bool: positions inside the generated continuation
    (what a decoder drafts at)."""

    hidden: dict[int, torch.Tensor]
    final: torch.Tensor
    greedy: torch.Tensor
    decode: torch.Tensor


def build_corpus(runner, seqs: list[list[int]], prompt_lens: list[int], depths: list[int],
                 progress: Callable[[int], None] | None = None) -> Corpus:
    hid: dict[int, list[torch.Tensor]] = {k: [] for k in depths}
    finals, greedy, dec = [], [], []
    for s, pl in zip(seqs, prompt_lens):
        hs, fin = collect_hidden(runner, s[:-1], depths)  # position t predicts token t + 1
        for k in depths:
            hid[k].append(hs[k])
        finals.append(fin)
        with torch.inference_mode():
            greedy.append(runner.model.compute_logits(fin.to(runner.model.dtype)).argmax(-1))
        d = torch.zeros(len(s) - 1, dtype=torch.bool)
        d[max(pl - 1, 0):] = True
        dec.append(d)
        if progress is not None:
            progress(len(s) - 1)
    return Corpus({k: torch.cat(v) for k, v in hid.items()}, torch.cat(finals), torch.cat(greedy), torch.cat(dec))


def _distill_loss(params: dict, h: torch.Tensor, teacher: torch.Tensor, head_K: torch.Tensor, eps: float):
    """KL(teacher || exit) over the draft vocabulary, mean over rows (h [B, H], teacher [B, K] log-probs)."""
    x = F.rms_norm(h, (h.shape[-1],), params["g1"], eps)
    y = h + F.silu(x @ params["w1"].t()) @ params["w2"].t()
    student = F.log_softmax(F.rms_norm(y, (y.shape[-1],), params["g2"], eps) @ head_K.t(), dim=-1)
    return F.kl_div(student, teacher, log_target=True, reduction="batchmean")


def _fit_one(heads: ExitHeads, k: int, head_K: torch.Tensor, final_norm: torch.Tensor, train: Corpus, epochs: int,
             batch: int, lr: float, seed: int, step: Callable[[], None]) -> tuple[float, float]:
    """Distil exit ``k`` (Adam on g1, w1, w2, g2; the model and E_K [K, H] frozen). Returns the
    distillation loss on (up to 2,048 of) the training positions before and after."""
    a = heads.adapters[k]
    params = {n: t.clone().requires_grad_(True) for n, t in a.items()}
    opt = torch.optim.Adam(params.values(), lr=lr)
    X = train.hidden[k]
    P = X.shape[0]
    g = torch.Generator().manual_seed(seed + k)
    eps = heads.eps

    def teacher(idx):
        with torch.no_grad():
            f = train.final[idx]
            return F.log_softmax(F.rms_norm(f, (f.shape[-1],), final_norm, eps) @ head_K.t(), dim=-1)

    probe = torch.arange(min(P, 2048))
    with torch.no_grad():
        before = _distill_loss(params, X[probe], teacher(probe), head_K, eps).item()
    for _ in range(epochs):
        perm = torch.randperm(P, generator=g)
        for s in range(0, P, batch):
            idx = perm[s : s + batch]
            loss = _distill_loss(params, X[idx], teacher(idx), head_K, eps)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step()
    heads.adapters[k] = {n: t.detach() for n, t in params.items()}
    with torch.no_grad():
        after = _distill_loss(heads.adapters[k], X[probe], teacher(probe), head_K, eps).item()
    return before, after


@torch.inference_mode()
def agreement(heads: ExitHeads, model, corpus: Corpus, trained: bool = True) -> dict[int, dict[str, float]]:
    """Per depth, on ``corpus``'s decode positions: ``draft`` the fraction where the exit's draft
    token equals the full model's greedy token; ``raw`` the same for the untrained exit (final
    norm + full LM head); ``coverage`` the fraction of greedy tokens inside the draft vocabulary;
    ``run_len`` the mean number of consecutive agreeing positions starting at a position (the
    expected accepted prefix of an unbounded draft)."""
    heads.bind(model)
    sel = corpus.decode
    greedy = corpus.greedy[sel]
    inv = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    inv[heads.vocab] = True
    out = {}
    for k in heads.depths:
        h = corpus.hidden[k][sel].to(model.dtype)
        ok = heads.draft_tokens(k, h) == greedy
        raw = model.compute_logits(h).argmax(-1) == greedy
        out[k] = {"draft": ok.float().mean().item(), "raw": raw.float().mean().item(),
                  "coverage": inv[greedy].float().mean().item(), "agree": ok}
    return out


def expected_speedup(match: torch.Tensor, k: int, gamma: int, num_layers: int, head_layers: float,
                     draft_head_layers: float) -> tuple[float, float]:
    """(mean tokens per self-speculative step, predicted speed-up over plain decoding) at batch
    1 for exit depth ``k`` and draft length ``gamma`` from a per-position agreement sequence
    ``match`` [P] bool (consecutive decode positions). Cost model, in single-token layer
    passes (decode is weight-bandwidth bound): a step runs ``gamma + 1`` passes over layers
    0..k-1, ``gamma`` draft heads, one pass over layers k..N-1 and one full head for the
    ``gamma + 1`` verify rows; plain decoding costs ``N + head`` per token.
    (Leviathan et al. ICML'23 §3.3 give the closed form for i.i.d. acceptance; this counts the
    measured runs instead.)"""
    m = match.tolist()
    P = len(m)
    toks = []
    for p in range(P - gamma):
        a = 0
        while a < gamma and m[p + a]:
            a += 1
        toks.append(a + 1)
    if not toks:
        return 1.0, 0.0
    mean = sum(toks) / len(toks)
    step = (gamma + 1) * k + gamma * draft_head_layers + (num_layers - k) + head_layers
    return mean, mean * (num_layers + head_layers) / step


def train_exits(engine, depths: list[int] | None = None, num_prompts: int = 24, gen_tokens: int = 96,
                vocab_size: int = 4096, rank: int = 256, epochs: int = 12, batch: int = 256, lr: float = 2e-3,
                eval_prompts: int = 8, seed: int = 0, progress: bool = True,
                prompts: tuple[list[list[int]], list[list[int]]] | None = None) -> ExitHeads:
    """Train exits for ``engine``'s model (an :class:`laser.frontend.engine.Engine` in float32 is best)
    at ``depths`` (default every 5th layer). Generates greedy continuations of ``num_prompts``
    dataset prompts (``gen_tokens`` each), distils each exit for ``epochs`` passes, then
    measures agreement on ``eval_prompts`` held-out prompts. Returns the trained, bound exits
    with ``report`` filled (per depth: agreement, coverage; the recommended depth and draft
    length for self-speculation). ``prompts``: (training, held-out) prompts as token ids instead
    of the dataset ones."""
    from tqdm import tqdm

    model, runner = engine.model, engine.runner
    N = model.config.num_layers
    depths = sorted(depths or [k for k in range(5, N, 5)])
    t0 = time.perf_counter()
    if prompts is None:
        ps = training_prompts(engine.tokenizer, num_prompts + eval_prompts)
        prompts = ps[:num_prompts], ps[num_prompts:]
    train_p, eval_p = prompts
    bar = tqdm(total=2, desc="greedy continuations", unit="set", disable=not progress)
    train_s = greedy_continuations(engine, train_p, gen_tokens)
    bar.update(1)
    eval_s = greedy_continuations(engine, eval_p, gen_tokens)
    bar.update(1)
    bar.close()
    n_tok = sum(len(s) - 1 for s in train_s + eval_s)
    bar = tqdm(total=n_tok, desc="hidden states", unit="tok", disable=not progress)
    train = build_corpus(runner, train_s, [len(p) for p in train_p], depths, bar.update)
    held = build_corpus(runner, eval_s, [len(p) for p in eval_p], depths, bar.update)
    bar.close()
    vocab = draft_vocab(train_s, [train.greedy], vocab_size, model.config.vocab_size)
    heads = ExitHeads.init(model, depths, vocab, rank=rank, seed=seed)
    head_K = model.lm_head_w[vocab].float()
    P = train.final.shape[0]
    steps = len(depths) * epochs * -(-P // batch)
    bar = tqdm(total=steps, desc="distilling exits", unit="step", disable=not progress)
    losses = {k: _fit_one(heads, k, head_K, model.norm_w.float(), train, epochs, batch, lr, seed,
                          lambda: bar.update(1)) for k in depths}
    bar.close()
    res = agreement(heads, model, held)
    H = model.config.hidden_size
    layer_params = sum(t.numel() for t in (model.layers[0].qkv, model.layers[0].o, model.layers[0].gate_up,
                                            model.layers[0].down))
    head_layers = model.lm_head_w.numel() / layer_params
    draft_head_layers = (vocab.numel() * H + 2 * rank * H) / layer_params
    per_depth, best = {}, (0.0, None, None)
    for k, r in res.items():
        spd = {}
        for gamma in range(1, 7):
            mean, s = expected_speedup(r["agree"], k, gamma, N, head_layers, draft_head_layers)
            spd[gamma] = {"tokens_per_step": round(mean, 3), "predicted_speedup": round(s, 3)}
            if s > best[0]:
                best = (s, k, gamma)
        per_depth[k] = {"draft_agreement": round(r["draft"], 4), "untrained_agreement": round(r["raw"], 4),
                        "vocab_coverage": round(r["coverage"], 4), "speculation": spd,
                        "untrained_loss": round(losses[k][0], 4), "distill_loss": round(losses[k][1], 4)}
    heads.report = {
        "depths": per_depth, "train_tokens": P, "eval_tokens": int(held.decode.sum()), "vocab_size": int(vocab.numel()),
        "rank": rank, "epochs": epochs, "recommended": {"exit_layer": best[1], "draft_tokens": best[2],
                                                        "predicted_speedup": round(best[0], 3)},
        "head_cost_layers": round(head_layers, 2), "draft_head_cost_layers": round(draft_head_layers, 2),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return heads.bind(model)


def format_report(report: dict) -> str:
    """A human-readable table of :attr:`ExitHeads.report`."""
    lines = [f"trained on {report['train_tokens']} tokens, measured on {report['eval_tokens']} held-out decode "
             f"positions; draft vocabulary {report['vocab_size']} tokens (head cost ~{report['draft_head_cost_layers']}"
             f" layers vs {report['head_cost_layers']} for the full head); {report['seconds']} s",
             f"{'exit':>4} {'untrained':>9} {'trained':>8} {'vocab cov':>9}  best draft length (tokens/step, predicted x)"]
    for k, r in sorted(report["depths"].items(), key=lambda kv: int(kv[0])):
        g, s = max(r["speculation"].items(), key=lambda kv: kv[1]["predicted_speedup"])
        lines.append(f"{int(k):>4} {r['untrained_agreement']:>9.1%} {r['draft_agreement']:>8.1%} "
                     f"{r['vocab_coverage']:>9.1%}  {g} ({s['tokens_per_step']:.2f}, {s['predicted_speedup']:.2f}x)")
    rec = report["recommended"]
    lines.append(f"recommended: --speculative-exit-layer {rec['exit_layer']} --speculative-draft-tokens "
                 f"{rec['draft_tokens']} (predicted {rec['predicted_speedup']:.2f}x at batch 1)")
    return "\n".join(lines)


def report_json(report: dict) -> str:
    return json.dumps(report, indent=1, sort_keys=True)
