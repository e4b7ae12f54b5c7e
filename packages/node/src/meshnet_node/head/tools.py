"""Tool calls for chat: the tools go to the model's chat template; ``tool_choice`` decides
how calls come back.

- ``required`` / a named function: the tail's grammar (ADR-0017) forces the output to be the
  call(s) as JSON, ``[{"name": ..., "arguments": {...}}]`` (one object with the arguments for
  a named function), so every call parses and its arguments validate against the function's
  schema, whatever the model's own tool format (as vLLM does). The schemas are made strict
  first (``meshnet_node.toolcalls.strict``): no property a schema does not list.
- ``auto``: the model answers freely; calls in the model's own format, chosen from its chat
  template (``meshnet_node.toolcalls.formats``: Hermes ``<tool_call>`` blocks, Llama 3 JSON,
  Mistral ``[TOOL_CALLS]``, gpt-oss harmony, DeepSeek V3), are parsed out of the text, the
  rest is content.
- ``parallel_tool_calls: false``: at most one call (``cut_after_call``).
- ``none``: tools are still shown to the template (as OpenAI), no call is parsed.

A chat template that cannot show tools (no ``tools`` in it, e.g. SmolLM2's) still serves
the forced choices: the functions are described in a system message (llama.cpp's generic
fallback does the same) and the grammar forces the call. ``auto`` is refused there: the
model could not know the tools nor any format to call them in."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from meshnet_common.errors import InvalidRequest
from meshnet_node.toolcalls import formats, strict
from meshnet_node.toolcalls.common import Call, call_from_json, compact, json_end


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
    """The JSON schema the output must follow (None: free output). The arguments' schemas
    are made strict (``meshnet_node.toolcalls.strict``): no properties a schema does not
    list, free values nested only so deep."""
    if not forced(request):
        return None
    functions = {t.function.name: t.function for t in request.tools}
    name = forced_name(request)
    if name is not None:
        return strict.strict_arguments(functions[name].parameters)
    return strict.strict_calls(
        [(fn.name, fn.parameters) for fn in functions.values()],
        many=request.parallel_tool_calls is not False,
    )


def forced(request) -> bool:
    """Whether the grammar forces the call (``required`` or a named function)."""
    return active(request) and (
        forced_name(request) is not None or request.tool_choice == "required"
    )


def single(request) -> bool:
    """``parallel_tool_calls: false``: at most one call in a reply."""
    return request.parallel_tool_calls is False


def format_for(tokenizer, name: str | None = None) -> formats.ToolFormat:
    """The format ``tokenizer``'s model writes calls in: ``name`` (``--tool-call-parser``),
    else chosen from its chat template."""
    return formats.format_for(tokenizer, name)


def _call(name: str, arguments) -> dict:
    text = arguments if isinstance(arguments, str) else compact(arguments)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": text}}  # fmt: skip


@dataclass(frozen=True)
class Reply:
    """A finished reply's content and calls; ``complete``: its calls are all there (the
    model ended them, or the reply was cut after its last one), not cut by max_tokens."""

    content: str | None
    calls: list[dict]
    complete: bool = True


def parse(request, text: str, fmt: str = formats.DEFAULT) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a finished reply; ``fmt``: the parser of ``auto`` replies."""
    reply = parse_reply(request, text, fmt)
    return reply.content, reply.calls


def parse_reply(request, text: str, fmt: str = formats.DEFAULT) -> Reply:
    """A finished reply's content and calls, and whether they are complete (which makes
    its finish reason ``tool_calls`` even when generation went on after them)."""
    if not active(request):
        return Reply(text, [])
    name = forced_name(request)
    if name is not None:
        try:
            return Reply(None, [_call(name, compact(json.loads(text)))])
        except ValueError:
            return Reply(text, [], complete=False)  # cut by max_tokens: no complete call
    if request.tool_choice == "required":
        calls, complete = required_calls(text)
        if not calls:
            return Reply(text, [], complete=False)
        return Reply(None, [_call(c.name, c.arguments) for c in calls], complete)
    parser = formats.new_parser(fmt)
    pieces = cut_after_call(request, [*parser.feed(text), *parser.finish()])
    calls = [_call(p.name, p.arguments) for p in pieces if isinstance(p, Call)]
    if not calls:
        return Reply(text, [])
    content = "".join(p for p in pieces if isinstance(p, str)).strip()
    return Reply(content or None, calls, complete=single(request))


def required_calls(text: str) -> tuple[list[Call], bool]:
    """The complete calls of a ``required`` reply, ``[{"name":...,"arguments":{...}},...]``,
    and whether the list is complete.

    A call that repeats an earlier one of the reply verbatim ends the list: the model is
    looping (small models at temperature 0 write the same call until max_tokens, and the
    grammar cannot forbid repeats: llguidance has no ``uniqueItems``), and the same call
    twice brings the same answer. A list cut by max_tokens keeps its complete calls."""
    calls: list[Call] = []
    at = text.find("[") + 1
    if not at:
        return calls, False
    while True:
        while at < len(text) and text[at] in ", \n":
            at += 1
        if text.startswith("]", at):
            return calls, True
        end = json_end(text, at) if text.startswith("{", at) else None
        call = call_from_json(text[at:end]) if end is not None else None
        if call is None:
            return calls, False
        if call in calls:
            return calls, True
        calls.append(call)
        at = end


