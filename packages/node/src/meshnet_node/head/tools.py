"""Tool calls for chat: the tools go to the model's chat template; ``tool_choice`` decides
how calls come back.

- ``required`` / a named function: the tail's grammar (ADR-0017) forces the output to be the
  call(s) as JSON, ``[{"name": ..., "arguments": {...}}]`` (one object with the arguments for
  a named function), so every call parses and its arguments validate against the function's
  schema, whatever the model's own tool format (as vLLM does).
- ``auto``: the model answers freely; calls in the Hermes format most open models use
  (Qwen2.5/Qwen3, Hermes, ...): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  are parsed out of the text, the rest is content.
- ``none``: tools are still shown to the template (as OpenAI), no call is parsed.

A chat template that cannot show tools (no ``tools`` in it, e.g. SmolLM2's) still serves
the forced choices: the functions are described in a system message (llama.cpp's generic
fallback does the same) and the grammar forces the call. ``auto`` is refused there: the
model could not know the tools nor any format to call them in."""

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
    if not shows_tools(template) and request.tool_choice in (None, "auto"):
        raise InvalidRequest(
            "this model's chat template cannot express tools, so the model cannot choose "
            'to call one: use tool_choice "required" or a named function (the call is '
            "then forced), or a model whose template takes tools", param="tools",
            code="unsupported_parameter",
        )  # fmt: skip
    name = forced_name(request)
    if name is not None and name not in {t.function.name for t in request.tools}:
        raise InvalidRequest(f"tool_choice names no given function: {name!r}", param="tool_choice")


def shows_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def template_tools(request) -> list[dict] | None:
    if not request.tools:
        return None
    return [t.model_dump(exclude_none=True) for t in request.tools]


def render(request, messages: list[dict], template: str | None) -> tuple[list[dict], dict]:
    """The messages and template arguments that show ``request``'s tools: the template's
    own ``tools`` argument when it takes one; else, for a forced call, a system message
    that describes the functions and the JSON to answer with."""
    if not request.tools:
        return messages, {}
    if shows_tools(template):
        return messages, {"tools": template_tools(request)}
    if not active(request):
        return messages, {}
    functions = "\n".join(compact(t.function.model_dump(exclude_none=True)) for t in request.tools)
    name = forced_name(request)
    answer = (
        f"the arguments of {name} as one JSON object" if name is not None
        else 'a JSON list of calls, each {"name": ..., "arguments": {...}}'
    )  # fmt: skip
    note = f"You can call these functions:\n{functions}\nAnswer with {answer}."
    first = messages[0] if messages else None
    if (
        first is not None
        and first["role"] in ("system", "developer")
        and isinstance(first.get("content"), str)
    ):
        return [{**first, "content": f"{first['content']}\n\n{note}"}, *messages[1:]], {}
    return [{"role": "system", "content": note}, *messages], {}


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


def compact(value) -> str:
    """JSON as the grammar writes it (no spaces): streamed and whole replies agree."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _call(name: str, arguments) -> dict:
    text = arguments if isinstance(arguments, str) else compact(arguments)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": text}}  # fmt: skip


def parse(request, text: str) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a finished reply."""
    if not active(request):
        return text, []
    name = forced_name(request)
    try:
        if name is not None:
            return None, [_call(name, compact(json.loads(text)))]
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


class ToolStream:
    """Streams a reply with tools as OpenAI's deltas: ``content`` text, and each tool call as
    a first delta (id, name, empty arguments) followed by ``arguments`` pieces.

    The forced forms are compact JSON the grammar fixes (a named function's arguments object;
    for ``required``, ``[{"name":...,"arguments":{...}},...]``), so they are cut as they come.
    ``auto``: text is content until a ``<tool_call>`` opens; each block is sent as one call
    when it closes."""

    def __init__(self, request) -> None:
        self.request = request
        self.name = forced_name(request)
        self.mode = "named" if self.name else request.tool_choice or "auto"
        self.buffer = ""  # text not sent yet
        self.calls = 0  # tool calls started
        self.depth = 0  # brace depth inside an arguments object (required)
        self.in_string = self.escaped = False
        self.state = "start"

    def _start(self, name: str) -> dict:
        delta = {"index": self.calls, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": name, "arguments": ""}}  # fmt: skip
        self.calls += 1
        return delta

    @staticmethod
    def _args(index: int, text: str) -> dict:
        return {"index": index, "function": {"arguments": text}}

    def feed(self, text: str) -> list[dict]:
        """Deltas (each a ``delta`` dict for a chunk) that ``text`` completes."""
        if self.mode == "named":
            out = [] if self.calls else [{"tool_calls": [self._start(self.name)]}]
            return [*out, {"tool_calls": [self._args(0, text)]}] if text else out
        if self.mode == "required":
            return self._feed_required(text)
        return self._feed_auto(text)

    def _feed_required(self, text: str) -> list[dict]:
        out: list[dict] = []
        self.buffer += text
        while self.buffer:
            if self.state in ("start", "between"):
                if self.state == "between":  # the call object's own brace may come late
                    self.buffer = self.buffer.lstrip("}")
                    if not self.buffer:
                        break
                match = re.match(r'[\[,]?\{"name":"([^"]*)","arguments":', self.buffer)
                if match is None:
                    if self.buffer.startswith("]") or len(self.buffer) > 200:
                        self.buffer = ""
                    break  # wait for the rest of the call's head
                out.append({"tool_calls": [self._start(match.group(1))]})
                self.buffer = self.buffer[match.end() :]
                self.state, self.depth = "args", 0
            elif self.state == "args":
                piece, end = self._scan_args()
                if piece:
                    out.append({"tool_calls": [self._args(self.calls - 1, piece)]})
                if end is None:
                    break
                self.buffer = self.buffer[end:]
                self.state = "between"
        return out

    def _scan_args(self) -> tuple[str, int | None]:
        """The arguments text in the buffer, and where the object ends (None: not yet)."""
        for i, ch in enumerate(self.buffer):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch == "{":
                self.depth += 1
            elif ch == "}":
                self.depth -= 1
                if self.depth == 0:
                    piece = self.buffer[: i + 1]
                    return piece, i + 1
        piece, self.buffer = self.buffer, ""
        return piece, None

    def _feed_auto(self, text: str) -> list[dict]:
        self.buffer += text
        out: list[dict] = []
        while True:
            start = self.buffer.find("<tool_call>")
            if start == -1:
                keep = _open_prefix(self.buffer, "<tool_call>")
                content = self.buffer[: len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep :]
                if content:
                    out.append({"content": content})
                return out
            if start:
                out.append({"content": self.buffer[:start]})
                self.buffer = self.buffer[start:]
            match = HERMES.match(self.buffer)
            if match is None:
                return out  # the block is still open
            try:
                call = json.loads(match.group(1))
                first = self._start(call["name"])
                first["function"]["arguments"] = compact(call.get("arguments", {}))
                out.append({"tool_calls": [first]})
            except (ValueError, KeyError, TypeError):
                out.append({"content": match.group(0)})
            self.buffer = self.buffer[match.end() :]

    def finish(self) -> list[dict]:
        """What is left when the reply ends (an unclosed block is content)."""
        left, self.buffer = self.buffer, ""
        if self.mode == "auto" and left:
            return [{"content": left}]
        return []


def _open_prefix(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
