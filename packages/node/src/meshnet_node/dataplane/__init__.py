"""The data plane: one forward step from the wire to the stage and on to the next hop.
``steps`` (the step message, parsed from and written to headers), ``service`` (chunk
ordering, sessions across hops; it submits passes to the compute scheduler and holds the
links), ``links`` (sending steps on, direct answers, link timing), ``frames`` / ``streams`` /
``stream_server`` (hop streams: the messages, the client, the server end), ``handlers`` (the
data path's answers) and ``forward`` (their plain-HTTP front end, before routing). Imports
the engine and the scheduler, never the head or the swarm."""
