"""Offline API, vLLM-style: ``LLM(model=..., policy=...).generate(prompts, sampling_params, slo=...)``."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from typing import Sequence

from .engine import Engine
from .outputs import RequestOutput
from ..core.config import SchedulerConfig
from ..core.cpu_bind import bind_in_process
from ..core.request import SLO, InvalidRequestError, SamplingParams, choice_seed


def check_tools(tools) -> None:
    """Raise InvalidRequestError naming ``tools[i]`` unless ``tools`` is a list of OpenAI
    function definitions: ``{"type": "function", "function": {"name": <non-empty str>,
    "parameters": <an object schema, optional>}}`` with distinct names."""
    if not isinstance(tools, (list, tuple)):
        raise InvalidRequestError(f"tools must be a list of function definitions, got {type(tools).__name__}")
    names = set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise InvalidRequestError(f"tools[{i}]: must be {{'type': 'function', 'function': {{'name': ...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"tools[{i}].function.name: must be a non-empty string")
        if name in names:
            raise InvalidRequestError(f"tools[{i}].function.name: {name!r} is given twice")
        names.add(name)
        if not isinstance(fn.get("parameters", {}), dict):
            raise InvalidRequestError(f"tools[{i}].function.parameters: must be a JSON schema object")


#: vLLM ``LLM`` options for GPUs that this CPU engine has no use for -> what to use instead.
_VLLM_ONLY = {
    "gpu_memory_utilization": "size the KV pool with cache=CacheConfig(kv_cache_gib=...)",
    "kv_cache_memory_bytes": "size the KV pool with cache=CacheConfig(kv_cache_gib=...)",
    "tensor_parallel_size": "one engine per process; several instances: `laser serve --prefill-instances ...`",
    "pipeline_parallel_size": "one engine per process; several instances: `laser serve --prefill-instances ...`",
    "enforce_eager": "there are no CUDA graphs; LASER_FUSED_DECODE=0 keeps the decode layers eager",
}


def check_engine_kwargs(kwargs: dict) -> None:
    """Raise TypeError naming the first keyword :class:`Engine` does not take (not the
    ModelInstance deep inside that would otherwise name it), with the keywords it does take."""
    from ..instance.model_instance import ModelInstance

    known = set(inspect.signature(ModelInstance.__init__).parameters) - {"self", "extra_eos_ids"}
    known |= {"model", "policy", "slo_classes", "max_num_seqs", "max_num_batched_tokens"}
    for k in kwargs:
        if k not in known:
            why = f" ({_VLLM_ONLY[k]})" if k in _VLLM_ONLY else ""
            raise TypeError(f"LLM() got an unexpected keyword argument {k!r}{why}; it takes "
                            f"{', '.join(sorted(known))}")


def prompt_of(prompt):
    """A prompt as :meth:`Engine.add_request` takes it: text or token ids as given, and vLLM's
    prompt dicts (``vllm.inputs``) unwrapped: ``{"prompt": text}`` (``TextPrompt``) and
    ``{"prompt_token_ids": [...]}`` (``TokensPrompt``).

    Raises InvalidRequestError for a dict with other keys or with neither (multi-modal data, cache
    salts and the like are not served), naming them."""
    if not isinstance(prompt, dict):
        return prompt
    other = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
    if other or len(prompt) != 1:
        raise InvalidRequestError("a prompt dict takes exactly one of 'prompt' (text) and 'prompt_token_ids' "
                                  f"(vLLM's TextPrompt / TokensPrompt), got keys {sorted(prompt)}")
    return next(iter(prompt.values()))


class LLM:
    """Batch generation over one in-process :class:`~laser.frontend.engine.Engine`.

    Keyword arguments are passed to :class:`Engine` (``dtype``, ``quantization``, ``cache``, ``scheduler``, ...).
    """

    def __init__(self, model: str | None = None, policy: str = "laser", *, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None, cpu_bind: str = "none", **engine_kwargs):
        """``max_num_seqs`` / ``max_num_batched_tokens``: vLLM's keywords (the CLI's flags of the same
        names), set on the :class:`SchedulerConfig` (``scheduler=`` or the policy's default).
        ``cpu_bind``: the CLI's ``--cpu-bind`` (``none``, ``auto`` or a list like ``0-3,6``): this
        process's threads and torch's go to those CPUs, torch's threads one per physical core of
        them (:func:`laser.core.cpu_bind.bind_in_process`).

        Raises TypeError naming a keyword the engine does not take (vLLM's GPU options among them,
        with what to use instead); ConfigError for a bad value."""
        check_engine_kwargs(engine_kwargs)
        self.cpu_binding = bind_in_process(cpu_bind)
        knobs = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens}
        knobs = {k: v for k, v in knobs.items() if v is not None}
        if knobs:
            base = engine_kwargs.get("scheduler") or SchedulerConfig(policy=policy)
            engine_kwargs["scheduler"] = dataclasses.replace(base, **knobs)
        self.engine = Engine(model=model, policy=policy, **engine_kwargs)

    def generate(
        self,
        prompts: str | list[int] | dict | Sequence[str | list[int] | dict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        slo: SLO | str | Sequence[SLO | str] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns final outputs in prompt order, one per prompt.

        ``sampling_params`` and ``slo`` may be one value for all prompts or one per prompt. With
        ``sampling_params.n`` > 1 a prompt's output is its first choice and ``output.outputs``
        holds all ``n`` (as vLLM's ``RequestOutput.outputs``; each a :class:`RequestOutput` with
        ``text``, ``token_ids``, ``finish_reason``); choice ``j`` of a seeded request samples with
        ``seed + j``, so choice 0 is the ``n=1`` answer. Raises InvalidRequestError for a
        malformed prompt or sampling parameters (before anything runs).

        ``prompts``: one prompt or a list of them, each text, token ids, or vLLM's prompt dict
        (``{"prompt": text}`` or ``{"prompt_token_ids": [...]}``, :func:`prompt_of`).
        """
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = [prompt_of(p) for p in prompts]
        n = len(prompts)
        sps = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * n
        slos = slo if isinstance(slo, (list, tuple)) else [slo] * n
        if len(sps) != n or len(slos) != n:
            raise ValueError("need one sampling_params / slo per prompt, or a single one")
        return self._run(self._add(zip(prompts, sps, slos)), use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None, slo=None,
             tools: list[dict] | None = None, *, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
             chat_template: str | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them (chat template applied), one
        output per conversation (``sampling_params.n`` choices in ``outputs``, as :meth:`generate`).

        ``tools``: OpenAI function definitions (``{"type": "function", "function": {"name": ...,
        "parameters": {...}}}``) offered to the model, as vLLM's ``LLM.chat(messages, tools=...)``:
        rendered by the chat template when it knows tools, else by the fallback prompt format
        (:mod:`laser.frontend.tool_prompt`); the reply's text holds any ``<tool_call>`` blocks
        (:func:`laser.server.tool_parser.parse_tool_calls` reads them). For calls enforced by a
        grammar, give a ``structured_output`` in ``sampling_params``
        (:func:`laser.model.structured.tool_call_grammar`). ``add_generation_prompt``,
        ``continue_final_message`` and ``chat_template_kwargs``: vLLM's template switches, the
        server's fields of the same names; ``chat_template``: a Jinja template used instead of the
        tokenizer's (vLLM's; one renderer: :meth:`laser.frontend.inputs.InputProcessor.apply_chat_template`).

        Raises InvalidRequestError for a malformed conversation, tool definition or switch
        (before anything runs), also for ``messages`` that is not a list (a plain prompt string:
        use :meth:`generate`)."""
        if not isinstance(messages, (list, tuple)):
            raise InvalidRequestError(
                "messages must be a list of {'role': ..., 'content': ...} dicts (one conversation) or a list of "
                f"such lists, got {type(messages).__name__}" + (" (for a plain prompt use LLM.generate)"
                                                                if isinstance(messages, str) else ""))
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        if tools:
            check_tools(tools)
        switches = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
                    "chat_template_kwargs": chat_template_kwargs, "chat_template": chat_template}
        if any(not isinstance(c, (list, tuple)) for c in convs):
            raise InvalidRequestError("messages must be one conversation (a list of dicts) or a list of them")
        prompts = [self.engine.inputs.encode_prompt(list(c), list(tools or ()) or None, **switches) for c in convs]
        return self._run(self._add((p, sampling_params, slo) for p in prompts), use_tqdm)

    def get_tokenizer(self):
        """The served model's Hugging Face tokenizer (vLLM's ``LLM.get_tokenizer``): the one that
        encodes prompts and renders chat templates here."""
        return self.engine.inputs.tokenizer

    def _add(self, items) -> list[list[str]]:
        """Enqueue every (prompt, sampling_params, slo), ``n`` requests for a prompt whose
        ``sampling_params.n`` is ``n`` (choice ``j`` seeded with :func:`choice_seed`, as the
        server's choices); returns the request ids per prompt. All or none: when one is rejected
        (InvalidRequestError), the ones enqueued before it are aborted, then it raises."""
        groups: list[list[str]] = []
        try:
            for p, sp, s in items:
                n = sp.n if isinstance(sp, SamplingParams) else 1  # the engine checks sp's type
                if n == 1:
                    groups.append([self.engine.add_request(p, sp, s).req_id])
                    continue
                groups.append([])
                for j in range(n):
                    one = dataclasses.replace(sp, n=1, best_of=None, seed=choice_seed(sp.seed, j))
                    groups[-1].append(self.engine.add_request(p, one, s).req_id)
        except BaseException:
            for i in itertools.chain.from_iterable(groups):
                self.engine.abort(i)
            raise
        return groups

    def _run(self, groups: list[list[str]], use_tqdm: bool) -> list[RequestOutput]:
        """Step the engine until every request is done; one output per group (prompt): its first
        choice, with every choice in ``outputs``."""
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=sum(map(len, groups)), desc="generating")
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    final[out.req_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        outs = []
        for ids in groups:
            first = final[ids[0]]
            first.outputs = [final[i] for i in ids]
            outs.append(first)
        return outs
