"""Plans: the plain-data boundary between a scheduler and an executor.

A scheduler never touches tensors. It hands the executor (``ModelRunner``) or the
simulator a :class:`StepPlan`: which requests run which layers on which tokens.
Torch-free by design: a plan is plain data, so it can cross a process boundary.

Layer-level scheduling (Laser, PPoPP'26 §3) needs one thing iteration-level plans
lack: a piece of work may cover only a *range* of layers. A prefill chunk may stop
at layer 12 (its hidden states go to the intermediate cache) and resume from layer
12 in a later step; a decode request with L < N layers per iteration runs a slice
of the network each iteration.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Work:
    """One request's share of a step: ``num_tokens`` tokens through layers ``[layer_start, layer_end)``."""

    req_id: str
    # Position of the first new token (== tokens whose KV already exists at layer_start).
    token_start: int
    # Number of new tokens (query length). 1 for a decode token.
    num_tokens: int
    # First layer to run. 0 means the tokens are embedded first; > 0 means the input
    # hidden states come from the intermediate cache.
    layer_start: int
    # One past the last layer to run. == num_layers means the last position's hidden
    # state goes through the final norm and LM head (a token is sampled if ``sample``).
    layer_end: int
    # Sample a token after the last layer (False for a non-final prefill chunk).
    sample: bool = False
    # The sampled row goes through a grammar mask (the request has structured output):
    # priced as the latency model's ``mask_time`` on top of the LM head
    masked: bool = False
    # Dynamic depth (laser.core.depth.exit_plan): a decode token that may exit early is priced
    # at ``depth`` layers (its expected depth; 0: at ``layer_end``) plus an exit check at every
    # exit layer from ``exit_from`` (its min depth; 0: none) up to it. Executors ignore both.
    depth: int = 0
    exit_from: int = 0

    @property
    def context_len(self) -> int:
        """KV length this work attends to after writing its own tokens (tokens)."""
        return self.token_start + self.num_tokens

    @property
    def priced_end(self) -> int:
        """The layer a plan's price runs this work to: its expected exit ``depth``, else ``layer_end``."""
        return self.depth or self.layer_end

    @property
    def is_decode(self) -> bool:
        """A single token extending an existing context (decode-like attention)."""
        return self.num_tokens == 1 and self.token_start > 0

    def reached(self, stopped_layer: int) -> int:
        """The layer this work got to in a step that a stop paused at ``stopped_layer``
        (the plan's last layer when nothing stopped it). One rule for the executor, the
        simulator and the schedulers' bookkeeping.

        A stop pauses prefill work only: a decode token (:attr:`is_decode`) runs on to its
        ``layer_end`` -- it costs little, and parking it would add the whole next step to
        its request's token gap (a TBT miss). Prefill work stays at the boundary it
        reached (``layer_start`` if it had not started).
        """
        if self.is_decode:
            return self.layer_end
        return min(max(stopped_layer, self.layer_start), self.layer_end)


@dataclass(frozen=True, slots=True)
class LayerStep:
    """The batch one layer call processes: what the latency model predicts.

    ``query_lens[k]`` new tokens of batch entry k attend to ``context_lens[k]`` tokens
    (its cached context plus itself).
    """

    layer: int
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def sum_context(self) -> int:
        return sum(self.context_lens)


