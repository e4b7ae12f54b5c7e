"""OpenAI-compatible completions and chat on a head node (the tracker node uses it too)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from meshnet_common.errors import CapacityExceeded, Draining, InvalidRequest, NotFound
from meshnet_common.logs import event
from meshnet_common.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestBounds,
)
from meshnet_common.tokenize_protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeRequest,
    tokenize_response,
)
from meshnet_node.head import tools
from meshnet_node.head.chain import GenerationRequest
from meshnet_node.head.generation import GeneratedToken, HeadGenerator
from meshnet_node.head.params import grammar_of, sampling_spec, stop_token_ids
from meshnet_node.head.preparing import templates
from meshnet_node.head.preparing.pool import PreparePool
from meshnet_node.head.queue import CAPACITY_CODES, RequestQueue
from meshnet_node.head.responses import Choice, ResponseShapes, Tokens

logger = logging.getLogger(__name__)

# (model id, hop URLs to avoid) -> URLs of the hops after this head
RouteProvider = Callable[[str, frozenset[str]], Awaitable[tuple[str, ...]]]

# Planning a request (tokenizing its prompts, its chat template, compiling its grammar) runs
# on these threads, never on the event loop, and answers 400 beyond --prepare-timeout.
PREPARE_THREADS = 2
T = TypeVar("T")


class OpenAIServing:
    """Turns OpenAI requests into generations through the head and a route; ``responses``
    writes what they generate as OpenAI responses."""

    def __init__(
        self,
        model_id: str,
        generator: HeadGenerator,
        route_provider: RouteProvider,
        *,
        served_names: tuple[str, ...] = (),
        max_model_len: int | None = None,
        created: int = 0,
        reasoning_parser: str | None = None,
        queue: RequestQueue | None = None,
        keyed_clients: bool | None = None,
    ):
        self.model_id = model_id
        self.generator = generator
        self.tokenizer = generator.tokenizer
        self.route_provider = route_provider
        self.names = tuple(served_names) or (model_id,)  # what clients may call it
        self.max_model_len = max_model_len
        self.created = created
        self.responses = ResponseShapes(
            generator.tokenizer, generator.metrics, reasoning_parser=reasoning_parser,
            tool_call_parser=generator.settings.tool_call_parser,
        )  # fmt: skip
        self.metrics = generator.metrics
        self.queue = queue or RequestQueue()
        settings = generator.settings
        # whether clients authenticate with an API key (``routes.client_of`` keys the queue
        # on it; None: as this node's settings say)
        keyed = bool(settings.api_key or settings.api_key_file)
        self.keyed_clients = keyed if keyed_clients is None else keyed_clients
        self.swarm_token = settings.swarm_token  # the tracker proxying
        self.bounds = RequestBounds(  # what one request may ask (issue #35)
            max_prompts=settings.max_prompts, max_choices=settings.max_choices,
            max_stop_chars=settings.max_stop_chars, max_schema_chars=settings.max_schema_chars,
        )  # fmt: skip
        self.preparing = PreparePool(PREPARE_THREADS, settings.prepare_timeout_s)
        self.metrics.watch_queue(lambda: self.queue.waiting)

    @property
    def context_window(self) -> int:
        """Longest prompt + completion: the model's context, capped by --max-model-len and
        by this node's KV budget (a longer request could never run, even alone)."""
        window = min(self.generator.context_window, self.generator.kv_budget_tokens)
        return min(window, self.max_model_len) if self.max_model_len else window

    def model_cards(self) -> list[dict]:
        """/v1/models entries: one per served name."""
        return [
            {"id": name, "object": "model", "created": self.created, "owned_by": "meshnet",
             "root": self.model_id, "max_model_len": self.context_window}
            for name in self.names
        ]  # fmt: skip

    async def _reroute(self, exclude: frozenset[str]) -> tuple[str, ...]:
        return await self.route_provider(self.model_id, exclude)

    async def route(self) -> tuple[str, ...]:
        """A route for a new request; missing layers expected back are waited for, for up
        to --coverage-wait (docs/adr/0023)."""
        if self.generator.draining is not None:  # leaving the swarm: no new requests
            raise Draining(self.generator.draining)
        return await self.generator.route(self._reroute)

    def check_model(self, model: str) -> None:
        if model != self.model_id and model not in self.names:
            raise NotFound(
                f"model {model!r} is not served here (serving {', '.join(self.names)})",
                param="model",
                code="model_not_found",
            )

    # -- prompt preparation ----------------------------------------------------------------

    def _prompts(self, request: CompletionRequest) -> list[list[int]]:
        """Token ids of each prompt: text, texts, token ids, or lists of token ids."""
        prompt = request.prompt
        vocab = self.generator.vocab_size
        if isinstance(prompt, str):
            prompts = [prompt]
        elif prompt and all(isinstance(p, str) for p in prompt):
            prompts = list(prompt)
        else:
            if prompt and all(isinstance(p, int) for p in prompt):
                ids = [list(prompt)]
            elif prompt and all(isinstance(p, list) and p for p in prompt):
                ids = [list(p) for p in prompt]
            else:
                raise InvalidRequest(
                    "prompt must be a string, strings, token ids or lists of token ids",
                    param="prompt",
                )
            if any(not isinstance(i, int) or not 0 <= i < vocab for p in ids for i in p):
                raise InvalidRequest(f"token ids must lie in [0, {vocab})", param="prompt")
            return ids
        try:
            out = [self.tokenizer(p, add_special_tokens=True).input_ids for p in prompts]
        except (TypeError, ValueError) as exc:  # e.g. lone surrogates from JSON escapes
            raise InvalidRequest(f"prompt is not valid text: {exc}", param="prompt") from exc
        if any(not ids for ids in out):
            raise InvalidRequest("prompt is empty", param="prompt")
        return out

    def _chat_prompt(self, request: ChatCompletionRequest, *, special: bool = False) -> list[int]:
        """The chat's token ids; ``special``: its rendered text tokenized with the special
        tokens a plain prompt gets (vLLM's ``add_special_tokens`` on /tokenize)."""
        messages = [m.for_template() for m in request.messages]
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequest("this model has no chat template", param="messages")
        kwargs = templates.client_kwargs(self.tokenizer, request.chat_template_kwargs)
        tools.check(request, self.tokenizer.chat_template)
        messages, shown = tools.render(request, messages, self.tokenizer.chat_template)
        kwargs.update(shown)
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message, tokenize=not special,
                return_dict=False, **kwargs,
            )  # fmt: skip
            if special:
                ids = self.tokenizer(ids, add_special_tokens=True).input_ids
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"messages are not valid text: {exc}", param="messages") from exc
        except Exception as exc:  # the template's own checks (jinja raise_exception)
            raise InvalidRequest(f"the chat template refused: {exc}", param="messages") from exc
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def _generation(self, request, prompt_ids: list[int], index: int, logprobs: int, grammar):
        # echo with logprobs: the tail scores the prompt's tokens too
        scores_prompt = getattr(request, "echo", False) and request.logprobs is not None
        max_tokens = request.check(
            context_window=self.context_window, prompt_tokens=len(prompt_ids), bounds=self.bounds
        )
        seed = None if request.seed is None else request.seed + index
        vocab = self.generator.vocab_size
        return GenerationRequest(
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            sampling=sampling_spec(
                request,
                defaults=self.generator.sampling_defaults,
                vocab_size=vocab,
                seed=seed,
                logprobs=logprobs,
                prompt_tokens=len(prompt_ids),
                prompt_logprobs=logprobs if scores_prompt else None,
                grammar=grammar,
            ),  # fmt: skip
            stop=tuple(request.stop_list),
            cache_salt=request.cache_salt,
            stop_ids=stop_token_ids(request, vocab),
            ignore_eos=request.ignore_eos,
            skip_special_tokens=(
                self.generator.skip_special_tokens
                if request.skip_special_tokens is None
                else request.skip_special_tokens
            ),
        )

    def completion_jobs(self, request: CompletionRequest) -> list[GenerationRequest]:
        self.check_model(request.model)
        request.check_params(bounds=self.bounds)
        logprobs = request.logprobs or 0
        grammar = grammar_of(request, max_chars=self.bounds.max_schema_chars)  # once for all
        jobs = []
        for prompt_ids in self._prompts(request):
            for _ in range(request.n):
                jobs.append(self._generation(request, prompt_ids, len(jobs), logprobs, grammar))
        return jobs

    def chat_jobs(self, request: ChatCompletionRequest) -> list[GenerationRequest]:
        self.check_model(request.model)
        request.check_params(bounds=self.bounds)
        if request.max_completion_tokens is not None and request.max_tokens is None:
            request = request.model_copy(update={"max_tokens": request.max_completion_tokens})
        logprobs = (request.top_logprobs or 1) if request.logprobs else 0
        if request.top_logprobs is not None and not 0 <= request.top_logprobs <= 20:
            raise InvalidRequest("top_logprobs must be between 0 and 20", param="top_logprobs")
        prompt_ids = self._chat_prompt(request)
        grammar = grammar_of(request, max_chars=self.bounds.max_schema_chars)
        return [
            self._generation(request, prompt_ids, i, logprobs, grammar) for i in range(request.n)
        ]

    async def prepare(
        self, request: CompletionRequest | ChatCompletionRequest
    ) -> list[GenerationRequest]:
        """The generations of ``request``, planned on a thread (the event loop keeps serving
        while prompts are tokenized and a grammar compiles), within --prepare-timeout."""
        chat = isinstance(request, ChatCompletionRequest)
        if getattr(request, "tools", None):
            param = "tools"
        elif request.response_format is not None:
            param = "response_format"
        else:
            param = "messages" if chat else "prompt"
        plan = self.chat_jobs if chat else self.completion_jobs
        return await self.off_loop(plan, request, param=param)

    async def off_loop(self, work: Callable[..., T], *args, param: str) -> T:
        """``work(*args)`` on the preparing threads, never on the event loop, within
        --prepare-timeout (beyond: 400 ``request_too_complex`` naming ``param``; 503
        while every thread is held, ``meshnet_node.head.preparing.pool``)."""
        return await self.preparing.run(work, *args, param=param)

    # -- tokenizer endpoints (vLLM's /tokenize and /detokenize) ------------------------------

    async def tokenize(self, request: TokenizeRequest) -> dict:
        """The token ids a text or a chat becomes here, as vLLM answers /tokenize."""
        if request.model is not None:
            self.check_model(request.model)
        param = "messages" if isinstance(request, TokenizeChatRequest) else "prompt"
        ids, strs = await self.off_loop(self._tokenize, request, param=param)
        return tokenize_response(ids, self.context_window, strs)

    def _tokenize(self, request: TokenizeRequest) -> tuple[list[int], list[str] | None]:
        """The ids, and their pieces when asked (on a preparing thread)."""
        if isinstance(request, TokenizeChatRequest):
            ids = self._tokenize_chat(request)
        else:
            try:
                ids = self.tokenizer(request.prompt, add_special_tokens=request.add_special_tokens)
            except (TypeError, ValueError) as exc:  # e.g. lone surrogates from JSON escapes
                raise InvalidRequest(f"prompt is not valid text: {exc}", param="prompt") from exc
            ids = list(ids.input_ids)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return ids, strs

    def _tokenize_chat(self, request: TokenizeChatRequest) -> list[int]:
        chat = ChatCompletionRequest(
            model=self.model_id, messages=request.messages, tools=request.tools,
            chat_template_kwargs=request.chat_template_kwargs,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
        )  # fmt: skip
        return self._chat_prompt(chat, special=request.add_special_tokens)

    async def detokenize(self, request: DetokenizeRequest) -> dict:
        """The text of token ids, as vLLM answers /detokenize (special tokens included)."""
        if request.model is not None:
            self.check_model(request.model)
        vocab = self.generator.vocab_size
        bad = next((t for t in request.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(
                f"token id {bad} is out of vocabulary: ids lie in [0, {vocab})", param="tokens"
            )
        return {"prompt": await self.off_loop(self._decode, request.tokens, param="tokens")}

    def _decode(self, ids: list[int]) -> str:
        try:
            return self.tokenizer.decode(ids)
        except (TypeError, ValueError, OverflowError) as exc:
            raise InvalidRequest(f"tokens cannot be decoded: {exc}", param="tokens") from exc

    # -- running ---------------------------------------------------------------------------

    async def _generate(self, job: GenerationRequest, route) -> AsyncIterator[GeneratedToken]:
        """One generation, counted in the metrics and logged as one event when it ends.

        While it has produced nothing, a chain without room (a full KV budget or session
        limit, here or downstream) makes it wait in the queue for a turn and run again."""
        metrics = self.metrics
        metrics.prompt_tokens.inc(len(job.prompt_ids))
        started, tokens, finish = time.perf_counter(), 0, "error"
        deadline = self.queue.clock() + self.queue.timeout_s
        try:
            if self.queue.busy():  # others wait already: queue behind them
                await self._wait(job, deadline, again=False)
            while True:
                last = None
                metrics.requests_running.inc()
                try:
                    async for tok in self.generator.generate(job, route, self._reroute):
                        now_s = time.perf_counter()
                        if last is None:
                            metrics.ttft_seconds.observe(now_s - started)
                        else:
                            metrics.itl_seconds.observe(now_s - last)
                        last = now_s
                        tokens += 1
                        metrics.tokens_generated.inc()
                        finish = tok.finish_reason or finish
                        yield tok
                    break
                except CapacityExceeded as exc:
                    if tokens or exc.code not in CAPACITY_CODES:
                        raise
                finally:
                    metrics.requests_running.dec()
                await self._wait(job, deadline, again=True)
                route = await self.route()
            self.queue.wake()  # room may have freed for the next in line
        except asyncio.CancelledError:
            finish = "cancelled"
            self.queue.wake()
            raise
        finally:
            seconds = time.perf_counter() - started
            event(
                logger, logging.INFO, "generation done",
                prompt_tokens=len(job.prompt_ids), tokens=tokens, finish=finish,
                seconds=round(seconds, 3), tokens_per_s=round(tokens / max(seconds, 1e-9), 1),
                hops=len(route),
            )  # fmt: skip

    async def _wait(self, job: GenerationRequest, deadline: float, *, again: bool) -> None:
        started = time.perf_counter()
        try:
            await self.queue.wait(job.client, deadline, again=again, user=job.user)
        finally:
            self.metrics.queue_seconds.observe(time.perf_counter() - started)

    async def _run_one(self, job: GenerationRequest, route) -> list[GeneratedToken]:
        return [tok async for tok in self._generate(job, route)]

    async def run(self, jobs: list[GenerationRequest], route=None) -> list[Choice]:
        if route is None:
            route = await self.route()
        tasks = [asyncio.ensure_future(self._run_one(job, route)) for job in jobs]
        try:
            results = await asyncio.gather(*tasks)
        finally:  # one failure (or the client leaving) ends every generation of the request
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return [
            Choice(i, tuple(job.prompt_ids), toks)
            for i, (job, toks) in enumerate(zip(jobs, results, strict=True))
        ]

    async def stream(self, jobs: list[GenerationRequest], route=None) -> Tokens:
        """Tokens of all jobs as they come, tagged with the choice index."""
        if route is None:
            route = await self.route()
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(index: int, job: GenerationRequest) -> None:
            try:
                async for tok in self._generate(job, route):
                    await queue.put((index, tok))
            except BaseException as exc:  # surfaced to the consumer below
                await queue.put(exc)
            finally:
                await queue.put(done)

        tasks = [asyncio.ensure_future(pump(i, job)) for i, job in enumerate(jobs)]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- responses -------------------------------------------------------------------------

    def completion_response(self, request: CompletionRequest, choices: list[Choice]) -> dict:
        return self.responses.completion_response(request, choices)

    def chat_response(self, request: ChatCompletionRequest, choices: list[Choice]) -> dict:
        return self.responses.chat_response(request, choices)

    def completion_stream(
        self, request: CompletionRequest, jobs: list[GenerationRequest], route=None
    ) -> AsyncIterator[str]:
        """The SSE events of the completion ``jobs`` generate (``route``: None, one for
        them all, found once the stream starts)."""
        return self.responses.completion_stream(request, jobs, self.stream(jobs, route))

    def chat_stream(
        self, request: ChatCompletionRequest, jobs: list[GenerationRequest], route=None
    ) -> AsyncIterator[str]:
        """The SSE events of the chat completion ``jobs`` generate."""
        return self.responses.chat_stream(request, jobs, self.stream(jobs, route))
