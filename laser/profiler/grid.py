"""What the profiler samples: the grid of token counts and batches (:class:`ProfileGrid`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def fit_to_pool(query_lens, context_lens, pool_tokens: int, block_size: int = 16):
    """The batch, shrunk (contexts proportionally, then query lengths) so that its KV blocks
    fit in one layer's pool of ``pool_tokens`` slots; unchanged when it fits."""
    q, c = [int(x) for x in query_lens], [int(x) for x in context_lens]
    cap = max(1, pool_tokens // block_size)  # blocks per layer
    if len(c) > cap:
        q, c = q[:cap], c[:cap]

    def blocks():
        return sum(-(-ci // block_size) for ci in c)

    while blocks() > cap:
        f = 0.98 * (cap - len(c)) * block_size / max(1, sum(c))
        c = [max(1, int(ci * f)) for ci in c]
        q = [max(1, min(qi, ci)) for qi, ci in zip(q, c)]
    return tuple(q), tuple(c)


@dataclass
class ProfileGrid:
    """What the profiler samples. Batches are ``(query_lens, context_lens)`` tuples."""

    stateless_tokens: list[int]
    attention_batches: list[tuple[tuple[int, ...], tuple[int, ...]]]
    layer_batches: list[tuple[tuple[int, ...], tuple[int, ...]]]
    embed_tokens: list[int]
    head_rows: list[int]
    min_rounds: int = 3
    max_rounds: int = 10
    tol: float = 0.03
    warmup_s: float = 1.0  # spin-up before timing
    # timings every sample gets whatever the budget (timing.Bench's min_repeats; at most max_rounds)
    min_repeats: int = 2
    # Whole steps whose overhead beyond layers, embedding and head is measured (StepOverheadSample):
    # each a list of works (num_tokens, context_len, first layer, end layer) with the layers as
    # fractions of the model's depth (0.0 .. 1.0; see step_works).
    step_shapes: list = field(default_factory=list)

    @classmethod
    def default(cls, max_tokens: int = 2048, max_context: int = 4096, pool_tokens: int = 1 << 30,
                max_batch: int = 64, block_size: int = 16, seed: int = 0) -> "ProfileGrid":
        """A grid that takes well under a minute for SmolLM2-size models on two CPU cores.

        ``max_tokens``: largest chunk; ``max_context``: longest sequence; ``pool_tokens``:
        KV slots per layer (Σc of a batch stays within it); ``max_batch``: decode batch.
        """
        rng = np.random.default_rng(seed)
        st = _stateless_counts(rng, max_tokens)
        pts = _Points(rng, max(1, min(max_context, pool_tokens)), pool_tokens, block_size)
        small = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # small decode batches at short contexts (16-512)
        attn = _attention_batches(pts, small, max_tokens, max_batch)
        layer = _layer_batches(pts, small, max_tokens, max_batch)
        # LM-head rows: enough counts for the fit's cross-validation past its small-count lookup
        head = [r for r in (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 128)
                if r <= max(max_batch, 1) * 2]
        embed = sorted({n for n in (1, 8, 64, 256, 1024, max_tokens) if n <= max_tokens})
        steps = _step_shapes(_Points(np.random.default_rng(seed + 1), max(1, min(512, max_context, pool_tokens)),
                                     pool_tokens, block_size), max_tokens, max_batch)
        steps += _decode_step_shapes(_Points(np.random.default_rng(seed + 2), max(1, min(max_context, pool_tokens)),
                                             pool_tokens, block_size), max_batch)
        steps += _prefill_step_shapes(_Points(np.random.default_rng(seed + 3), max(1, min(max_context, pool_tokens)),
                                              pool_tokens, block_size), max_tokens, max_batch)
        return cls(sorted(st), attn, layer, embed, head, step_shapes=steps)

    @classmethod
    def tiny(cls, seed: int = 0, rounds: tuple[int, int] = (2, 3)) -> "ProfileGrid":
        """A small grid (seconds on a small model): for tests and ``laser profile --quick``."""
        rng = np.random.default_rng(seed)
        st = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
        attn = []
        for b in (1, 4, 16):
            for mc in (32, 256):
                c = tuple(int(x) for x in rng.integers(2, 2 * mc, b))
                attn.append(((1,) * b, c))
        for q in (16, 64, 256):
            for cached in (0, q):
                attn.append(((q,), (q + cached,)))
        attn.append(((1, 1, 32), (40, 90, 64)))
        attn.append(((1, 24, 48), (100, 24, 96)))
        steps = _step_shapes(_Points(rng, 256, 1 << 30, 16), 64, 8)
        return cls(st, attn, attn[::3], [1, 16, 128], [1, 4, 16], min_rounds=rounds[0], max_rounds=rounds[1],
                   tol=0.05, warmup_s=0.2, step_shapes=steps)

    def add_kernel_edges(self, edges: dict) -> None:
        """Sample the stateless modules and the LM head on both sides of each row count where
        their kernels switch (``edges``: :func:`laser.profiler.pipeline.kernel_rows_of`): ``k - 1``,
        ``k``, ``k + 1`` and ``k + 8``, within the grid's range."""
        for name, attr in (("stateless", "stateless_tokens"), ("head", "head_rows")):
            pts = getattr(self, attr)
            top = max(pts, default=0)
            extra = {n for k in edges.get(name, ()) for n in (k - 1, k, k + 1, k + 8) if 1 <= n <= top}
            setattr(self, attr, sorted(set(pts) | extra))

    def num_cases(self) -> int:
        return (len(self.stateless_tokens) + len(self.attention_batches) + len(self.layer_batches)
                + len(self.embed_tokens) + len(self.head_rows) + len(self.step_shapes))


def step_works(shape, num_layers: int) -> list[tuple[int, int, int, int]]:
    """A :attr:`ProfileGrid.step_shapes` entry for a model of ``num_layers`` layers: works
    ``(num_tokens, context_len, layer_start, layer_end)``, each layer fraction rounded to a layer
    and every work at least one layer long."""
    out = []
    for q, c, a, b in shape:
        la = min(num_layers - 1, max(0, round(a * num_layers)))
        lb = min(num_layers, max(la + 1, round(b * num_layers)))
        out.append((q, c, la, lb))
    return out


# -- the grid's parts, drawn in this order from one generator (ProfileGrid.default) ----------------


class _Points:
    """Random decode batches for the grid (``rng`` shared, in draw order), clipped to the KV pool."""

    def __init__(self, rng, ctx_cap: int, pool_tokens: int, block_size: int):
        self.rng, self.ctx_cap, self.pool_tokens, self.block_size = rng, ctx_cap, pool_tokens, block_size

    def clip_batch(self, q, c):
        return fit_to_pool(q, c, self.pool_tokens, self.block_size)

    def decode(self, b, mean_ctx):
        c = self.rng.integers(max(2, mean_ctx // 4), max(3, mean_ctx * 7 // 4), b)
        return self.clip_batch([1] * b, [min(int(x), self.ctx_cap) for x in c])

    def skewed(self, b, frac):
        """A decode batch of ``b`` with ``frac`` of its contexts long, the rest short."""
        rng, ctx_cap = self.rng, self.ctx_cap
        nlong = max(1, round(frac * b))
        long = rng.integers(max(2, ctx_cap // 4), ctx_cap + 1, nlong)
        short = rng.integers(2, max(3, min(512, ctx_cap)), b - nlong)
        return self.clip_batch([1] * b, [int(x) for x in (*long, *short)])


def _stateless_counts(rng, max_tokens: int):
    """Token counts of the stateless-module grid (drawn first from ``rng``)."""
    # Stateless: dense for small n (decode batches), log-spaced up to max_tokens, plus
    # a few random counts so tile effects are seen off the round numbers.
    base = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256,
            320, 384, 512, 640, 768, 1024, 1280, 1536, 2048]
    st = {n for n in base if n <= max_tokens}
    # Every decode batch up to 16 and every 4 up to 32 (small decode batches are the
    # common iteration), and the paper's 32-token segment boundaries (Sec. 4: the
    # stateless modules are fitted per 32-token segment, where GEMM kernels change
    # tiles): every multiple of 32 up to 1024, of 128 beyond.
    st |= {n for n in (*range(1, 17), *range(20, 33, 4)) if n <= max_tokens}
    st |= {n for n in range(32, min(max_tokens, 1024) + 1, 32)}
    st |= {n for n in range(1024, max_tokens + 1, 128)}
    # (many points: the fit's cross-validation needs them to resolve kernel steps)
    st |= {int(x) for x in rng.integers(2, max(3, min(max_tokens, 64)), 8)}
    st |= {int(x) for x in rng.integers(64, max(65, min(max_tokens, 640)), 16)}
    st |= {int(x) for x in rng.integers(640, max(641, max_tokens), 4)}
    st.add(max_tokens)
    return st


#: Causal chunk lengths sampled besides the powers of two (see _attention_batches).
CAUSAL_GRID = (96, 160, 191, 192, 224, 320, 384, 448, 576, 640, 704, 767, 768, 832, 896, 1280, 1536, 1792)


def _attention_batches(pts: _Points, small: tuple, max_tokens: int, max_batch: int):
    """Attention batches (query lens, context lens) of the grid."""
    rng, ctx_cap, clip_batch, decode = pts.rng, pts.ctx_cap, pts.clip_batch, pts.decode
    attn = []
    for b in small:
        if b <= max_batch:
            for mc in (32, 256):
                attn.append(decode(b, min(mc, ctx_cap)))
    for b in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128):
        if b > max_batch:
            continue
        for mc in (64, 512, 2048):
            attn.append(decode(b, min(mc, ctx_cap)))
    # skewed: a few long contexts among short ones (the runner pads a decode group to its
    # longest context, so B · C_max and Σc part only on such batches: without them the fit
    # cannot tell the padded gather from the paper's β·Σc)
    for b, frac in ((2, 0.5), (3, 0.3), (4, 0.25), (6, 0.3), (8, 0.1), (8, 0.3), (12, 0.3), (16, 0.06),
                    (16, 0.3), (24, 0.3), (32, 0.06), (32, 0.3), (48, 0.3), (64, 0.06), (64, 0.3)):
        if b > max_batch:
            continue
        attn.append(pts.skewed(b, frac))
    for q in (16, 32, 64, 128, 256, 512, 1024, 2048):
        q = min(q, max_tokens)
        for cached in (0, q // 2, 2 * q):
            c = min(q + cached, ctx_cap)
            attn.append(clip_batch([min(q, c)], [c]))
    # causal chunks (no cached context) on both sides of where the flash kernel's query block
    # grows (latency.features.CAUSAL_Q_TILES: 192, 768) and between: the price per score falls
    # with the block, which the powers of two above do not resolve
    for q in CAUSAL_GRID:
        if q <= min(max_tokens, ctx_cap):
            attn.append(clip_batch([q], [q]))
    for _ in range(10):  # several prefill chunks in one batch
        k = int(rng.integers(2, 5))
        q = [int(x) for x in rng.integers(16, max(17, max_tokens // k), k)]
        c = [min(qi + int(rng.integers(0, 2 * qi)), ctx_cap) for qi in q]
        attn.append(clip_batch([min(a, b) for a, b in zip(q, c)], c))
    for _ in range(14):  # mixed: decode batch + prefill chunk(s)
        b = int(rng.integers(1, max_batch + 1))
        dq, dc = decode(b, int(rng.choice([128, 512, 1024])))
        k = int(rng.integers(1, 3))
        q = [int(x) for x in rng.integers(16, max(17, max_tokens // 2), k)]
        c = [min(qi + int(rng.integers(0, qi)), ctx_cap) for qi in q]
        attn.append(clip_batch(list(dq) + [min(a, b) for a, b in zip(q, c)], list(dc) + c))
    attn = list(dict.fromkeys(attn))
    return attn


def _layer_batches(pts: _Points, small: tuple, max_tokens: int, max_batch: int):
    """Whole-layer batches of the grid."""
    rng, ctx_cap, clip_batch, decode = pts.rng, pts.ctx_cap, pts.clip_batch, pts.decode
    # Whole layers fit what composing the modules adds: a fixed per-call overhead and
    # a scale on attention (a layer whose attention streams the KV cache through the
    # CPU caches pays for it again in its projections). Small and medium batches (the
    # decode iterations) and attention-heavy ones (long contexts, mixed steps).
    layer = []
    for b in small:
        if b <= max_batch:
            for mc in (32, 128, 384):
                layer.append(decode(b, min(mc, ctx_cap)))
    for b, mc in ((8, 1024), (16, 2048), (48, 2048), (64, 1024)):
        if b <= max_batch:
            layer.append(decode(b, min(mc, ctx_cap)))
    for b in (4, 16, 32):  # skewed decode layer steps (see the attention grid)
        if b <= max_batch:
            layer.append(pts.skewed(b, 0.3))
    for q in (16, 64, 256):
        q = min(q, max_tokens)
        layer.append(clip_batch([q], [min(q, ctx_cap)]))
    q = min(1024, max_tokens)
    layer.append(clip_batch([q], [min(q + q // 2, ctx_cap)]))
    for b, q, mc in ((4, 32, 256), (8, 128, 256), (16, 64, 256), (32, 256, 1024), (48, 64, 512)):
        if b <= max_batch:
            dq, dc = decode(b, min(mc, ctx_cap))
            layer.append(clip_batch(list(dq) + [min(q, max_tokens)], list(dc) + [min(q + 64, ctx_cap)]))
    layer = list(dict.fromkeys(layer))
    return layer


def _step_shapes(pts: _Points, max_tokens: int, max_batch: int) -> list:
    """Whole steps for the step-overhead samples: decode steps at full depth (one composition of
    1..32 works), layer-sliced steps (works leaving or resuming mid-model: two or three
    compositions) and a prefill chunk beside decode works."""
    def dec(b, a=0.0, e=1.0):
        _, c = pts.decode(b, 128)
        return [(1, ci, a, e) for ci in c]

    chunk = max(2, min(64, max_tokens))
    shapes = [dec(b) for b in (1, 2, 4, 8, 16, 32) if b <= max_batch]
    shapes += [dec(2) + dec(2, 0.0, 0.5),  # two leave at half depth: 2 compositions
               dec(4) + dec(4, 0.5, 1.0),  # four resume at half depth
               dec(2, 0.0, 1 / 3) + dec(2, 0.0, 2 / 3) + dec(2),  # 3 compositions
               dec(8, 0.0, 0.5) + dec(8, 0.5, 1.0),  # 2 compositions of 8
               dec(4) + [(chunk, chunk, 0.0, 1.0)],  # a whole prefill chunk beside decode works
               dec(4) + [(chunk, 2 * chunk, 0.0, 0.5)]]  # a chunk paused at half depth
    return [s for s in shapes if len(s) <= max(2, max_batch) * 2]


def _decode_step_shapes(pts: _Points, max_batch: int) -> list:
    """More whole decode steps at full depth, spread over batch sizes and contexts like the decode
    layer samples (up to ``max_batch``; contexts to the grid's cap, some skewed): their compute
    prices decode layers as they run inside a step (``DecodeStepSample``)."""
    batches = [pts.decode(b, mc) for b, mc in ((1, 1024), (3, 32), (6, 384), (12, 128), (12, 1024), (24, 384),
                                                 (40, 64), (48, 1024), (64, 512)) if b <= max_batch]
    batches += [pts.skewed(b, 0.3) for b in (8, 24, 32) if b <= max_batch]
    return [[(1, c, 0.0, 1.0) for c in cs] for _, cs in batches]


def _prefill_step_shapes(pts: _Points, max_tokens: int, max_batch: int) -> list:
    """Whole steps at full depth holding prefill chunks: one prompt of 48-1024 tokens (torch's flash kernel on
    AMX), chunks over cached context and several prompts in one step (the C++ prefill kernel), and chunks beside
    decode rows (batches of 4-24 at contexts around 256, chunks of 4-200 tokens): the sizes the schedulers'
    prefill and mixed steps take (chunks up to their 256-512-token budgets, and a few tokens beside decode). Their compute prices a layer call holding a prefill
    chunk as it runs inside a step (``PrefillStepSample``)."""
    def chunk(q, cached=0):
        q = max(2, min(q, max_tokens, pts.ctx_cap))
        return (q, min(q + cached, pts.ctx_cap), 0.0, 1.0)

    def dec(b):
        _, c = pts.decode(min(b, max(1, max_batch)), 256)
        return [(1, ci, 0.0, 1.0) for ci in c]

    shapes = [[chunk(q)] for q in (48, 96, 160, 256, 384, 512, 1024)]
    shapes += [[chunk(128, 256)], [chunk(256, 256)], [chunk(96), chunk(64)], [chunk(200), chunk(120)],
               [chunk(64, 96), chunk(48), chunk(120)]]
    shapes += [dec(8) + [chunk(128)], dec(16) + [chunk(200, 120)], dec(12) + [chunk(80), chunk(40)]]
    # a few prompt tokens beside a decode batch, the served workload's usual step (a short prompt, or a layer
    # slice of one): priced from the 48-token and larger steps alone they ran ~1.1x their price (session 27)
    shapes += [dec(8) + [chunk(4)], dec(16) + [chunk(12)], dec(24) + [chunk(24)], [chunk(16)]]
    return shapes
