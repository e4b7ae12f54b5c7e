"""The head: OpenAI endpoints (routes, serving), generation across the chain and its
failover. Drives the data plane from the first stage."""