def cut_after_call(request, pieces: list) -> list:
    """With ``parallel_tool_calls: false``, the reply ends at its first call.

    ``auto`` output is free (no grammar: the model writes calls in its own format), so the
    one-call rule is kept by cutting the answer, as vLLM does: the content before the first
    call and that call are the reply; what the model wrote after it is dropped (a stream
    ends there, and stops the generation; see ``ToolStream.cut``). ``required`` is held to
    one call by its grammar (``maxItems: 1``), a named function always makes one."""
    if not single(request):
        return pieces
    for i, piece in enumerate(pieces):
        if isinstance(piece, Call):
            return pieces[: i + 1]
    return pieces


class ToolStream:
    """Streams a reply with tools as OpenAI's deltas: ``content`` text, and each tool call as
    a first delta (id, name, empty arguments) followed by ``arguments`` pieces.

    The forced forms are compact JSON the grammar fixes (a named function's arguments object;
    for ``required``, ``[{"name":...,"arguments":{...}},...]``), so they are cut as they come.
    ``auto``: the model's own format (``fmt``, ``meshnet_node.toolcalls``): text is content
    until a call begins; each call is sent whole (id, name and arguments) when it is
    complete. With ``parallel_tool_calls: false`` the reply ends at its first call: ``cut``
    turns true, and nothing more is sent."""

    def __init__(self, request, fmt: str = formats.DEFAULT) -> None:
        self.request = request
        self.name = forced_name(request)
        self.mode = "named" if self.name else request.tool_choice or "auto"
        self.parser = formats.new_parser(fmt) if self.mode == "auto" else None
        self.single = single(request)
        # the reply ends here: its one call is out (parallel_tool_calls: false), or (required)
        # the model began repeating a call
        self.cut = False
        self.buffer = ""  # text not sent yet
        self.calls = 0  # tool calls started
        self.depth = 0  # brace depth inside an arguments object (required)
        self.in_string = self.escaped = False
        self.state = "start"
        self.held: list[dict] = []  # deltas of a required call that may be a repeat
        # that call so far (name, NUL, arguments) as its pieces, and the calls made before
        # that it begins (each new piece is compared once: O(new text) a token, issue 52)
        self.current: list[str] = []
        self.current_len = 0
        self.repeats: list[str] = []
        self.made: set[str] = set()  # the calls made, so

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
        while self.buffer and not self.cut:
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
                self.held = [{"tool_calls": [self._start(match.group(1))]}]
                self.current, self.current_len, self.repeats = [], 0, list(self.made)
                self._extend(match.group(1) + "\0")
                self.buffer = self.buffer[match.end() :]
                self.state, self.depth = "args", 0
            elif self.state == "args":
                piece, end = self._scan_args()
                if piece:
                    self.held.append({"tool_calls": [self._args(self.calls - 1, piece)]})
                    self._extend(piece)
                if end is None:
                    out += self._release()
                    break
                self.buffer = self.buffer[end:]
                self.state = "between"
                call = "".join(self.current)  # once, when the call ends
                if call in self.made:  # a verbatim repeat: the model loops
                    self.held, self.cut = [], True  # (``required_calls``): the reply ends
                    self.calls -= 1
                    break
                self.made.add(call)
                out += self._release(done=True)
        return out

    def _extend(self, piece: str) -> None:
        """The call being written goes on with ``piece``; of the earlier calls, only those
        that still begin the same way may turn out repeated."""
        at = self.current_len
        self.repeats = [made for made in self.repeats if made.startswith(piece, at)]
        self.current.append(piece)
        self.current_len += len(piece)

    def _release(self, done: bool = False) -> list[dict]:
        """The held deltas of the call being written, once it differs from every earlier
        call (until then it may turn out a repeat, which is never sent)."""
        if not done and self.repeats:
            return []
        out, self.held = self.held, []
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
        return self._deltas(self.parser.feed(text))

    def _deltas(self, pieces: list) -> list[dict]:
        out: list[dict] = []
        for piece in pieces:
            if self.cut:
                break
            if isinstance(piece, Call):
                first = self._start(piece.name)
                first["function"]["arguments"] = piece.arguments
                out.append({"tool_calls": [first]})
                self.cut = self.single
            elif piece:
                out.append({"content": piece})
        return out

    def finish(self) -> list[dict]:
        """What is left when the reply ends (``auto``: an unfinished call is content)."""
        self.buffer = ""
        if self.parser is None or self.cut:
            return []
        return self._deltas(self.parser.finish())
