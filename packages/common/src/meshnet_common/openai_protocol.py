"""The public OpenAI-compatible API: request schemas where every field is honoured or
refused with a 400 (``unsupported_parameter``), never silently ignored (as vLLM does)."""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from meshnet_common.errors import InvalidRequest
from meshnet_common.protocol import (  # the one set of bounds
    GRAMMAR_MAX_BYTES,
    LOGIT_BIAS_MAX,
    LOGIT_BIAS_MAX_ENTRIES,
    PENALTY_MAX,
    REPETITION_PENALTY_MAX,
    SEED_MAX,
    SEED_MIN,
    TEMPERATURE_MAX,
)

UNSUPPORTED = "unsupported_parameter"

# Fields of the OpenAI API (and vLLM's extensions) that meshnet does not implement, with the
# values that mean "not asked for": any other value is refused. A field named nowhere in a
# request model is refused too.
_NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
    "reasoning_effort": (None,),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "min_tokens": (None, 0),
    "include_stop_str_in_output": (None, False),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    "use_beam_search": (None, False),
    "prompt_logprobs": (None,),
}
# Accepted and without effect on the output: bookkeeping a client may always send.
_ACCEPTED = {"user", "metadata", "request_id", "safety_identifier", "prompt_cache_key"}
# Keys of a message the openai client writes back when a previous reply is appended to the
# conversation: harmless as they are (``refusal`` text, ``annotations``), or when null.
_MESSAGE_ECHOES = {"refusal": None, "annotations": None, "audio": (None,), "function_call": (None,)}


# Names the chat template's renderer sets itself (transformers' ``apply_chat_template`` and
# its Jinja globals): ``chat_template_kwargs`` never sets them. A ``chat_template`` there
# would run the client's own Jinja (issue 52; vLLM's CVE-2025-61620). The head further
# allows only the variables its model's template reads (``meshnet_node.head.preparing.templates``).
TEMPLATE_RESERVED = frozenset({
    "chat_template", "tokenize", "messages", "conversation", "tools",
    "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "padding", "truncation", "max_length",
    "processor_kwargs", "raise_exception", "strftime_now", "dict", "namespace", "range",
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
    "additional_special_tokens",
})  # fmt: skip


def check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """400 naming the first ``chat_template_kwargs`` key the renderer sets itself."""
    for key in kwargs or {}:
        if key in TEMPLATE_RESERVED:
            raise InvalidRequest(
                f"chat_template_kwargs may not set {key!r}: the server sets it",
                param="chat_template_kwargs", code=UNSUPPORTED,
            )  # fmt: skip
    return kwargs


def _refuse(name: str, why: str = "is not supported by this server") -> InvalidRequest:
    return InvalidRequest(f"{name} {why}", param=name, code=UNSUPPORTED)


class Lenient(BaseModel):
    """Public request schemas: known fields parsed; a field that is not implemented (with a
    value that would change the output) or not known at all is refused with a 400."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _refuse_unimplemented(self):
        for name, value in (self.model_extra or {}).items():
            if name in _ACCEPTED:
                continue
            if name in _NOT_IMPLEMENTED:
                if value in _NOT_IMPLEMENTED[name]:
                    continue
                raise _refuse(name)
            raise _refuse(name, "is not a known parameter")
        return self


class ChatMessage(BaseModel):
    """One message; ``name``, ``tool_calls``, ``tool_call_id`` and the reasoning of an earlier
    reply are kept for the template. The reasoning comes as ``reasoning`` (vLLM's current
    name) or ``reasoning_content`` (the older one) and goes to the template under both."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _known_keys(self):
        for key, value in (self.model_extra or {}).items():
            if key not in _MESSAGE_ECHOES:
                raise _refuse(f"messages[].{key}", "is not a known message field")
            allowed = _MESSAGE_ECHOES[key]
            if allowed is not None and value not in allowed:
                raise _refuse(f"messages[].{key}")
        return self

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_validator(mode="after")
    def _one_reasoning(self):
        both = self.reasoning is not None and self.reasoning_content is not None
        if both and self.reasoning != self.reasoning_content:
            raise InvalidRequest(
                "a message's reasoning and reasoning_content differ: send one of them",
                param="messages",
            )
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            texts = []
            for part in self.content:
                kind = part.get("type")
                if kind != "text":  # images, audio, files: text-only models
                    raise InvalidRequest(
                        f"content parts of type {kind!r} are not supported: the model reads "
                        "text only", param="messages", code=UNSUPPORTED,
                    )  # fmt: skip
                if not isinstance(part.get("text"), str):
                    raise InvalidRequest(
                        "a text content part needs a string 'text'", param="messages"
                    )
                texts.append(part["text"])
            return "".join(texts)
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        for name in ("name", "tool_calls", "tool_call_id"):
            value = getattr(self, name)
            if value is not None:
                message[name] = value
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if reasoning is not None:  # templates read either name (Qwen3: reasoning_content)
            message["reasoning_content"] = message["reasoning"] = reasoning
        return message


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``text``, ``json_object`` (any JSON object) or ``json_schema`` (valid JSON matching
    the schema), enforced by constrained decoding on the tail."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise InvalidRequest(
                "response_format json_schema needs a json_schema object", param="response_format"
            )
        return self


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionSpec


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: dict[str, str]

    @model_validator(mode="after")
    def _named(self):
        if not isinstance(self.function.get("name"), str):
            raise InvalidRequest("tool_choice.function needs a name", param="tool_choice")
        return self


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False


