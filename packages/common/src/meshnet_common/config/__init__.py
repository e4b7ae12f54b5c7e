"""Configuration: every shared default defined once (``defaults``), one settings object per
service whose fields generate the CLI and read ``MESHNET_*`` env (``settings``), the knobs of
a layer-serving process (``shard``), and the services' CLI helpers (``cli``)."""
