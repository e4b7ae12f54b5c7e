"""A node's place in the swarm: membership (register, heartbeat, directives), joining
(assignment, the joining announcement), fetching a shard's weights, resharding, and the
host's memory claims."""


class FetchError(Exception):
    """One source of a shard's weights failed; the caller moves on to the next."""
