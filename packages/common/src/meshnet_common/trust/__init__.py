"""What one party in a swarm can prove to another: signed audit evidence (verdicts) and the
tracker key that signs weight manifests (docs/adr/0032)."""
