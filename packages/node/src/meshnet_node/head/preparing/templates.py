"""What a client may hand the model's chat template: ``chat_template_kwargs`` names only
variables that template reads (as vLLM does after CVE-2025-61620), never one the renderer
sets itself (``TEMPLATE_RESERVED``: ``chat_template``, ``tokenize``, ``messages``, the
special tokens...). Anything else is a 400 naming the key, so a client never runs Jinja of
its own, and a key the template would ignore is never silently dropped."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from jinja2 import TemplateSyntaxError, meta, nodes
from jinja2.defaults import DEFAULT_NAMESPACE
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from meshnet_common.errors import InvalidRequest
from meshnet_common.openai_protocol import TEMPLATE_RESERVED, UNSUPPORTED, check_template_kwargs
from meshnet_node.toolcalls.formats import template_text


class _GenerationTag(Extension):
    """Parses transformers' ``{% generation %}...{% endgeneration %}`` (its body only)."""

    tags = {"generation"}

    def parse(self, parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


JINJA_GLOBALS = frozenset(DEFAULT_NAMESPACE)  # range, dict, namespace...: never shadowed
_PARSER = ImmutableSandboxedEnvironment(extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])


@lru_cache(maxsize=8)
def template_variables(template: str) -> frozenset[str]:
    """The variables ``template`` reads and does not set itself (empty when it does not
    parse here: then no client variable is allowed)."""
    try:
        return frozenset(meta.find_undeclared_variables(_PARSER.parse(template)))
    except TemplateSyntaxError:
        return frozenset()


def allowed_kwargs(tokenizer) -> frozenset[str]:
    """The ``chat_template_kwargs`` keys ``tokenizer``'s chat template may be given."""
    special = getattr(tokenizer, "special_tokens_map", None) or {}
    template = template_text(getattr(tokenizer, "chat_template", None))
    return template_variables(template) - TEMPLATE_RESERVED - JINJA_GLOBALS - set(special)


def client_kwargs(tokenizer, kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """``kwargs`` when the model's template reads every one of them; else a 400 naming the
    first that it does not read."""
    check_template_kwargs(kwargs)
    allowed = allowed_kwargs(tokenizer)
    for key in kwargs or {}:
        if key not in allowed:
            known = ", ".join(sorted(allowed)) or "none"
            raise InvalidRequest(
                f"chat_template_kwargs may not set {key!r}: this model's chat template reads "
                f"no such variable (it takes: {known})", param="chat_template_kwargs",
                code=UNSUPPORTED,
            )  # fmt: skip
    return dict(kwargs or {})
