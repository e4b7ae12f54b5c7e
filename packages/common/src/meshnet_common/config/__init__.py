"""Configuration: every shared default defined once (``defaults``), CLI flags that also read
``MESHNET_*`` env vars (``cli``), and the flags of a layer-serving process (``node_flags``)."""
