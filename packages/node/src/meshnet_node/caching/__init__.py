"""The prefix cache (docs/adr/0035): the KV of prompts already computed, kept per stage in
128-token blocks keyed by a hash chain over their token ids, and reused by new sessions."""
