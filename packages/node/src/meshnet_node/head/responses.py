"""The OpenAI response shapes of both endpoints, whole and streamed: choices, log-probs,
usage (in streams too), reasoning and tool calls, and meshnet's timing extension."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from meshnet_common.errors import MeshnetError
from meshnet_common.logs import event
from meshnet_common.metrics import Metrics
from meshnet_common.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    new_id,
    now,
    usage,
)
from meshnet_node.head import tools
from meshnet_node.head.chain import GenerationRequest
from meshnet_node.head.generation import GeneratedToken
from meshnet_node.head.text import ReasoningSplitter, TextAssembler

logger = logging.getLogger(__name__)

# A request's tokens as they come: (choice index, token)
Tokens = AsyncIterator[tuple[int, GeneratedToken]]


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


@dataclass
class Choice:
    """One finished choice of a non-streaming response."""

    index: int
    prompt_ids: tuple[int, ...]
    tokens: list[GeneratedToken]

    @property
    def text(self) -> str:
        return "".join(t.text for t in self.tokens)

    @property
    def finish_reason(self) -> str:
        return self.tokens[-1].finish_reason if self.tokens else "length"

    @property
    def timing(self) -> dict | None:
        return self.tokens[-1].timing if self.tokens else None


class ResponseShapes:
    """Writes the responses of both endpoints from generated tokens: whole (from finished
    ``Choice``s) or streamed (from the tokens as they come). ``tokenizer`` spells tokens in
    log-probs; ``reasoning_parser`` splits reasoning from content; ``tool_call_parser``
    names the tool-call format (None: from the chat template); stream errors are counted
    in ``metrics``."""

    def __init__(
        self, tokenizer, metrics: Metrics, *, reasoning_parser: str | None = None,
        tool_call_parser: str | None = None,
    ) -> None:  # fmt: skip
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.reasoning_parser = reasoning_parser
        # how the model writes calls (auto): --tool-call-parser, else from its chat template
        self.tool_format = tools.format_for(tokenizer, tool_call_parser)

    def _stream_error(self, exc: MeshnetError) -> str:
        """A stream cannot change its status: the error goes in-band, and is counted."""
        self.metrics.error(exc.status, exc.code or exc.error_type)
        event(logger, logging.WARNING, "stream ended by an error", status=exc.status,
              code=exc.code or exc.error_type, error=exc.message)  # fmt: skip
        return sse(exc.to_openai())

    # -- response shapes -------------------------------------------------------------------

    def _token_str(self, token_id: int | None) -> str:
        return "" if token_id is None else self.tokenizer.decode([token_id])

    def completion_logprobs(self, tokens: list[GeneratedToken], offset: int = 0) -> dict:
        """``offset``: where the first token's text starts in the choice's whole text
        (earlier chunks of a stream come before it)."""
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t.text)
        return {
            "tokens": [self._token_str(t.token_id) for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [self._top(t) for t in tokens],
            "text_offset": offsets,
        }

    def _top(self, token: GeneratedToken) -> dict[str, float] | None:
        """The top alternatives and the token itself (vLLM: with logprobs 0, just it); None
        for an echoed prompt's first token, which nothing scores."""
        if token.logprob is None:
            return None
        top = {self._token_str(i): lp for i, lp in token.top_logprobs}
        if token.token_id is not None:
            top.setdefault(self._token_str(token.token_id), token.logprob)
        return top

    def chat_logprobs(self, tokens: list[GeneratedToken]) -> dict:
        return {
            "content": [
                {
                    "token": self._token_str(t.token_id),
                    "logprob": t.logprob,
                    "top_logprobs": [
                        {"token": self._token_str(i), "logprob": lp} for i, lp in t.top_logprobs
                    ],
                }
                for t in tokens
            ]
        }

    def echoed(self, request: CompletionRequest, prompt_ids, first: GeneratedToken | None):
        """The prompt as a choice's first tokens, when ``echo`` asks for it: text pieces
        that join to the prompt's text and, from ``first`` (the first generated token,
        which brings the tail's scores), each token's log-probability after the ones
        before it. The first prompt token has none."""
        if not request.echo:
            return []
        scored = (first.prompt_logprobs if first is not None else None) or []
        assembler = TextAssembler(self.tokenizer, (), skip_special_tokens=True)
        tokens = []
        for k, token_id in enumerate(prompt_ids):
            text, _ = assembler.add(token_id)
            if k == len(prompt_ids) - 1:
                text += assembler.finish()
            logprob, top = scored[k - 1] if 0 < k <= len(scored) else (None, [])
            tokens.append(GeneratedToken(token_id, text, logprob, top))
        return tokens

    @staticmethod
    def generated(request: CompletionRequest, tokens: list[GeneratedToken]):
        """What a choice shows of its generated tokens: none when it only scores the prompt."""
        return [] if request.scores_only else tokens

    def completion_response(self, request: CompletionRequest, choices: list[Choice]) -> dict:
        out = []
        for c in choices:
            shown = self.echoed(request, c.prompt_ids, c.tokens[0] if c.tokens else None)
            shown += self.generated(request, c.tokens)
            out.append({
                "index": c.index,
                "text": "".join(t.text for t in shown),
                "logprobs": (
                    self.completion_logprobs(shown) if request.logprobs is not None else None
                ),
                "finish_reason": "length" if request.scores_only else c.finish_reason,
            })  # fmt: skip
        generated = sum(len(self.generated(request, c.tokens)) for c in choices)
        return {
            "id": new_id("cmpl"),
            "object": "text_completion",
            "created": now(),
            "model": request.model,
            "choices": out,
            "usage": choices_usage(choices, generated),
            **timing_field(choices),
        }

    def splitter(self, request) -> ReasoningSplitter | None:
        """The reasoning parser of a reply (None: no reasoning; a forced tool call is JSON
        from its first token, the grammar leaves no room for any)."""
        if self.reasoning_parser is None or tools.forced(request):
            return None
        return ReasoningSplitter(self.reasoning_parser)

    def tool_text(self, request, token: GeneratedToken) -> str:
        """A token's text, with the marker token the model's call format needs put back
        when decoding dropped it as a special token (``auto`` tool calls only)."""
        if tools.active(request) and not tools.forced(request):
            return self.tool_format.text(token.token_id, token.text)
        return token.text

    def _message(self, request, text: str) -> dict:
        if self.reasoning_parser is None:
            return {"role": "assistant", "content": text}
        splitter = self.splitter(request)
        reasoning, content = splitter.split(text) if splitter else (None, text)
        # vLLM's current name (``reasoning``) beside the older one (``reasoning_content``)
        return {"role": "assistant", "content": content or None,
                "reasoning_content": reasoning, "reasoning": reasoning}  # fmt: skip

    def _chat_choice(self, request, tokens: list[GeneratedToken], finish: str | None) -> dict:
        """``message`` (content, reasoning, tool calls) and ``finish_reason`` of one choice."""
        message = self._message(request, "".join(self.tool_text(request, t) for t in tokens))
        if tools.active(request):
            reply = tools.parse_reply(request, message["content"] or "", self.tool_format.name)
            message["content"] = reply.content
            if reply.calls:
                message["tool_calls"] = reply.calls
                finish = "tool_calls" if finish == "stop" or reply.complete else finish
        return {"message": message, "finish_reason": finish}

    def chat_response(self, request: ChatCompletionRequest, choices: list[Choice]) -> dict:
        return {
            "id": new_id("chatcmpl"),
            "object": "chat.completion",
            "created": now(),
            "model": request.model,
            "choices": [
                {
                    "index": c.index,
                    **self._chat_choice(request, c.tokens, c.finish_reason),
                    "logprobs": self.chat_logprobs(c.tokens) if request.logprobs else None,
                }
                for c in choices
            ],
            "usage": choices_usage(choices),
        }

    async def completion_stream(
        self, request: CompletionRequest, jobs: list[GenerationRequest], tokens: Tokens
    ) -> AsyncIterator[str]:
        """The SSE events of a completion: a chunk per token (the echoed prompt first), the
        usage if asked, an error in-band, then ``[DONE]``."""
        rid, created = new_id("cmpl"), now()
        counts = [0] * len(jobs)
        usage_of = StreamUsage(request, jobs, counts)
        offsets = [0] * len(jobs)  # text_offset continues across chunks

        def chunk(index: int, tokens: list[GeneratedToken], finish) -> str:
            logprobs = None
            if request.logprobs is not None:
                logprobs = self.completion_logprobs(tokens, offsets[index])
            text = "".join(t.text for t in tokens)
            offsets[index] += len(text)
            return sse({
                "id": rid, "object": "text_completion", "created": created,
                "model": request.model, "choices": [{
                    "index": index, "text": text, "logprobs": logprobs,
                    "finish_reason": finish}], **usage_of(False),
            })  # fmt: skip

        started: set[int] = set()
        try:
            async for index, tok in tokens:
                usage_of.saw(index, tok)
                if request.echo and index not in started:
                    # the prompt first: its scores come with the first token
                    prompt = self.echoed(request, jobs[index].prompt_ids, tok)
                    yield chunk(index, prompt, "length" if request.scores_only else None)
                started.add(index)
                if request.scores_only:
                    continue
                counts[index] += 1
                yield chunk(index, [tok], tok.finish_reason)
            if usage_of.final:
                yield sse({
                    "id": rid, "object": "text_completion", "created": created,
                    "model": request.model, "choices": [], **usage_of(True),
                })  # fmt: skip
        except MeshnetError as exc:
            yield self._stream_error(exc)
        except Exception as exc:  # a stream cannot change its status: report in-band
            logger.exception("stream failed")
            self.metrics.error(500, "internal_error")
            yield sse({"error": {"message": str(exc), "type": "internal_error", "param": None,
                                 "code": None}})  # fmt: skip
        yield sse("[DONE]")

    async def chat_stream(
        self, request: ChatCompletionRequest, jobs: list[GenerationRequest], tokens: Tokens
    ) -> AsyncIterator[str]:
        """The SSE events of a chat completion: the role, a delta per token (content,
        reasoning, tool calls), the usage if asked, an error in-band, then ``[DONE]``."""
        rid, created = new_id("chatcmpl"), now()
        counts = [0] * len(jobs)
        usage_of = StreamUsage(request, jobs, counts)

        def chunk(index: int, delta: dict, finish=None, logprobs=None) -> str:
            return sse({
                "id": rid, "object": "chat.completion.chunk", "created": created,
                "model": request.model,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                             "finish_reason": finish}], **usage_of(False),
            })  # fmt: skip

        try:
            for index in range(len(jobs)):
                yield chunk(index, {"role": "assistant", "content": ""})
            replies = [ChatReply(self, request) for _ in jobs]
            async for index, tok in tokens:
                counts[index] += 1
                usage_of.saw(index, tok)
                reply = replies[index]
                if reply.ended:
                    continue  # cut after its one call (parallel_tool_calls: false)
                logprobs = self.chat_logprobs([tok]) if request.logprobs else None
                deltas, finish = reply.feed(tok)
                for i, delta in enumerate(deltas):
                    last = i == len(deltas) - 1
                    yield chunk(index, delta, finish if last else None, logprobs if last else None)
                if not deltas and (finish is not None or logprobs):
                    yield chunk(index, {}, finish, logprobs)
                if all(r.ended for r in replies):
                    break  # every reply is complete: the rest would be cut anyway
            if (aclose := getattr(tokens, "aclose", None)) is not None:
                await aclose()  # a reply cut early stops its generation
            if usage_of.final:
                yield sse({
                    "id": rid, "object": "chat.completion.chunk", "created": created,
                    "model": request.model, "choices": [], **usage_of(True),
                })  # fmt: skip
        except MeshnetError as exc:
            yield self._stream_error(exc)
        except Exception as exc:
            logger.exception("stream failed")
            self.metrics.error(500, "internal_error")
            yield sse({"error": {"message": str(exc), "type": "internal_error", "param": None,
                                 "code": None}})  # fmt: skip
        yield sse("[DONE]")