# Bounds on one request (issue #35): its prompts, its generations (prompts x n: one request
# never fills a head's queue by itself), stop strings (checked at every step of every
# generation) and its JSON schema (compiled on the head, then per session on the tail).
# OpenAI takes up to 2048 prompts for embeddings; a completion's prompts each hold a
# generation, and a batch beyond a head's --max-decode-batch only waits. The defaults of
# --max-prompts, --max-choices, --max-stop-chars and --max-schema-chars.
MAX_PROMPTS = 64
MAX_CHOICES = 128
MAX_STOP_CHARS = 256


@dataclass(frozen=True)
class RequestBounds:
    """What one request may ask of a head, as its settings say (issue #35). A schema is
    at most GRAMMAR_MAX_BYTES whatever the settings: its grammar travels in a hop header."""

    max_prompts: int = MAX_PROMPTS
    max_choices: int = MAX_CHOICES
    max_stop_chars: int = MAX_STOP_CHARS
    max_schema_chars: int = GRAMMAR_MAX_BYTES


class _SamplingFields(Lenient):
    """Fields shared by completions and chat, in the OpenAI docs' order."""

    model: str
    max_tokens: int | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # None: the model's generation_config.json default, else OpenAI's (vLLM does the same)
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None  # also on completions, as vLLM
    # vLLM extensions
    top_k: int | None = None  # 0 and -1: no limit
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False  # generate exactly max_tokens
    # vLLM extension; None: the model's default (kept for chat formats built of special
    # tokens, e.g. gpt-oss's harmony channels, dropped otherwise)
    skip_special_tokens: bool | None = None
    user: str | None = None
    # vLLM: requests with different salts never share cached prompt blocks (docs/adr/0035)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)

    @field_validator("max_tokens", "n", "seed", "top_k", mode="before")
    @classmethod
    def _integers(cls, value: Any, info) -> Any:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise InvalidRequest(f"{info.field_name} must be an integer", param=info.field_name)
        return value

    @property
    def prompt_count(self) -> int:
        """How many prompts the request holds (a chat: its one conversation)."""
        return 1

    def check_params(self, *, bounds: RequestBounds) -> None:
        """Validate the sampling parameters within ``bounds`` (the prompt-dependent checks
        come in ``check``)."""
        for name in (
            "temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
            "frequency_penalty",
        ):  # fmt: skip
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not math.isfinite(value)):
                raise InvalidRequest(f"{name} must be a finite number", param=name)
        if self.temperature is not None and not 0.0 <= self.temperature <= TEMPERATURE_MAX:
            raise InvalidRequest(
                f"temperature must be between 0 and {TEMPERATURE_MAX:g}", param="temperature"
            )
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest("top_p must be in (0, 1]", param="top_p")
        if self.top_k is not None and self.top_k < -1:
            raise InvalidRequest("top_k must be -1, 0 (no limit) or positive", param="top_k")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest("min_p must be in [0, 1]", param="min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            if abs(getattr(self, name)) > PENALTY_MAX:
                raise InvalidRequest(f"{name} must be between -2 and 2", param=name)
        rp = self.repetition_penalty
        if rp is not None and not 0.0 < rp <= REPETITION_PENALTY_MAX:
            raise InvalidRequest(
                f"repetition_penalty must be in (0, {REPETITION_PENALTY_MAX:g}]",
                param="repetition_penalty",
            )
        if self.logit_bias is not None:
            if len(self.logit_bias) > LOGIT_BIAS_MAX_ENTRIES:
                raise InvalidRequest("logit_bias takes up to 300 tokens", param="logit_bias")
            for key, bias in self.logit_bias.items():
                if not (key.isascii() and key.isdigit()):  # not "²": int() refuses it
                    raise InvalidRequest(
                        f"logit_bias keys are token ids, got {key!r}", param="logit_bias"
                    )
                if isinstance(bias, bool) or not math.isfinite(bias) or abs(bias) > LOGIT_BIAS_MAX:
                    raise InvalidRequest("logit_bias values lie in [-100, 100]", param="logit_bias")
        if self.stop_token_ids is not None and any(
            isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids
        ):
            raise InvalidRequest("stop_token_ids are token ids", param="stop_token_ids")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options needs stream: true", param="stream_options")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise InvalidRequest("seed must fit in 64 bits", param="seed")
        if not 1 <= self.n <= 8:
            raise InvalidRequest("n must be between 1 and 8", param="n")
        self._check_count(bounds)
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            if len(stops) > 4 or any(not s for s in stops):
                raise InvalidRequest("stop takes up to 4 non-empty strings", param="stop")
            if any(len(s) > bounds.max_stop_chars for s in stops):
                raise InvalidRequest(
                    f"a stop string is at most {bounds.max_stop_chars} characters", param="stop"
                )

    def _check_count(self, bounds: RequestBounds) -> None:
        """A request's prompts and generations (prompts x n) are bounded: one request never
        fills a head's queue by itself (issue #35)."""
        count = self.prompt_count
        if count > bounds.max_prompts:
            raise InvalidRequest(
                f"prompt holds {count} prompts; at most {bounds.max_prompts} per request, "
                "split the request", param="prompt", code="too_many_prompts",
            )  # fmt: skip
        if count * self.n > bounds.max_choices:
            asked = f"n={self.n}" if count == 1 else f"{count} prompts x n={self.n}"
            raise InvalidRequest(
                f"{asked} exceeds {bounds.max_choices} generations per request; split the "
                "request", param="n" if count == 1 else "prompt", code="too_many_generations",
            )  # fmt: skip

    def check(self, *, context_window: int, prompt_tokens: int, bounds: RequestBounds) -> int:
        """Validate everything for one prompt; returns the effective max_tokens."""
        self.check_params(bounds=bounds)
        room = context_window - prompt_tokens
        if room <= 0:
            raise InvalidRequest(
                f"prompt has {prompt_tokens} tokens; the context window is {context_window}",
                param="prompt",
                code="context_length_exceeded",
            )
        if self.max_tokens is None:
            return room if self.default_max_tokens is None else min(room, self.default_max_tokens)
        if self.max_tokens < 1:
            if self.max_tokens == 0 and getattr(self, "scores_only", False):
                return 1  # the prompt is scored by the pass that samples one token
            raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")
        if self.max_tokens > room:
            raise InvalidRequest(
                f"max_tokens {self.max_tokens} + prompt {prompt_tokens} tokens exceeds the "
                f"context window of {context_window}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return self.max_tokens

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None  # only equal to n: no candidates are ranked

    default_max_tokens: ClassVar[int | None] = 16  # OpenAI's and vLLM's for completions

    @property
    def scores_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: the prompt back (with its log-probabilities, if
        asked), nothing generated — how the legacy API scores a text."""
        return self.echo and self.max_tokens == 0

    @model_validator(mode="after")
    def _best_of(self):
        if self.best_of is not None and self.best_of != self.n:
            raise _refuse("best_of", "other than n is not supported (no candidates are ranked)")
        return self

    @property
    def prompt_count(self) -> int:
        """How many prompts ``prompt`` holds (a text or one list of ids is one)."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and all(isinstance(p, int) for p in prompt)):
            return 1
        return len(prompt)

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value <= 5:
            raise InvalidRequest("logprobs must be between 0 and 5", param="logprobs")
        return value


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM extensions for the chat template
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    default_max_tokens: ClassVar[int | None] = None  # the rest of the context window

    _template_kwargs = field_validator("chat_template_kwargs")(check_template_kwargs)

    @model_validator(mode="after")
    def _template_flags(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequest(
                "continue_final_message needs add_generation_prompt: false",
                param="continue_final_message",
            )
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise InvalidRequest(
                "continue_final_message needs an assistant message last",
                param="continue_final_message",
            )
        return self


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; ``cached_tokens``: prompt tokens that came from the prefix cache,
    reported (``prompt_tokens_details``, as OpenAI and vLLM do) when there are any."""
    counts = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens:
        counts["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return counts
