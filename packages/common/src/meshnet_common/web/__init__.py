"""HTTP plumbing both services share: error mapping and observability (``http``), the swarm
token and API keys (``auth``), serving under uvicorn (``serve``) and layer-subset downloads
(``shards``). No torch: the tracker runs on this alone."""
