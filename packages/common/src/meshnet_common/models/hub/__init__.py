"""The standard Hugging Face cache as a model source (``HF_HUB_CACHE``, else
``HF_HOME/hub``, else ``~/.cache/huggingface/hub``: where ``hf download`` and vLLM put
models): finding a model's snapshot at a revision there (``cache``) and fetching a model, or
only the files of a layer range, into it (``download``). huggingface_hub keeps the layout;
it is imported only when a model comes from here."""
