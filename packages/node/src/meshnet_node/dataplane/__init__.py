"""The data plane: one forward step from the wire to the stage and on to the next hop.
``steps`` (the step message, parsed from and written to headers), ``batching`` (the compute
thread and decode batches), ``service`` (chunk ordering, relaying, sessions across hops),
``links`` (sending steps on, direct answers, link timing), ``frames`` / ``streams`` /
``stream_server`` (hop streams: the messages, the client, the server end), ``forward`` (the
handlers answered before routing). Imports the engine, never the head or the swarm."""
