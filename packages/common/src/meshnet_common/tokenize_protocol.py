"""vLLM's ``/tokenize`` and ``/detokenize`` request shapes (a head answers them; the tracker
passes them on to one). As on the OpenAI routes, every field is honoured or refused with a
400: an unknown one never passes silently (``Lenient``).

``model`` may be left out, as in vLLM: a head then uses its own model, and the tracker the
one model it serves (lm-evaluation-harness's remote tokenizer sends none)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, StrictBool, StrictInt, StrictStr, field_validator, model_validator

from meshnet_common.errors import InvalidRequest
from meshnet_common.openai_protocol import ChatMessage, Lenient, Tool, check_template_kwargs

TOKENIZE_PATH = "/tokenize"
DETOKENIZE_PATH = "/detokenize"
TOKENIZER_PATHS = (TOKENIZE_PATH, DETOKENIZE_PATH)


class TokenizeCompletionRequest(Lenient):
    """A text to tokenize: ``{"prompt": "..."}``, with the special tokens a completion's
    prompt gets (a BOS) unless ``add_special_tokens`` is false."""

    model: StrictStr | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool | None = False


class TokenizeChatRequest(Lenient):
    """A conversation to tokenize as ``/v1/chat/completions`` would: the model's chat
    template applied to ``messages`` (and ``tools``)."""

    model: StrictStr | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    # The template writes the special tokens itself; true also tokenizes its text with them.
    add_special_tokens: StrictBool = False
    return_token_strs: StrictBool | None = False
    tools: list[Tool] | None = Field(default=None, max_length=128)
    chat_template_kwargs: dict[str, Any] | None = None

    _template_kwargs = field_validator("chat_template_kwargs")(check_template_kwargs)

    @model_validator(mode="after")
    def _template_flags(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequest(
                "continue_final_message needs add_generation_prompt: false",
                param="continue_final_message",
            )
        return self


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class DetokenizeRequest(Lenient):
    """Token ids to turn back into text: ``{"tokens": [...]}`` -> ``{"prompt": "..."}``."""

    model: StrictStr | None = None
    tokens: list[StrictInt]


def tokenize_request_type(payload: dict) -> type[TokenizeCompletionRequest | TokenizeChatRequest]:
    """Which form a ``/tokenize`` body is: a chat when it holds ``messages``, else a text."""
    return TokenizeChatRequest if "messages" in payload else TokenizeCompletionRequest


def tokenize_response(tokens: list[int], max_model_len: int, token_strs: list[str] | None):
    """vLLM's ``/tokenize`` answer."""
    return {
        "count": len(tokens),
        "max_model_len": max_model_len,
        "tokens": tokens,
        "token_strs": token_strs,
    }
