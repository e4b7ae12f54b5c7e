"""From an OpenAI request to the ``SamplingSpec`` the tail samples with: the model's
``generation_config.json`` defaults for what the request leaves out (as vLLM), OpenAI's
defaults after that, and the checks that need the model (token ids within the vocabulary)."""

from __future__ import annotations

from meshnet_common.errors import InvalidRequest
from meshnet_common.protocol import GrammarSpec, SamplingSpec

# generation_config.json keys that set a default for a request field of the same meaning
DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                   "repetition_penalty": 1.0}  # fmt: skip


def sampling_defaults(generation_config) -> dict[str, float]:
    """The sampling defaults a model's generation config sets explicitly (none: {})."""
    if generation_config is None:
        return {}
    explicit = generation_config.to_diff_dict()
    return {k: explicit[k] for k in DEFAULTED if explicit.get(k) is not None}


def sampling_spec(
    request, *, defaults: dict, vocab_size: int, seed: int | None, logprobs: int,
    prompt_tokens: int, prompt_logprobs: int | None = None, grammar: GrammarSpec | None = None,
) -> SamplingSpec:  # fmt: skip
    """The tail's sampling for one choice of ``request`` (``grammar``: ``grammar_of`` it,
    compiled once for all its choices)."""
    values = {}
    for name in DEFAULTED:
        given = getattr(request, name)
        values[name] = given if given is not None else defaults.get(name, OPENAI_DEFAULTS[name])
    if values["top_k"] in (-1, None):
        values["top_k"] = 0  # vLLM: -1 and 0 both mean no limit
    bias = ()
    if request.logit_bias:
        bias = tuple(sorted((int(k), float(v)) for k, v in request.logit_bias.items()))
        if any(t >= vocab_size for t, _ in bias):
            raise InvalidRequest(
                f"logit_bias token ids must lie in [0, {vocab_size})", param="logit_bias"
            )
    return SamplingSpec(
        **values,
        grammar=grammar,
        seed=seed,
        logprobs=logprobs,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        logit_bias=bias,
        prompt_tokens=prompt_tokens,
        prompt_logprobs=prompt_logprobs,
    )


def grammar_of(request, *, max_chars: int) -> GrammarSpec | None:
    """The tail's grammar for ``response_format``, or for a forced tool call (None: free);
    a schema is at most ``max_chars`` characters (--max-schema-chars)."""
    from meshnet_node.engine.constraints import json_grammar

    if getattr(request, "tools", None):
        from meshnet_node.head import tools

        schema = tools.call_schema(request)
        if schema is None:
            return None
        return json_grammar("json_schema", schema, param="tools", max_chars=max_chars)
    fmt = request.response_format
    if fmt is None or fmt.type == "text":
        return None

    schema = fmt.json_schema.schema_ if fmt.json_schema else None
    return json_grammar(fmt.type, schema, max_chars=max_chars)


def stop_token_ids(request, vocab_size: int) -> frozenset[int]:
    ids = frozenset(request.stop_token_ids or ())
    if any(t >= vocab_size for t in ids):
        raise InvalidRequest(
            f"stop_token_ids must lie in [0, {vocab_size})", param="stop_token_ids"
        )
    return ids
