"""Tiny models for tests and benchmarks, written by our own code: random-weight snapshots of
every family (``snapshots``, ``configs``), and the same as GGUF files (``gguf_files``) or
int4 checkpoints (``int4_files``)."""
