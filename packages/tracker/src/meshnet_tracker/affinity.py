"""Cache-aware routing on the tracker (docs/adr/0035): requests that start alike go down the
chain that computed the first of them, where that chain's hops keep the prompt's blocks.

The tracker does not tokenize, so it cannot name blocks; it names a request's *prefix*: the
client's ``prompt_cache_key`` where it gives one (OpenAI's routing hint), else the start of
the prompt (a chat's first two messages: its system prompt and first question, which every
later turn repeats; a completion's first 2048 characters or 512 token ids), with the model
and the ``cache_salt``. The chain a prefix went down last is preferred while all of its
nodes still serve the same layers; otherwise routing is as before. The head still agrees with
its hops on the blocks they hold (``meshnet_node.caching.api``): a stale preference costs
a prefill, never a wrong answer."""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict

MAX_PREFIXES = 4096  # prefixes remembered, least recently used forgotten first
PROMPT_CHARS = 2048
PROMPT_IDS = 512


def prefix_key(model_id: str, payload: dict) -> str | None:
    """The name of a request's prefix (None: nothing to go by)."""
    salt = payload.get("cache_salt")
    key = payload.get("prompt_cache_key")
    if isinstance(key, str) and key:
        start: object = ["key", key]
    elif isinstance(messages := payload.get("messages"), list) and messages:
        start = ["chat", messages[:2]]
    elif isinstance(prompt := payload.get("prompt"), str):
        start = ["text", prompt[:PROMPT_CHARS]]
    elif isinstance(prompt, list) and prompt and all(isinstance(i, int) for i in prompt):
        start = ["ids", prompt[:PROMPT_IDS]]
    else:  # several prompts in one request, or nothing usable
        return None
    try:
        text = json.dumps([model_id, salt, start], sort_keys=True, default=str)
    except (TypeError, ValueError):
        return None
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


class PrefixAffinity:
    """The chain each recent prefix went down: (node id, layers, start layer) per hop, the
    head first."""

    def __init__(self, size: int = MAX_PREFIXES) -> None:
        self.size = size
        self._chains: OrderedDict[str, tuple] = OrderedDict()

    def chain(self, key: str | None) -> tuple | None:
        if key is None or key not in self._chains:
            return None
        self._chains.move_to_end(key)
        return self._chains[key]

    def remember(self, key: str | None, chain: tuple) -> None:
        if key is None:
            return
        self._chains[key] = chain
        self._chains.move_to_end(key)
        while len(self._chains) > self.size:
            self._chains.popitem(last=False)
