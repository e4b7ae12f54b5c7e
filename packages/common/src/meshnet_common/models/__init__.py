"""Model files: reading a checkpoint's index and headers without torch (``checkpoint``),
models dirs in both layouts (``models_dir``), layer-subset files (``shardfiles``), and the
``meshnet-models`` tooling (``cli``, ``gguf_import``, ``tiny``: these need the ``models``
extra)."""
