"""``PrefixCache``: one stage's cached prefixes (docs/adr/0035).

A finished session leaves its cache here, cut back to its last full block, under the hashes
of its blocks (``blocks.block_hashes``). A new session whose prompt starts with blocks held
here gets a copy of their keys and values and starts computing after them. Entries are
whole prefixes, not shared pages: a session owns its copy, so no live session ever uses an
entry, and eviction (least recently used first) never touches a running session's cache.
An entry that a newer one extends (the next turn of a chat) gives way to it.

Entries count in the stage's KV budget (``SessionStore``): a session that needs room evicts
them first. Only caches of plain full-attention layers are kept: a sliding window or a
recurrent state cannot be cut back to a block boundary (``reusable``).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from meshnet_node.caching.blocks import BLOCK_TOKENS
from meshnet_node.engine.growing_cache import GrowingLayer

# How long a probe's promise holds an entry for the session about to open there: its opening
# step comes once every hop before computed the first chunk; a session closed before it
# arrived (a failover) takes the promise back at once.
PIN_S = 30.0
# The most promises one caller (a node) holds at once, and all callers together: beyond,
# the caller's (or anyone's) oldest is taken back, so that a member probing under ever fresh
# session ids neither grows the table nor keeps every entry from giving way (issue 52). The
# head's own (caller "": one per session it opens) count only in all.
MAX_PINS_PER_PEER = 64
MAX_PINS = 1024


@dataclass
class Entry:
    """A cached prefix: its blocks' hashes and ids, and a cache of exactly those positions."""

    hashes: tuple[str, ...]
    ids: tuple[int, ...]
    cache: DynamicCache
    first_layer: int  # the local layer the sessions that computed it entered at
    pins: int = 0  # probes that promised it to a session about to open

    @property
    def tokens(self) -> int:
        return len(self.ids)


@dataclass
class CacheStats:
    """What the cache did since start (read by the metrics and the node's info)."""

    lookups: int = 0  # sessions that asked for a prefix
    hits: int = 0  # sessions restored from an entry
    tokens_saved: int = 0  # positions those sessions did not compute
    evicted: int = 0  # entries dropped for room
    saved: int = 0  # entries stored


def reusable(cache: DynamicCache) -> bool:
    """Whether a cache of this stage can be cut back to a block boundary and copied."""
    return bool(cache.layers) and all(type(layer) in (DynamicLayer, GrowingLayer)
                                      for layer in cache.layers)  # fmt: skip


