"""The data plane: one forward step from the wire to the stage and on to the next hop.
``steps`` (the step message, parsed from and written to headers), ``compute`` (the compute
thread), ``batching`` (decode batches and micro-batches), ``service`` (chunk ordering,
sessions across hops; it holds the compute thread, the batcher and the links), ``links``
(sending steps on, direct answers, link timing), ``frames`` / ``streams`` /
``stream_server`` (hop streams: the messages, the client, the server end), ``handlers`` (the
data path's answers) and ``forward`` (their plain-HTTP front end, before routing). Imports
the engine, never the head or the swarm."""
