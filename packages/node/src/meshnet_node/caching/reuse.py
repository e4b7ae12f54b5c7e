"""The head's side of the prefix cache (docs/adr/0035): name a prompt's blocks, agree with
every hop of the route on how many of them the session starts after, and restore those on
the head's own stage."""

from __future__ import annotations

from meshnet_common.errors import MeshnetError
from meshnet_node.caching.api import PrefixClient
from meshnet_node.caching.blocks import (
    BLOCK_TOKENS,
    PrefixPlan,
    block_hashes,
    reusable_blocks,
    seed_of,
)


class PrefixReuse:
    """Which cached blocks a head's new sessions start after. ``client``: the probes to the
    hops of a route."""

    def __init__(self, model_id: str, client: PrefixClient) -> None:
        self.model_id = model_id
        self.client = client

    def plan(self, request) -> PrefixPlan:
        """What a generation's session leaves in the cache: its prompt's blocks, named from
        the model, the request's tenant and its ``cache_salt``."""
        seed = seed_of(self.model_id, request.cache_salt, request.tenant)
        return PrefixPlan(seed, len(request.prompt_ids))

    async def restore(self, stage, session_id: str, prompt_ids, route) -> tuple[str, ...]:
        """Start the head's session (open, empty) after the most blocks of the prompt that
        this stage and every hop of ``route`` hold; returns their hashes, which the opening
        step names (empty: it starts at position 0)."""
        cache = stage.sessions.prefix
        session = stage.sessions.peek(session_id)
        if cache is None or session is None or session.keep is None:
            return ()
        usable = reusable_blocks(len(prompt_ids)) * BLOCK_TOKENS
        hashes = block_hashes(session.keep.seed, prompt_ids[:usable])
        count = cache.pin(session_id, hashes) if hashes else 0
        if count and route:
            count = min(count, await self.client.held_by_all(route, session_id, hashes[:count]))
        if not count:
            cache.release(session_id)
            return ()
        prefix = tuple(hashes[:count])
        try:
            stage.sessions.restore(session, prefix)
        except MeshnetError:  # gone meanwhile, or no room: compute it all
            return ()
        return prefix
