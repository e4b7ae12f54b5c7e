"""The node's compute scheduler (docs/adr/0039): every pass of a node's stages — prompt
chunks, decode batches, passes verifying drafts, audits' recomputations, a draft model's
guesses — is queued to one object and runs on one compute thread, whose torch thread count
is set once at start-up. ``policy`` decides (what runs next, which decode steps share a
pass, how many prompt tokens a pass takes, which passes take a host compute turn), on a
clock it is given; ``scheduler`` runs those decisions on the compute thread;
``micro_batches`` says how many micro-batches a head keeps in flight. Imports the engine,
never the data plane, the head or the swarm."""
