"""Tool calls for chat: the tools go to the model's chat template; ``tool_choice`` decides
how calls come back.

- ``required`` / a named function: the tail's grammar (ADR-0017) forces the output to be the
  call(s) as JSON, ``[{"name": ..., "arguments": {...}}]`` (one object with the arguments for
  a named function), so every call parses and its arguments validate against the function's
  schema, whatever the model's own tool format (as vLLM does).
- ``auto``: the model answers freely; calls in the Hermes format most open models use
  (Qwen2.5/Qwen3, Hermes, ...): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  are parsed out of the text, the rest is content.
- ``none``: tools are still shown to the template (as OpenAI), no call is parsed."""

from __future__ import annotations

import json
import re
import uuid

from meshnet_common.errors import InvalidRequest

HERMES = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def active(request) -> bool:
    return bool(request.tools) and request.tool_choice != "none"


def forced_name(request) -> str | None:
    """The function a named ``tool_choice`` forces (None for none / auto / required)."""
    choice = request.tool_choice
    function = getattr(choice, "function", None)
    return function["name"] if function else None


def check(request, template: str | None) -> None:
    """400 for tools a template cannot show, or a choice naming no given function."""
    if not request.tools:
        if request.tool_choice not in (None, "none", "auto"):
            raise InvalidRequest("tool_choice needs tools", param="tool_choice")
        return
    if request.response_format is not None and request.response_format.type != "text":
        raise InvalidRequest(
            "tools and response_format cannot be combined", param="response_format"
        )
    if not template or "tools" not in template:
        raise InvalidRequest(
            "this model's chat template cannot express tools", param="tools",
            code="unsupported_parameter",
        )  # fmt: skip
    name = forced_name(request)
    if name is not None and name not in {t.function.name for t in request.tools}:
        raise InvalidRequest(f"tool_choice names no given function: {name!r}", param="tool_choice")


def template_tools(request) -> list[dict] | None:
    if not request.tools:
        return None
    return [t.model_dump(exclude_none=True) for t in request.tools]


def call_schema(request) -> dict | None:
    """The JSON schema the output must follow (None: free output)."""
    if not active(request):
        return None
    functions = {t.function.name: t.function for t in request.tools}
    name = forced_name(request)
    if name is not None:
        return functions[name].parameters or {"type": "object"}
    if request.tool_choice != "required":
        return None
    calls = [
        {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
         "properties": {"name": {"const": fn.name},
                        "arguments": fn.parameters or {"type": "object"}}}
        for fn in functions.values()
    ]  # fmt: skip
    items = calls[0] if len(calls) == 1 else {"anyOf": calls}
    many = request.parallel_tool_calls is not False
    return {"type": "array", "items": items, "minItems": 1, **({} if many else {"maxItems": 1})}


def _call(name: str, arguments) -> dict:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": text}}  # fmt: skip


def parse(request, text: str) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a finished reply."""
    if not active(request):
        return text, []
    name = forced_name(request)
    try:
        if name is not None:
            return None, [_call(name, json.loads(text))]
        if request.tool_choice == "required":
            return None, [_call(c["name"], c["arguments"]) for c in json.loads(text)]
    except (ValueError, KeyError, TypeError):
        return text, []  # cut by max_tokens: no complete call
    calls = []
    for match in HERMES.finditer(text):
        try:
            call = json.loads(match.group(1))
            calls.append(_call(call["name"], call.get("arguments", {})))
        except (ValueError, KeyError, TypeError):
            continue
    if not calls:
        return text, []
    content = HERMES.sub("", text).strip()
    return content or None, calls
