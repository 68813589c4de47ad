"""OpenAI-compatible request and response models (pydantic), plus Laser's SLO extension fields.

Requests ignore unknown fields (as vLLM does). Fields OpenAI defines but Laser does not
implement are accepted only at their neutral value (e.g. ``presence_penalty=0``); anything
else is a 400 that names the field, never a silent no-op.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

# torch.Generator.manual_seed accepts [-2**63, 2**64 - 1].
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
MAX_STOP = 16
MAX_CHOICES = 16  # n x number of prompts


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False


class _Common(_Request):
    """Sampling, streaming and SLO fields shared by both endpoints."""

    model: str | None = Field(None, description="served model name (default: the only one)")
    temperature: float | None = Field(None, ge=0, description="0 = greedy; default 1")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="-1 or 0 disables top-k (vLLM extension)")
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = Field(None, description=f"up to {MAX_STOP} stop strings")
    stop_token_ids: list[StrictInt] | None = Field(None, max_length=256)
    ignore_eos: bool = False
    return_token_ids: bool = Field(False, description="vLLM extension: token ids with each choice (and chunk)")
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = Field(None, description="only 0 is supported")
    frequency_penalty: float | None = Field(None, description="only 0 is supported")
    logit_bias: dict[str, float] | None = Field(None, description="not supported (must be empty)")
    # -- Laser extension: per-request SLO (also as headers x-slo-class / x-slo-ttft-ms / x-slo-tbt-ms)
    slo_class: str | None = Field(None, description="SLO class name from the server's SLO config")
    ttft_slo_ms: float | None = Field(None, gt=0, description="time-to-first-token target, ms")
    tbt_slo_ms: float | None = Field(None, gt=0, description="time-between-tokens (P99) target, ms")
    slo_demotable: bool | None = Field(None, description="a hot request that may be served as warm under "
                                       "pressure (also header x-slo-demotable; default: the class's setting)")


class CompletionRequest(_Common):
    # StrictInt: JSON true/false and 1.0 are not token ids (lax ints would take them)
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]] = Field(
        ..., description="text, token ids, or a list of either (one choice set per prompt)"
    )
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, description="not supported")
    suffix: str | None = Field(None, description="not supported")
    best_of: int | None = Field(None, description="only 1 is supported")


class TextPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ResponseFormat(_Request):
    type: str = "text"


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="default: the rest of the context")
    max_completion_tokens: int | None = Field(None, ge=1, description="alias of max_tokens (newer clients)")
    logprobs: bool | None = Field(None, description="not supported")
    top_logprobs: int | None = Field(None, description="not supported")
    tools: list[Any] | None = Field(None, description="not supported")
    tool_choice: Any = Field(None, description="not supported (only none/auto without tools)")
    functions: list[Any] | None = Field(None, description="legacy; not supported")
    function_call: Any = Field(None, description="legacy; not supported (only none/auto)")
    response_format: ResponseFormat | None = Field(None, description="only type=text is supported")


# -- responses ------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    """OpenAI's ``usage.prompt_tokens_details``."""

    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class SLOInfo(BaseModel):
    """Laser extension: the SLO a request was served under and how it went."""

    slo_class: str
    ttft_slo_ms: float | None = None
    tbt_slo_ms: float | None = None
    demoted: bool = False
    demoted_to: str | None = None
    requested_slo_class: str | None = None
    predicted_ttft_ms: float | None = None
    ttft_ms: float | None = None
    slo_met: bool | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    slo: SLOInfo | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    slo: SLOInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "laser"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# -- helpers of both endpoints ------------------------------------------------------------------------


def unsupported_chat_fields(body: ChatCompletionRequest) -> tuple[str, str] | None:
    """(field, what) of the first tool-calling field a chat request sets that this server cannot
    honour, or None. Tools (and legacy functions) are not implemented, so a non-empty list
    or a choice that demands a call (``"required"``, a named function, even with
    ``tools: []``) is refused rather than silently ignored; ``"none"``/``"auto"`` with no
    tools is the neutral value."""
    if body.tools:
        return "tools", "tool calling"
    if body.tool_choice not in (None, "none", "auto"):
        return "tool_choice", f"tool_choice {body.tool_choice!r} (tool calling)"
    if body.functions:
        return "functions", "function calling (legacy functions)"
    if body.function_call not in (None, "none", "auto"):
        return "function_call", f"function_call {body.function_call!r} (legacy function calling)"
    return None


def choice_seed(seed: int | None, index: int) -> int | None:
    """Seed of choice ``index`` (0-based) of a request with ``seed`` and ``n > 1``: ``seed + index``
    (as vLLM's parallel sampling), wrapped into the accepted range, so each choice is its own
    reproducible stream and choice 0 equals the ``n=1`` answer. None stays None (unseeded)."""
    if seed is None or index == 0:
        return seed
    s = seed + index
    return s - 2**64 if s > SEED_MAX else s
