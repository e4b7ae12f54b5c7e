"""The data plane: one forward step from the wire to the stage and on to the next hop.
``steps`` (the step message, parsed from and written to headers), ``batching`` (the compute
thread and decode batches), ``service`` (chunk ordering, relaying, sessions across hops),
``hop_client`` / ``hop_server`` (the lean HTTP/1.1 both ends of a hop), ``forward`` (the
handlers answered before routing). Imports the engine, never the head or the swarm."""
