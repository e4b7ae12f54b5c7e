"""Speculative decoding from the head (docs/adr/0019): where drafts come from (n-gram
lookup in ``drafting``, or a small model in ``draft_model``) and how many a step carries;
and guess steps, sent before the token they carry is known (``guessing``)."""