class ChatReply:
    """One streamed chat choice: its text through the reasoning parser, then through the
    tool-call stream. ``feed`` returns the deltas a token completes and the finish reason
    to send with the last; ``ended`` once the choice has nothing more to send (its last
    token, or its one call with ``parallel_tool_calls: false``)."""

    def __init__(self, shapes: ResponseShapes, request: ChatCompletionRequest) -> None:
        self.shapes = shapes
        self.request = request
        self.splitter = shapes.splitter(request)
        self.tools = (
            tools.ToolStream(request, shapes.tool_format.name) if tools.active(request) else None
        )
        self.called = False  # a call was sent
        self.ended = False

    def feed(self, token: GeneratedToken) -> tuple[list[dict], str | None]:
        final = token.finish_reason is not None
        text = self.shapes.tool_text(self.request, token)
        reasoning, content = "", text
        if self.splitter is not None:
            reasoning, content = self.splitter.feed(text, final=final)
        said = {"reasoning_content": reasoning, "reasoning": reasoning} if reasoning else {}
        self.ended = final
        if self.tools is None:  # a delta per token, as before
            delta = {"content": content} if content or self.splitter is None else {}
            return [{**delta, **said}], token.finish_reason
        deltas = [said] if said else []
        deltas += self.tools.feed(content)
        if final:
            deltas += self.tools.finish()
        self.called |= any("tool_calls" in d for d in deltas)
        finish = token.finish_reason
        if self.tools.cut:  # its one call is out: the reply ends here
            finish, self.ended = "tool_calls", True
        elif finish == "stop" and self.called:
            finish = "tool_calls"
        return deltas, finish


