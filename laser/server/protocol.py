"""OpenAI-compatible request and response models (pydantic), plus Laser's SLO extension fields.

Requests ignore unknown fields (as vLLM does) and take each field in its JSON type only, as
OpenAI's validation does: ``"stream": "yes"`` or ``1``, ``"max_tokens": "5"``, ``5.0`` or ``true``,
``"temperature": "0"`` are 400s naming the field (pydantic's strict mode; an integer is still a
number). Fields OpenAI defines but Laser does not
implement are accepted only at their neutral value (e.g. ``functions=[]``); anything else is a 400
that names the field, never a silent no-op.
"""

from __future__ import annotations

import time
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from ..core.request import MAX_LOGPROBS, SEED_MAX, SEED_MIN

# torch.Generator.manual_seed accepts [-2**63, 2**64 - 1].
MAX_STOP = 16
MAX_CHOICES = 16  # n x number of prompts when n > 1 (a list of prompts with n = 1 has no cap)


class _Request(BaseModel):
    """Base of the request models: unknown fields ignored, no NaN/inf, no coercion between JSON
    types (strict: a string is not a boolean or a number, a float not an integer), and ``null`` for a field
    with a non-null default read as that default (OpenAI's fields are nullable: ``"n": null``,
    ``"stream": null`` and ``"echo": null`` are its defaults, as clients that serialise unset
    options send them; a required field stays required)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        if isinstance(data, dict):
            defaulted = {f.alias or name for name, f in cls.model_fields.items()
                         if not f.is_required() and f.default is not None}
            if any(data.get(k, 0) is None for k in defaulted):
                data = {k: v for k, v in data.items() if not (v is None and k in defaulted)}
        return data


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="vLLM extension: with include_usage, usage on every "
                                         "chunk (that choice's prompt and completion tokens so far)")


class JSONSchemaFormat(_Request):
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(_Request):
    """vLLM's ``structured_outputs`` (one of its fields; other keys are kept so that a request
    naming none of these four is refused with their names, not served unconstrained)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class SLOFields(NamedTuple):
    """The SLO fields of a generation request's body (None: not given): a class name, targets in
    milliseconds, and whether a hot request may be demoted (:meth:`_Common.slo_fields`)."""

    slo_class: str | None
    ttft_slo_ms: float | None
    tbt_slo_ms: float | None
    slo_demotable: bool | None


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
    include_stop_str_in_output: bool = Field(False, description="vLLM extension: keep the matched stop string "
                                             "at the end of the text")
    return_token_ids: bool = Field(False, description="vLLM extension: token ids with each choice (and chunk)")
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2, description="minus this once a token is in the output")
    frequency_penalty: float | None = Field(None, ge=-2, le=2,
                                            description="minus this times the token's count in the output")
    repetition_penalty: float | None = Field(None, gt=0, description="vLLM extension: logits of tokens in the "
                                             "prompt or output divided (positive) / multiplied (negative) by it")
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    min_tokens: int | None = Field(None, ge=0, description="vLLM extension: EOS and stop tokens/strings ignored "
                                   "until this many tokens are generated")
    min_p: float | None = Field(None, ge=0, le=1, description="vLLM extension: drop tokens below min_p x the top "
                                "token's probability")
    best_of: int | None = Field(None, ge=1, description="vLLM extension: only n (more candidates than choices is "
                                "refused, as vLLM V1)")
    allowed_token_ids: list[StrictInt] | None = Field(None, description="vLLM extension: only these tokens may be "
                                                      "generated")
    bad_words: list[str] | None = Field(None, description="vLLM extension: words the output must not contain "
                                        "(each word's last token is banned after its other tokens)")
    skip_special_tokens: bool = Field(True, description="vLLM extension: leave special tokens out of the text")
    spaces_between_special_tokens: bool = Field(True, description="vLLM extension: a slow tokenizer's decode switch")
    truncate_prompt_tokens: int | None = Field(None, ge=-1, description="vLLM extension: keep the prompt's last "
                                               "this many tokens (-1: the context length)")
    logits_processors: Any = Field(None, description="vLLM extension; per-request logits processors are not "
                                   "supported (as vLLM V1)")
    # -- Laser extension: per-request SLO (also as headers x-slo-class / x-slo-ttft-ms / x-slo-tbt-ms)
    slo_class: str | None = Field(None, description="SLO class name from the server's SLO config")
    ttft_slo_ms: float | None = Field(None, gt=0, description="time-to-first-token target, ms")
    tbt_slo_ms: float | None = Field(None, gt=0, description="time-between-tokens (P99) target, ms")
    slo_demotable: bool | None = Field(None, description="a hot request that may be served as warm under "
                                       "pressure (also header x-slo-demotable; default: the class's setting)")
    # -- Laser extension: lossy dynamic depth (laser.core.depth; greedy requests, a server with exits)
    dynamic_depth: StrictBool | dict | None = Field(None, description="decode tokens may leave the model at a trained "
                                              "exit: true, or {threshold: top-1 probability in (0, 1], min_depth: "
                                              "layers}; usage.dynamic_depth reports the mean layers used")
    # -- structured output (one of these; docs/server.md)
    response_format: ResponseFormat | None = Field(None, description="json_object or json_schema constrain the "
                                                   "output (grammar mask)")
    guided_json: dict | str | None = Field(None, description="vLLM extension: a JSON schema the output follows")
    guided_regex: str | None = Field(None, description="vLLM extension: a regex the output matches")
    guided_choice: list[str] | None = Field(None, min_length=1, description="vLLM extension: the output is one of these")
    guided_grammar: str | None = Field(None, description="vLLM extension: a Lark grammar the output follows")
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM extension: json, regex, choice "
                                                         "or grammar (one)")

    def slo_fields(self) -> SLOFields:
        """The SLO this request's body asks for (any field None: not given)."""
        return SLOFields(self.slo_class, self.ttft_slo_ms, self.tbt_slo_ms, self.slo_demotable)


