"""The OpenAI response shapes of both endpoints, whole and streamed: choices, log-probs,
usage (in streams too), reasoning and tool calls, and meshnet's timing extension.
``ResponseShapes`` is the half of ``OpenAIServing`` that writes responses."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from meshnet_common.errors import MeshnetError
from meshnet_common.logs import event
from meshnet_common.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    new_id,
    now,
    usage,
)
from meshnet_node.head import tools
from meshnet_node.head.generation import GeneratedToken
from meshnet_node.head.reasoning import ReasoningSplitter

if TYPE_CHECKING:
    from meshnet_node.head.serving import Choice

logger = logging.getLogger("meshnet_node.head.serving")


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


class ResponseShapes:
    """Response writing for ``OpenAIServing`` (which provides ``tokenizer``, ``generator``,
    ``reasoning_parser`` and ``stream``)."""

    def _stream_error(self, exc: MeshnetError) -> str:
        """A stream cannot change its status: the error goes in-band, and is counted."""
        self.generator.service.metrics.error(exc.status, exc.code or exc.error_type)
        event(logger, logging.WARNING, "stream ended by an error", status=exc.status,
              code=exc.code or exc.error_type, error=exc.message)  # fmt: skip
        return sse(exc.to_openai())

    # -- response shapes -------------------------------------------------------------------

    def _token_str(self, token_id: int | None) -> str:
        return "" if token_id is None else self.tokenizer.decode([token_id])

    def completion_logprobs(self, tokens: list[GeneratedToken], offset: int = 0) -> dict:
        """``offset``: where the first token's text starts in the choice's whole text (the
        echoed prompt, and earlier chunks of a stream, come before it)."""
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

    def _top(self, token: GeneratedToken) -> dict[str, float]:
        """The top alternatives and the sampled token (vLLM: with logprobs 0, just it)."""
        top = {self._token_str(i): lp for i, lp in token.top_logprobs}
        if token.token_id is not None and token.logprob is not None:
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

    def _echoed(self, request: CompletionRequest, jobs_prompts) -> list[str]:
        """The text each choice starts with: its prompt, when ``echo`` asks for it."""
        if not request.echo:
            return [""] * len(jobs_prompts)
        return [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in jobs_prompts]

    def completion_response(self, request: CompletionRequest, choices: list[Choice]) -> dict:
        echoed = self._echoed(request, [c.prompt_ids for c in choices])
        return {
            "id": new_id("cmpl"),
            "object": "text_completion",
            "created": now(),
            "model": request.model,
            "choices": [
                {
                    "index": c.index,
                    "text": echoed[c.index] + c.text,
                    "logprobs": (
                        self.completion_logprobs(c.tokens, len(echoed[c.index]))
                        if request.logprobs is not None
                        else None
                    ),
                    "finish_reason": c.finish_reason,
                }
                for c in choices
            ],
            "usage": choices_usage(choices),
            **timing_field(choices),
        }

    def _message(self, text: str) -> dict:
        if self.reasoning_parser is None:
            return {"role": "assistant", "content": text}
        reasoning, content = ReasoningSplitter(self.reasoning_parser).split(text)
        return {"role": "assistant", "content": content or None, "reasoning_content": reasoning}

    def _chat_choice(self, request, text: str, finish: str | None) -> dict:
        """``message`` (content, reasoning, tool calls) and ``finish_reason`` of one choice."""
        message = self._message(text)
        if tools.active(request):
            content, calls = tools.parse(request, message["content"] or "")
            message["content"] = content
            if calls:
                message["tool_calls"] = calls
                finish = "tool_calls" if finish == "stop" else finish
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
                    **self._chat_choice(request, c.text, c.finish_reason),
                    "logprobs": self.chat_logprobs(c.tokens) if request.logprobs else None,
                }
                for c in choices
            ],
            "usage": choices_usage(choices),
        }

    async def completion_stream(self, request: CompletionRequest, jobs, route=None):
        rid, created = new_id("cmpl"), now()
        counts = [0] * len(jobs)
        usage_of = StreamUsage(request, jobs, counts)
        echoed = self._echoed(request, [j.prompt_ids for j in jobs])
        offsets = [len(e) for e in echoed]  # text_offset continues across chunks
        try:
            for index, text in enumerate(echoed):
                if text:
                    yield sse({
                        "id": rid, "object": "text_completion", "created": created,
                        "model": request.model, "choices": [{
                            "index": index, "text": text, "logprobs": None,
                            "finish_reason": None}], **usage_of(False),
                    })  # fmt: skip
            async for index, tok in self.stream(jobs, route):
                counts[index] += 1
                logprobs = (
                    self.completion_logprobs([tok], offsets[index])
                    if request.logprobs is not None
                    else None
                )
                offsets[index] += len(tok.text)
                yield sse({
                    "id": rid, "object": "text_completion", "created": created,
                    "model": request.model,
                    "choices": [{
                        "index": index, "text": tok.text, "logprobs": logprobs,
                        "finish_reason": tok.finish_reason,
                    }], **usage_of(False),
                })  # fmt: skip
            if usage_of.final:
                yield sse({
                    "id": rid, "object": "text_completion", "created": created,
                    "model": request.model, "choices": [], **usage_of(True),
                })  # fmt: skip
        except MeshnetError as exc:
            yield self._stream_error(exc)
        except Exception as exc:  # a stream cannot change its status: report in-band
            logger.exception("stream failed")
            self.generator.service.metrics.error(500, "internal_error")
            yield sse({"error": {"message": str(exc), "type": "internal_error", "param": None,
                                 "code": None}})  # fmt: skip
        yield sse("[DONE]")

    async def chat_stream(self, request: ChatCompletionRequest, jobs, route=None):
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
            splitters = [
                ReasoningSplitter(self.reasoning_parser) if self.reasoning_parser else None
                for _ in jobs
            ]
            streams = [tools.ToolStream(request) if tools.active(request) else None
                       for _ in jobs]  # fmt: skip
            called = [False] * len(jobs)
            async for index, tok in self.stream(jobs, route):
                counts[index] += 1
                logprobs = self.chat_logprobs([tok]) if request.logprobs else None
                if streams[index] is not None:
                    deltas = streams[index].feed(tok.text)
                    if tok.finish_reason is not None:
                        deltas += streams[index].finish()
                    called[index] |= any("tool_calls" in d for d in deltas)
                    finish = tok.finish_reason
                    if finish == "stop" and called[index]:
                        finish = "tool_calls"
                    for i, delta in enumerate(deltas):
                        last = i == len(deltas) - 1
                        yield chunk(index, delta, finish if last else None,
                                    logprobs if last else None)  # fmt: skip
                    if not deltas and (tok.finish_reason is not None or logprobs):
                        yield chunk(index, {}, finish, logprobs)
                    continue
                delta: dict = {"content": tok.text}
                if splitters[index] is not None:
                    final = tok.finish_reason is not None
                    reasoning, content = splitters[index].feed(tok.text, final=final)
                    delta = {"content": content} if content else {}
                    if reasoning:
                        delta["reasoning_content"] = reasoning
                yield chunk(index, delta, tok.finish_reason, logprobs)
            if usage_of.final:
                yield sse({
                    "id": rid, "object": "chat.completion.chunk", "created": created,
                    "model": request.model, "choices": [], **usage_of(True),
                })  # fmt: skip
        except MeshnetError as exc:
            yield self._stream_error(exc)
        except Exception as exc:
            logger.exception("stream failed")
            self.generator.service.metrics.error(500, "internal_error")
            yield sse({"error": {"message": str(exc), "type": "internal_error", "param": None,
                                 "code": None}})  # fmt: skip
        yield sse("[DONE]")


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

    def __call__(self, last: bool) -> dict:
        if last or self.continuous:
            return {"usage": usage(self.prompt, sum(self.counts))}
        return {"usage": None} if self.final else {}


def timing_field(choices: list) -> dict:
    """meshnet's extension field: where the first choice's decode time went (see README)."""
    timing = choices[0].timing if choices else None
    return {"meshnet_timing": timing} if timing else {}


def choices_usage(choices: list) -> dict:
    # Like OpenAI, a prompt sampled n times counts once.
    prompt = sum(len(ids) for ids in {c.prompt_ids for c in choices})
    return usage(prompt, sum(len(c.tokens) for c in choices))
