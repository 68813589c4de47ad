"""A generation request's fields made into what the engine takes: the SLO it is served under
(body fields, headers, a Batch API line's cold SLO), stop strings, the structured-output
constraint and the :class:`~laser.core.request.SamplingParams`; each bad field a 400 naming it.
"""

from __future__ import annotations

import asyncio
import json
import math

from ..core.request import SLO, InvalidRequestError, SamplingParams
from ..model.structured import choice_grammar
from .errors import APIError
from .protocol import MAX_STOP, CompletionRequest, SLOFields

# Temperatures below this are greedy (as vLLM): dividing logits by ~0 overflows.
MIN_TEMPERATURE = 1e-5
# Internal header: a Batch API line carries a one-use token naming its cold SLO (laser.batch).
BATCH_SLO_HEADER = "x-laser-batch-slo"


class RequestFields:
    """Field parsing of :class:`~laser.server.generation.Generation` (``self.ae``: its engine,
    ``self.batch_slos``: one-use Batch API tokens)."""

    def resolve_slo(self, asked_for: SLOFields, h_class: str | None, h_ttft: str | None, h_tbt: str | None,
                    headers=None) -> tuple[SLO, SLO | None]:
        """(the SLO a request is served under, the one it asked for when that differs, else None),
        from its body's SLO fields (``asked_for``, :meth:`~laser.server.protocol._Common.slo_fields`)
        and its headers.

        A line of a Batch API job (``BATCH_SLO_HEADER``) is served under its job's cold SLO; when
        its body names a class or targets of its own (``slo_class: "chat"``), that is what it asked
        for, checked like any request's, and the response reports both.

        Raises APIError: 400 for an unknown class, bad targets or headers, an unknown batch token.
        """
        headers = headers or {}
        token = headers.get(BATCH_SLO_HEADER)
        if token is not None:  # a line of a Batch API job, sent by laser.batch (cold SLO with its EDF key)
            slo = self.batch_slos.pop(token, None)
            if slo is None:
                raise APIError(400, f"header {BATCH_SLO_HEADER}: unknown token", "invalid_slo", BATCH_SLO_HEADER)
            asked = None
            if any(f is not None for f in asked_for):
                asked = self._requested_slo(asked_for, None, None, None, {})
            return slo, (asked if asked is not None and asked.name != slo.name else None)
        return self._requested_slo(asked_for, h_class, h_ttft, h_tbt, headers), None

    def _requested_slo(self, body: SLOFields, h_class: str | None, h_ttft: str | None, h_tbt: str | None,
                       headers) -> SLO:
        """The SLO a request names by its body's SLO fields, else its headers, else the default class."""
        name = body.slo_class
        if name is not None and not name.strip():
            raise APIError(400, "slo_class must be a non-empty SLO class name", "invalid_slo", "slo_class")
        if name is None and h_class is not None and h_class.strip():
            name = h_class.strip()

        def ms(v_body: float | None, v_header: str | None, header: str) -> float | None:
            if v_body is not None:
                return v_body / 1e3
            if v_header is None or not v_header.strip():
                return None
            try:
                v = float(v_header)
            except ValueError:
                v = math.nan
            if not (v > 0 and math.isfinite(v)):
                raise APIError(400, f"header {header} must be a positive number of milliseconds, got {v_header!r}",
                               "invalid_slo", header)
            return v / 1e3

        ttft = ms(body.ttft_slo_ms, h_ttft, "x-slo-ttft-ms")
        h_tpot = headers.get("x-slo-tpot-ms")  # llm-d / inference-perf's name: TPOT is our TBT target
        if h_tbt is None or not h_tbt.strip():
            tbt = ms(body.tbt_slo_ms, h_tpot, "x-slo-tpot-ms")
        else:
            tbt = ms(body.tbt_slo_ms, h_tbt, "x-slo-tbt-ms")
        demotable = body.slo_demotable
        h_dem = headers.get("x-slo-demotable")
        if demotable is None and h_dem is not None and h_dem.strip():
            if h_dem.strip().lower() not in ("true", "false", "1", "0"):
                raise APIError(400, f"header x-slo-demotable must be true or false, got {h_dem!r}", "invalid_slo",
                               "x-slo-demotable")
            demotable = h_dem.strip().lower() in ("true", "1")
        try:
            return self.ae.slo_classes.resolve(name, ttft, tbt, demotable)
        except InvalidRequestError as e:
            raise APIError(400, str(e), "invalid_slo", "slo_class") from None

    @staticmethod
    def check_unsupported(body) -> None:
        def bad(field: str, what: str):
            raise APIError(400, f"{field}: {what} is not supported by this server", "unsupported_parameter", field)

        if body.stream_options is not None and not body.stream:
            # vLLM and OpenAI refuse it too: the options only shape a stream's chunks
            raise APIError(400, "stream_options: only allowed when stream is true", "invalid_value", "stream_options")
        if isinstance(body, CompletionRequest):
            if body.suffix:
                bad("suffix", "suffix")
        else:
            if body.top_logprobs is not None and not body.logprobs:
                raise APIError(400, "top_logprobs: needs logprobs set to true", "invalid_value", "top_logprobs")
            tool = body.unsupported_field()
            if tool is not None:
                bad(*tool)

    @staticmethod
    def stop_strings(body) -> tuple[str, ...]:
        stop = body.stop
        if stop is None:
            return ()
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        if len(stop) > MAX_STOP:
            raise APIError(400, f"stop: at most {MAX_STOP} stop strings, got {len(stop)}", "invalid_value", "stop")
        if any(not s for s in stop):
            raise APIError(400, "stop: stop strings must be non-empty", "invalid_value", "stop")
        return stop

    async def structured_output(self, body) -> tuple[str, str] | None:
        """The (kind, spec) of the request's structured-output constraint (``response_format``
        json_object / json_schema, vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
        ``guided_grammar`` / ``structured_outputs``; at most one), compiled once against the
        tokenizer in a helper thread (the first one builds llguidance's tokenizer). None: free text.

        Raises:
            APIError: 400 naming the field: two constraints, a schema or regex that does not
            compile, ``json_schema`` without a schema.
        """
        found: list[tuple[str, tuple[str, str]]] = []

        def as_json(v) -> str:
            return v if isinstance(v, str) else json.dumps(v)

        rf = body.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", ("json", '{"type": "object"}')))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise APIError(400, "response_format: type json_schema needs json_schema.schema", "invalid_value",
                               "response_format")
            found.append(("response_format", ("json", as_json(rf.json_schema.schema_))))
        so = body.structured_outputs
        if so is not None and so.json_ is None and so.regex is None and so.choice is None and so.grammar is None:
            given = sorted(so.model_extra or {})
            raise APIError(400, "structured_outputs: give one of json, regex, choice or grammar"
                           + (f" (got {', '.join(given)}: not supported)" if given else ""), "invalid_value",
                           "structured_outputs")
        for field, v, kind in (("guided_json", body.guided_json, "json"), ("guided_regex", body.guided_regex, "regex"),
                               ("guided_choice", body.guided_choice, "choice"),
                               ("guided_grammar", body.guided_grammar, "lark"),
                               ("structured_outputs", so and so.json_, "json"),
                               ("structured_outputs", so and so.regex, "regex"),
                               ("structured_outputs", so and so.choice, "choice"),
                               ("structured_outputs", so and so.grammar, "lark")):
            if v is None:
                continue
            if kind == "json":
                found.append((field, ("json", as_json(v))))
            elif kind == "choice":
                if not v or any(not c for c in v):
                    raise APIError(400, f"{field}: the choices must be non-empty strings", "invalid_value", field)
                found.append((field, ("lark", choice_grammar(v))))
            else:
                found.append((field, (kind, v)))
        if not found:
            return None
        if len(found) > 1:
            names = ", ".join(f for f, _ in found)
            raise APIError(400, f"{found[1][0]}: give one structured output constraint, got {names}",
                           "invalid_value", found[1][0])
        field, spec = found[0]
        await self.check_grammar(field, spec)
        return spec

    async def check_grammar(self, field: str, spec: tuple[str, str]) -> None:
        """Compile ``spec`` (kind, grammar) against the tokenizer in a helper thread (the engine's
        grammar backend: a single engine's, or a cluster front end's, which checks for its instances).

        Raises:
            APIError: 400 naming ``field``: the grammar does not compile.
        """
        err = await asyncio.get_running_loop().run_in_executor(None, self.ae.engine.grammars.validate, *spec)
        if err is not None:
            raise APIError(400, f"{field}: {err}", "invalid_value", field)

    def sampling_params(self, body, max_tokens: int, stop: tuple[str, ...],
                        structured: tuple[str, str] | None = None) -> SamplingParams:
        """The engine's :class:`SamplingParams` of ``body``. Raises APIError: 400 naming the
        field (a bad ``logit_bias`` key, ``min_tokens`` above ``max_tokens``, ...)."""
        temperature = 1.0 if body.temperature is None else body.temperature
        if temperature < MIN_TEMPERATURE:
            temperature = 0.0
        top_k = body.top_k or 0
        if top_k < 0:
            top_k = 0
        bias = {}
        for k, v in (body.logit_bias or {}).items():
            try:
                bias[int(k)] = v
            except ValueError:
                raise APIError(400, f"logit_bias: keys must be token ids, got {k!r}", "invalid_value",
                               "logit_bias") from None
        if isinstance(body, CompletionRequest):
            logprobs = body.logprobs
            prompt_logprobs = body.logprobs if body.echo else None
        else:
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
            prompt_logprobs = None
        try:
            # vLLM's n / best_of / logits_processors rules (one owner); each choice is then one request
            SamplingParams(n=body.n, best_of=body.best_of, logits_processors=body.logits_processors)
            sp = SamplingParams(
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=top_k,
                seed=body.seed,
                stop=stop,
                stop_token_ids=tuple(body.stop_token_ids or ()),
                ignore_eos=body.ignore_eos,
                include_stop_str_in_output=body.include_stop_str_in_output,
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                logit_bias=bias,
                min_tokens=body.min_tokens or 0,
                min_p=body.min_p or 0.0,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                structured_output=structured,
                dynamic_depth=body.dynamic_depth,
                allowed_token_ids=body.allowed_token_ids,
                bad_words=tuple(body.bad_words or ()),
                skip_special_tokens=body.skip_special_tokens,
                spaces_between_special_tokens=body.spaces_between_special_tokens,
                truncate_prompt_tokens=body.truncate_prompt_tokens,
            )
            sp.check_vocab(self.ae.engine.model_config.vocab_size)
            return sp
        except InvalidRequestError as e:
            msg = str(e)
            field = msg.split()[0].rstrip(":").split(".")[0]
            raise APIError(400, msg, "invalid_value", field if field in type(body).model_fields else None) from None