class CompletionRequest(_Common):
    # StrictInt: JSON true/false and 1.0 are not token ids (lax ints would take them)
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]] = Field(
        ..., description="text, token ids, or a list of either (one choice set per prompt)"
    )
    max_tokens: int | None = Field(16, ge=0, description="tokens to generate; 0 only with echo: the prompt (and "
                                   "its logprobs) alone, nothing generated (OpenAI's legacy scoring, as vLLM)")
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="log-probabilities of each token and "
                                 "of this many most likely ones (the prompt's too with echo)")
    suffix: str | None = Field(None, description="not supported")


class TextPart(_Request):
    type: str
    text: str | None = None


class FunctionDefinition(_Request):
    name: str = Field(..., pattern=r"^[A-Za-z0-9_-]{1,64}$", description="letters, digits, _ and -; at most 64")
    description: str | None = None
    parameters: dict | None = Field(None, description="JSON schema of the arguments (an object; default: none)")
    strict: bool | None = None


class ToolDefinition(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


class ToolCallFunction(_Request):
    name: str
    arguments: str = Field(..., description="the arguments as a JSON text")


class ToolCallItem(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = Field(None, description="assistant: the calls it made")
    tool_call_id: str | None = Field(None, description="tool: the call this message answers")


class _ChatTemplateSwitches(_Request):
    """vLLM's chat template switches (``/v1/chat/completions`` and ``/tokenize``), passed to the
    template as transformers' ``apply_chat_template`` takes them; both true is a 400."""

    add_generation_prompt: StrictBool = Field(True, description="vLLM extension: open an assistant turn after "
                                              "the messages")
    continue_final_message: StrictBool = Field(False, description="vLLM extension: leave the last message open "
                                               "for the model to continue (with add_generation_prompt false)")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="vLLM extension: more variables for "
                                                        "the chat template, e.g. {\"enable_thinking\": false}")

    def template_switches(self) -> dict[str, Any]:
        """Keyword arguments of :meth:`laser.frontend.inputs.InputProcessor.apply_chat_template`."""
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message,
                "chat_template_kwargs": self.chat_template_kwargs}


class ChatCompletionRequest(_Common, _ChatTemplateSwitches):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="default: the rest of the context")
    max_completion_tokens: int | None = Field(None, ge=1, description="alias of max_tokens (newer clients)")
    logprobs: bool | None = Field(None, description="log-probability of each output token")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="with logprobs: this many most "
                                     "likely tokens at each position")
    tools: list[ToolDefinition] | None = Field(None, description="functions the model may call (docs/server.md)")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="auto (default with tools), none, required or a named function (both grammar-enforced)")
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call (default true)")
    chat_template: str | None = Field(None, description="vLLM extension; a request's own template is refused (vLLM "
                                      "refuses it without --trust-request-chat-template)")
    functions: list[Any] | None = Field(None, description="legacy; not supported")
    function_call: Any = Field(None, description="legacy; not supported (only none/auto)")

    def unsupported_field(self) -> tuple[str, str] | None:
        """(field, what) of the first legacy function-calling field this request sets that this
        server cannot honour, or None: ``functions`` / ``function_call`` (superseded by ``tools`` /
        ``tool_choice``) only at their neutral value (no functions, ``"none"``/``"auto"``)."""
        if self.functions:
            return "functions", "function calling (legacy functions; use tools)"
        if self.chat_template is not None:  # (a template runs on the server: vLLM trusts none by default either)
            return "chat_template", "a chat template sent with the request (the model's own is used)"
        if self.function_call not in (None, "none", "auto"):
            return "function_call", f"function_call {self.function_call!r} (legacy function calling; use tool_choice)"
        return None


class TokenizeRequest(_ChatTemplateSwitches):
    """vLLM's ``/tokenize``: a text ``prompt``, or chat ``messages`` (the chat template applied,
    as ``/v1/chat/completions`` does)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDefinition] | None = Field(None, description="messages: tools rendered as chat completions "
                                               "render them (tool_choice auto)")
    add_special_tokens: bool = Field(True, description="text prompts: add the tokenizer's special tokens")
    return_token_strs: bool = Field(False, description="also the token strings (convert_ids_to_tokens)")


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[StrictInt]


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
    failovers: int = 0  # times a choice moved after a cluster instance holding it failed
    seed_kept: bool | None = None  # a failed-over seeded sampled choice kept its seeded stream


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict | None = None  # tokens, token_logprobs, top_logprobs, text_offset (OpenAI's legacy shape)
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
    content: str | None
    tool_calls: list[dict] | None = None  # {"id", "type": "function", "function": {"name", "arguments"}}


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict | None = None  # {"content": [{token, logprob, bytes, top_logprobs}]}
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
