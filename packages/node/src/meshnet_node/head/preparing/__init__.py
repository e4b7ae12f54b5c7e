"""Preparing a request before it runs: what a client may hand the model's chat template
(``templates``) and the few threads, each held until its work really ends, that plan
requests off the event loop within --prepare-timeout (``pool``)."""