@dataclass
class PrefixCache:
    """Cached prefixes of one stage. Thread-safe (steps run on the compute thread, probes
    on the event loop)."""

    clock: object = time.monotonic
    stats: CacheStats = field(default_factory=CacheStats)

    def __post_init__(self) -> None:
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self._by_hash: dict[str, Entry] = {}  # every block hash of every entry
        # session id -> (entry, expiry, who asked), oldest first; and each caller's
        self._pins: dict[str, tuple[Entry, float, str]] = {}
        self._peer_pins: dict[str, OrderedDict[str, None]] = {}
        self._lock = threading.Lock()
        self.tokens = 0

    @property
    def blocks(self) -> int:
        return self.tokens // BLOCK_TOKENS

    def __len__(self) -> int:
        return len(self._entries)

    def held(self, hashes: list[str] | tuple[str, ...]) -> int:
        """How many of ``hashes``' first blocks one entry holds."""
        with self._lock:
            return self._longest(hashes)[0]

    def pin(self, session_id: str, hashes: list[str] | tuple[str, ...], peer: str = "") -> int:
        """Promise the longest prefix of ``hashes`` held here to ``session_id``, about to
        open (``take``): it is not evicted meanwhile. ``peer``: who asks (a node's promises
        are bounded, ``MAX_PINS_PER_PEER``; "": the head itself). Returns the blocks
        promised."""
        with self._lock:
            self._unpin_expired()
            count, entry = self._longest(hashes)
            self._unpin(session_id)
            if entry is not None:
                entry.pins += 1
                self._pins[session_id] = (entry, self.clock() + PIN_S, peer)
                held = self._peer_pins.setdefault(peer, OrderedDict())
                held[session_id] = None
                while peer and len(held) > MAX_PINS_PER_PEER:
                    self._unpin(next(iter(held)))
                while len(self._pins) > MAX_PINS:
                    self._unpin(next(iter(self._pins)))
            return count

    def promises(self, peer: str | None = None) -> int:
        """Promises held now: ``peer``'s, or everyone's (None)."""
        with self._lock:
            return len(self._pins) if peer is None else len(self._peer_pins.get(peer, ()))

    def release(self, session_id: str) -> None:
        """Take back a promise (the session will not use it)."""
        with self._lock:
            self._unpin(session_id)

    def take(self, session_id: str, hashes: tuple[str, ...], first_layer: int) -> Entry | None:
        """The entry holding all of ``hashes`` (promised to ``session_id``, or still here),
        entered at ``first_layer``; None: a miss."""
        with self._lock:
            self.stats.lookups += 1
            pinned = self._unpin(session_id)
            count, entry = self._longest(hashes)
            if pinned is not None and pinned.hashes[: len(hashes)] == tuple(hashes):
                entry, count = pinned, len(hashes)
            if entry is None or count < len(hashes) or entry.first_layer != first_layer:
                return None
            self._touch(entry)
            self.stats.hits += 1
            self.stats.tokens_saved += len(hashes) * BLOCK_TOKENS
            return entry

    def save(
        self, hashes: list[str], ids: list[int], cache: DynamicCache, first_layer: int
    ) -> None:
        """Keep ``cache`` (holding exactly ``ids``' positions; the cache is the caller's no
        more) as the entry of ``hashes``. An entry it extends gives way; one that extends it
        already makes it useless."""
        with self._lock:
            known = self._by_hash.get(hashes[-1])
            if known is not None and known.first_layer == first_layer:
                self._touch(known)  # the same prefix, or a longer one: held already
                return
            for old in {id(e): e for h in hashes if (e := self._by_hash.get(h))}.values():
                if (
                    old.first_layer == first_layer
                    and old.pins == 0
                    and old.hashes == tuple(hashes[: len(old.hashes)])
                ):
                    self._drop(old)
            entry = Entry(tuple(hashes), tuple(ids), cache, first_layer)
            self._entries[id(entry)] = entry
            for h in entry.hashes:
                self._by_hash[h] = entry
            self.tokens += entry.tokens
            self.stats.saved += 1

    def evict(self, tokens: int) -> int:
        """Drop least recently used entries (none promised to a session) until ``tokens``
        are free or nothing more can go; returns the tokens freed."""
        freed = 0
        with self._lock:
            self._unpin_expired()
            for entry in list(self._entries.values()):
                if freed >= tokens:
                    break
                if entry.pins == 0:
                    freed += entry.tokens
                    self._drop(entry)
                    self.stats.evicted += 1
        return freed

    def clear(self) -> None:
        with self._lock:
            for entry in list(self._entries.values()):
                self._drop(entry)
            self._pins.clear()
            self._peer_pins.clear()

    # -- under the lock ----------------------------------------------------------------------

    def _longest(self, hashes) -> tuple[int, Entry | None]:
        for count in range(len(hashes), 0, -1):
            entry = self._by_hash.get(hashes[count - 1])
            if entry is not None:
                return count, entry
        return 0, None

    def _touch(self, entry: Entry) -> None:
        self._entries.move_to_end(id(entry))

    def _drop(self, entry: Entry) -> None:
        if self._entries.pop(id(entry), None) is None:
            return
        self.tokens -= entry.tokens
        for h in entry.hashes:
            if self._by_hash.get(h) is entry:
                del self._by_hash[h]

    def _unpin(self, session_id: str) -> Entry | None:
        pinned = self._pins.pop(session_id, None)
        if pinned is None:
            return None
        entry, _, peer = pinned
        entry.pins -= 1
        held = self._peer_pins.get(peer)
        if held is not None:
            held.pop(session_id, None)
            if not held:
                del self._peer_pins[peer]
        return entry

    def _unpin_expired(self) -> None:
        now = self.clock()
        for session_id, (_, expiry, _) in list(self._pins.items()):
            if expiry <= now:
                self._unpin(session_id)


def copy_prefix(entry: Entry, blocks: int, into: DynamicCache) -> None:
    """Fill the empty cache ``into`` with the first ``blocks`` blocks of ``entry``."""
    end = blocks * BLOCK_TOKENS
    for source, target in zip(entry.cache.layers, into.layers, strict=True):
        if source.is_initialized and source.keys is not None and source.keys.numel():
            target.update(source.keys[..., :end, :].clone(), source.values[..., :end, :].clone())


def cut_to_blocks(cache: DynamicCache, length: int, blocks: int) -> None:
    """Cut a finished session's cache (``length`` positions) back to ``blocks`` blocks."""
    drop = length - blocks * BLOCK_TOKENS
    if drop > 0:
        for layer in cache.layers:
            if layer.is_initialized and layer.keys is not None:
                layer.crop(-drop)


def heartbeat_figures(caches) -> dict[str, int]:
    """What a heartbeat says of the stages' prefix caches (None: a stage without one)."""
    caches = [c for c in caches if c is not None]
    return {"prefix_blocks": sum(c.blocks for c in caches),
            "prefix_lookups": sum(c.stats.lookups for c in caches),
            "prefix_hits": sum(c.stats.hits for c in caches)}  # fmt: skip
