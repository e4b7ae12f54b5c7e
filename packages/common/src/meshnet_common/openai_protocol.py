"""The public OpenAI-compatible API: lenient request schemas (unknown fields ignored)."""

from __future__ import annotations

import math
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from meshnet_common.errors import InvalidRequest
from meshnet_common.protocol import SEED_MAX, SEED_MIN, TEMPERATURE_MAX  # the one set of bounds


class Lenient(BaseModel):
    """Public schemas accept and ignore fields they do not know (clients send many)."""

    model_config = ConfigDict(extra="ignore")


class ChatMessage(Lenient):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: keep the text ones
            texts = [p.get("text") for p in self.content if p.get("type") == "text"]
            if not all(isinstance(t, str) for t in texts):
                raise InvalidRequest("a text content part needs a string 'text'", param="messages")
            return "".join(texts)
        return self.content or ""


class StreamOptions(Lenient):
    include_usage: bool = False


class _SamplingFields(Lenient):
    """Fields shared by completions and chat, in the OpenAI docs' order."""

    model: str
    max_tokens: int | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # vLLM extension
    ignore_eos: bool = False  # vLLM extension: generate exactly max_tokens
    # vLLM extension; None: the model's default (kept for chat formats built of special
    # tokens, e.g. gpt-oss's harmony channels, dropped otherwise)
    skip_special_tokens: bool | None = None
    user: str | None = None

    @field_validator("max_tokens", "n", "seed", "top_k", mode="before")
    @classmethod
    def _integers(cls, value: Any, info) -> Any:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise InvalidRequest(f"{info.field_name} must be an integer", param=info.field_name)
        return value

    def check_params(self) -> None:
        """Validate the sampling parameters (the prompt-dependent checks come in ``check``)."""
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if not math.isfinite(value):
                raise InvalidRequest(f"{name} must be a finite number", param=name)
        if not 0.0 <= self.temperature <= TEMPERATURE_MAX:
            raise InvalidRequest(
                f"temperature must be between 0 and {TEMPERATURE_MAX:g}", param="temperature"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest("top_p must be in (0, 1]", param="top_p")
        if self.top_k < 0:
            raise InvalidRequest("top_k must be >= 0", param="top_k")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise InvalidRequest("seed must fit in 64 bits", param="seed")
        if not 1 <= self.n <= 8:
            raise InvalidRequest("n must be between 1 and 8", param="n")
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            if len(stops) > 4 or any(not s for s in stops):
                raise InvalidRequest("stop takes up to 4 non-empty strings", param="stop")

    def check(self, *, context_window: int, prompt_tokens: int) -> int:
        """Validate everything for one prompt; returns the effective max_tokens."""
        self.check_params()
        room = context_window - prompt_tokens
        if room <= 0:
            raise InvalidRequest(
                f"prompt has {prompt_tokens} tokens; the context window is {context_window}",
                param="prompt",
                code="context_length_exceeded",
            )
        if self.max_tokens is None:
            return min(room, 256)
        if self.max_tokens < 1:
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
    prompt: str | list[str] | list[int]
    echo: bool = False
    logprobs: int | None = None

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


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
