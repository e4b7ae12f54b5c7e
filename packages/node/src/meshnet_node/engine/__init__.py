"""The engine: torch only, no web imports. Loads a layer range (families, loader,
quantization, memory preflight), runs it with per-session KV caches (stage, sessions) and
samples the tail's token (sampling). ``reference`` runs the unsplit HF model for checks."""