@dataclass(slots=True)
class StepPlan:
    """Everything one engine step executes, ordered by layer.

    Layer ``j`` of the step runs every work with ``layer_start <= j < layer_end``
    in one batched layer call. Works of one request never overlap within a plan.
    """

    num_layers: int
    works: list[Work] = field(default_factory=list)
    # (latency model, seconds): the scheduler's prediction of this plan, made when it built it
    # (``LatencyModel.predict_iteration`` returns it for that model instead of re-pricing).
    # Plans are not changed after scheduling; None = not priced.
    predicted: tuple | None = field(default=None, compare=False, repr=False)
    # (req id -> draft length, exit layer): the decode works the scheduler priced as run
    # self-speculatively (laser.core.speculation; :class:`laser.core.pricing.PlanCost`'s
    # ``drafts``), so a re-pricing (the calibration's, the arrival rule's) prices them alike.
    speculative: tuple | None = field(default=None, compare=False, repr=False)
    # A decode step at full depth after this many steps in a row without prefill work (0: after other work;
    # laser.core.pricing.warm_streak, set by the instance core before it runs): priced at
    # ``LatencyModel.decode_warm_factor(rows, warm)`` of its price.
    warm: int = field(default=0, compare=False, repr=False)

    def __bool__(self) -> bool:
        return bool(self.works)

    @property
    def first_layer(self) -> int:
        return min(w.layer_start for w in self.works)

    @property
    def last_layer(self) -> int:
        return max(w.layer_end for w in self.works)

    def boundaries(self) -> tuple[dict[int, list[Work]], dict[int, list[Work]]]:
        """(layer -> works starting there, layer -> works ending there), in plan order."""
        starts: dict[int, list[Work]] = {}
        ends: dict[int, list[Work]] = {}
        for w in self.works:
            starts.setdefault(w.layer_start, []).append(w)
            ends.setdefault(w.layer_end, []).append(w)
        return starts, ends

    def starts_after_stop(self, stop: int) -> bool:
        """Whether, after a stop at layer ``stop``, a work that had not started yet still
        runs (a decode work; :meth:`Work.reached`)."""
        return any(w.layer_start >= stop and w.reached(stop) > w.layer_start for w in self.works)

    def active(self, layer: int) -> list[Work]:
        """Works that run ``layer``, in plan order."""
        return [w for w in self.works if w.layer_start <= layer < w.layer_end]

    def layer_step(self, layer: int) -> LayerStep:
        act = self.active(layer)
        return LayerStep(layer, tuple(w.num_tokens for w in act), tuple(w.context_len for w in act))

    def layer_steps(self) -> list[LayerStep]:
        """The non-empty layer calls of this plan, in execution order."""
        if not self.works:
            return []
        steps = (self.layer_step(j) for j in range(self.first_layer, self.last_layer))
        return [s for s in steps if s.query_lens]

    def num_sampled(self) -> int:
        return sum(1 for w in self.works if w.sample and w.layer_end == self.num_layers)

    def num_final(self) -> int:
        """Works whose last position goes through the LM head this step."""
        return sum(1 for w in self.works if w.layer_end == self.num_layers)

    def to_json(self) -> dict:
        """This plan as JSON-able plain data (a server's step log: ``GET /engine/steps``): the
        layer count, each work's fields in :class:`Work`'s order, ``speculative`` (drafts by request id, exit layer).
        The scheduler's own prediction (``predicted``) is left out. :meth:`from_json` inverts it."""
        return {"num_layers": self.num_layers,
                "works": [[w.req_id, w.token_start, w.num_tokens, w.layer_start, w.layer_end, w.sample, w.masked,
                           w.depth, w.exit_from] for w in self.works],
                "speculative": None if self.speculative is None else [dict(self.speculative[0]), self.speculative[1]]}

    @classmethod
    def from_json(cls, d: dict) -> "StepPlan":
        """The plan :meth:`to_json` wrote. Raises KeyError / TypeError for malformed data."""
        spec = d.get("speculative")
        return cls(int(d["num_layers"]), [Work(*w) for w in d["works"]],
                   speculative=None if spec is None else ({k: int(v) for k, v in spec[0].items()}, int(spec[1])))


@dataclass
class StepResult:
    """What one executed plan produced."""

    # The layer the step's prefill work stopped before: plan.last_layer when it ran to
    # completion, smaller when ``stop_at`` interrupted it at that boundary (decode works
    # still ran to their end; see ``Work.reached``).
    stopped_layer: int
    # req_id -> sampled token for works that finished the last layer with ``sample``.
    sampled: dict[str, int] = field(default_factory=dict)
    # req_id -> tokens after the ``sampled`` one, in order: a self-speculative step's accepted
    # tokens (laser.spec). The finish rule sees each in turn; the ones after a finish are dropped.
    extra_tokens: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> the layer a decode token of a dynamic-depth request exited after (its ``sampled``
    # token came from that exit; the later layers' K/V of its position were filled from the exit
    # state: the work counts as having reached the last layer). laser.core.depth.
    exit_layers: dict[str, int] = field(default_factory=dict)
    # req_id -> [V] float32 logits tensor (torch executor, only with ``return_logits``).
    logits: dict = field(default_factory=dict)
    # req_id -> the sampled token's raw TokenLogprob (requests with SamplingParams.logprobs).
    logprobs: dict = field(default_factory=dict)
    # req_id -> (first prompt position, [TokenLogprob per position]) of the prompt tokens a
    # prefill chunk that finished the last layer predicts (SamplingParams.prompt_logprobs).
    prompt_logprobs: dict = field(default_factory=dict)
    # Seconds of model compute: layer calls, embedding, LM head and sampling (the rest of a
    # step's execution is switching: composition changes at layer boundaries, stop checks).
    compute_seconds: float = 0.0
    num_layer_calls: int = 0
