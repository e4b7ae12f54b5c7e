"""Which format a model writes its tool calls in, read from its chat template (the template
renders earlier calls the way the model was trained to write them; vLLM's
``--tool-call-parser`` names the same formats), and the marker tokens that format needs in
the text.

Markers that are special tokens (Mistral's ``[TOOL_CALLS]``, Llama's ``<|python_tag|>``,
DeepSeek's ``<｜tool▁calls▁begin｜>``...) are dropped from the text by default; the head puts
them back for the parser from the generated token ids (``ToolFormat.text``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from meshnet_node.toolcalls.common import ToolParser
from meshnet_node.toolcalls.deepseek import DeepSeekParser
from meshnet_node.toolcalls.harmony import HarmonyParser
from meshnet_node.toolcalls.hermes import HermesParser
from meshnet_node.toolcalls.llama import LlamaJsonParser
from meshnet_node.toolcalls.mistral import MistralParser

PARSERS: dict[str, type] = {
    "hermes": HermesParser,
    "llama3_json": LlamaJsonParser,
    "mistral": MistralParser,
    "openai": HarmonyParser,  # gpt-oss harmony, as vLLM names it
    "deepseek_v3": DeepSeekParser,
}
DEFAULT = "hermes"


def template_text(template) -> str:
    """A chat template as text: one string, or a tokenizer's named templates together."""
    if isinstance(template, str):
        return template
    if isinstance(template, dict):
        return "\n".join(t for t in template.values() if isinstance(t, str))
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        return "\n".join(t.get("template", "") for t in template if isinstance(t, dict))
    return ""


def choose(template) -> str:
    """The parser for the calls of a model with this chat template (Hermes when it shows none
    of the others' markers)."""
    text = template_text(template)
    if "<|channel|>" in text and "functions" in text:
        return "openai"
    if "tool▁call▁begin" in text or "tool▁calls▁begin" in text:
        return "deepseek_v3"
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<tool_call>" in text:
        return "hermes"
    if "<|python_tag|>" in text or ('"parameters"' in text and "<|eot_id|>" in text):
        return "llama3_json"
    return DEFAULT


def new_parser(name: str) -> ToolParser:
    return PARSERS[name]()


@dataclass(frozen=True)
class ToolFormat:
    """A model's tool-call format: the parser's name, and the ids of the marker tokens it
    needs to see in the text (each with its text)."""

    name: str = DEFAULT
    markers: dict[int, str] = field(default_factory=dict)

    def text(self, token_id: int | None, text: str) -> str:
        """A generated token's text with its marker put back, when decoding dropped it."""
        marker = self.markers.get(token_id) if token_id is not None else None
        return text + marker if marker is not None and marker not in text else text


def format_for(tokenizer, name: str | None = None) -> ToolFormat:
    """The format of ``tokenizer``'s model (``name``: forced, else from its chat template)."""
    name = name or choose(getattr(tokenizer, "chat_template", None))
    get_vocab = getattr(tokenizer, "get_vocab", None)
    vocab = get_vocab() if callable(get_vocab) else {}
    wanted = PARSERS[name].markers
    return ToolFormat(name, {vocab[m]: m for m in wanted if m in vocab})