class StreamUsage:
    """The ``usage`` field of stream chunks: with ``include_usage``, null on every chunk and
    the totals on a last chunk of its own; with ``continuous_usage_stats`` (vLLM), the running
    totals on every chunk; without stream options, absent."""

    def __init__(self, request, jobs, counts: list[int]) -> None:
        options = request.stream_options
        self.final = bool(options and options.include_usage)
        self.continuous = bool(options and options.continuous_usage_stats)
        self.prompt = sum(len(p) for p in {tuple(j.prompt_ids) for j in jobs})
        self.counts = counts
        self.prompts = [tuple(j.prompt_ids) for j in jobs]
        self.cached: dict[int, int] = {}  # choice -> prompt tokens from the prefix cache

    def saw(self, index: int, token) -> None:
        if token.cached_tokens is not None:
            self.cached[index] = token.cached_tokens

    def __call__(self, last: bool) -> dict:
        if last or self.continuous:
            cached = cached_once((self.prompts[i], n) for i, n in self.cached.items())
            return {"usage": usage(self.prompt, sum(self.counts), cached)}
        return {"usage": None} if self.final else {}


def cached_once(pairs) -> int:
    """Cached prompt tokens, a prompt sampled n times counted once (as its tokens are)."""
    best: dict[tuple, int] = {}
    for prompt, cached in pairs:
        best[prompt] = max(best.get(prompt, 0), cached)
    return sum(best.values())


def timing_field(choices: list) -> dict:
    """meshnet's extension field: where the first choice's decode time went (see README)."""
    timing = choices[0].timing if choices else None
    return {"meshnet_timing": timing} if timing else {}


def choices_usage(choices: list, generated: int | None = None) -> dict:
    # Like OpenAI, a prompt sampled n times counts once.
    prompt = sum(len(ids) for ids in {c.prompt_ids for c in choices})
    cached = cached_once((c.prompt_ids, (c.tokens[0].cached_tokens or 0) if c.tokens else 0)
                         for c in choices)  # fmt: skip
    completion = sum(len(c.tokens) for c in choices) if generated is None else generated
    return usage(prompt, completion, cached)
