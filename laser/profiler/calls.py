"""The calls the profiler times: the executor's own code on the engine's weights and KV pool.

:class:`ExecutorCalls` builds, for a size or a batch, a zero-argument call of one piece of
what :class:`~laser.model.runner.ModelRunner` runs. Each calls the model's own functions,
so a change of the layer kernel is profiled as it is:

* **stateless** ``n``: :meth:`LlamaModel.qkv` + :meth:`LlamaModel.finish_layer` (RMSNorms,
  QKV projection, QK-norm, RoPE, O projection, SwiGLU MLP, residual adds) -- a layer call
  without its attention core;
* **attention** ``(q, c)``: :meth:`LlamaModel.attend` (KV-cache write + attention
  kernel) on :class:`AttnMetadata` built by ``ModelRunner._build_metadata`` for fake works
  whose blocks are allocated in the block manager (and freed again);
* **layer**: a whole :meth:`LlamaModel.forward_layer` call; **layer pass**: every layer's, in order;
* **embed** / **head**: what ``ModelRunner.join`` and ``_finish`` run (token-id tensor +
  embedding lookup; row gather + final norm + LM head + sampling).

Calls rotate over the layers (as in a real pass, weights are not cache-hot).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..model.runner import ModelRunner
from ..core.plan import Work
from ..core.request import Request, SamplingParams
from ..model.sampler import Sampler

# Request ids of the profiler's fake works and requests (never an engine's).
_REQ_PREFIX = "__profile"
GREEDY = SamplingParams(temperature=0.0)


class ExecutorCalls:
    """Builds timed calls of the executor's pieces on a :class:`ModelRunner` (see the module
    docstring). Each ``*_call`` returns a zero-argument callable; its result is discarded."""

    def __init__(self, runner: ModelRunner, seed: int = 0):
        self.runner = runner
        self.model = runner.model
        self.cfg = runner.model.config
        self.bm = runner.bm
        self.num_layers = runner.num_layers
        self.sampler = Sampler(seed)  # own generator: the engine's stream is left alone
        self.gen = torch.Generator().manual_seed(seed)
        self._layer = 0
        self._uid = 0

    def next_layer(self) -> int:
        """Layers rotate across calls, as in a pass through the model."""
        self._layer = (self._layer + 1) % self.num_layers
        return self._layer

    def randn(self, *shape) -> torch.Tensor:
        """Standard-normal tensor of ``shape`` in the model's dtype (own generator)."""
        return torch.randn(*shape, generator=self.gen).to(self.model.dtype)

    # -- metadata on fake works ------------------------------------------------------------
    def metadata(self, query_lens: Sequence[int], context_lens: Sequence[int]):
        """``AttnMetadata`` for the batch, from blocks really allocated (then freed).

        Rows follow the runner's order (decode works first, by context). The metadata only
        holds slot indices; freeing the blocks leaves them valid to index the KV pool.
        """
        works, ids = [], []
        try:
            for q, c in zip(query_lens, context_lens):
                self._uid += 1
                rid = f"{_REQ_PREFIX}-{self._uid}"
                self.bm.allocate(rid, c, range(0, 1))
                ids.append(rid)
                works.append(Work(rid, c - q, q, 0, self.num_layers))
            works.sort(key=lambda w: (w.num_tokens > 1, w.context_len if w.num_tokens == 1 else 0))  # as ModelRunner.join
            return self.runner._build_metadata(works, range(0, self.num_layers))
        finally:
            for rid in ids:
                self.bm.free(rid)

    # -- the pieces -------------------------------------------------------------------------
    def stateless_call(self, n: int) -> Callable[[], object]:
        """One layer call on ``n`` tokens without its attention core: ``qkv`` then
        ``finish_layer``, with ``q`` standing in for the attention output (same shape)."""
        m = self.model
        hidden = self.randn(n, self.cfg.hidden_size)
        cos, sin = m.rope_cos[:n].contiguous(), m.rope_sin[:n].contiguous()

        def run():
            i = self.next_layer()
            q, _, _ = m.qkv(i, hidden, cos, sin)
            return m.finish_layer(i, hidden, q)

        return run

    def attention_call(self, query_lens, context_lens) -> Callable[[], object]:
        """``attend``: KV-cache write of the new tokens + the attention kernel."""
        m = self.model
        meta = self.metadata(query_lens, context_lens)
        q, k, v = m.qkv(0, self.randn(sum(query_lens), self.cfg.hidden_size), meta.cos, meta.sin)
        return lambda: m.attend(self.next_layer(), q, k, v, meta)

    def layer_call(self, query_lens, context_lens) -> Callable[[], object]:
        """A whole ``forward_layer`` call."""
        meta = self.metadata(query_lens, context_lens)
        hidden = self.randn(sum(query_lens), self.cfg.hidden_size)
        m = self.model
        return lambda: m.forward_layer(self.next_layer(), hidden, meta)

    def layer_pass_call(self, query_lens, context_lens) -> Callable[[], object]:
        """Every layer's ``forward_layer`` in order, each on the previous one's output: the layer
        calls of a step at full depth (no embedding, LM head or batch composition), where a
        decode layer costs less than the same call timed alone."""
        meta = self.metadata(query_lens, context_lens)
        hidden = self.randn(sum(query_lens), self.cfg.hidden_size)
        m, n = self.model, self.num_layers

        def run():
            h = hidden
            for i in range(n):
                h = m.forward_layer(i, h, meta)
            return h

        return run

    def embed_call(self, n: int) -> Callable[[], object]:
        """Token ids (a Python list, as the runner collects them) -> tensor -> embedding."""
        ids = [int(x) for x in torch.randint(0, self.cfg.vocab_size, (n,), generator=self.gen)]
        m = self.model
        return lambda: m.embed(torch.tensor(ids, dtype=torch.long))

    def head_call(self, rows: int, sampling: SamplingParams | None = None) -> Callable[[], object]:
        """Gather the last rows, final norm + LM head, sampling (``ModelRunner._finish``).

        Greedy by default (as the benchmarks run): a row sampled at temperature > 0 costs
        more (softmax + multinomial over the vocabulary, ~1.4 ms per row for SmolLM2 on
        two CPU cores), which a per-row-count head model cannot tell apart.
        """
        sp = sampling or GREEDY
        reqs = [Request([1], sp, req_id=f"{_REQ_PREFIX}-head-{k}") for k in range(rows)]
        hidden = self.randn(rows * 2, self.cfg.hidden_size)
        idx = [2 * k + 1 for k in range(rows)]
        m, sampler = self.model, self.sampler

        def run():
            logits = m.compute_logits(hidden[torch.tensor(idx)])
            return sampler.sample(logits, reqs)

        return run
