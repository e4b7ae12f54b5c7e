"""A draft model on the head (``--draft-model``): a small model sharing the target's tokenizer
(a 1B model drafting for a 70B one) proposes each step's drafts by greedy decoding, in place
of the n-gram lookup (docs/adr/0019).

Each generation keeps its own cache of the draft model. A proposal first brings that cache
to the generation's text (cropping the drafts the chain did not keep, then feeding what is
new in one pass) and then decodes ``k`` tokens greedily, one pass each.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from meshnet_common.errors import ModelError
from meshnet_node.engine.sessions import crop_cache

logger = logging.getLogger(__name__)


class DraftModel:
    """The whole small model, loaded once per head; ``session()`` per generation."""

    def __init__(self, path: Path | str, *, target_tokenizer, dtype: torch.dtype) -> None:
        path = Path(path)
        if not (path / "config.json").is_file():
            raise ModelError(f"--draft-model {path}: not a model snapshot (no config.json)")
        tokenizer = AutoTokenizer.from_pretrained(path)
        if tokenizer.get_vocab() != target_tokenizer.get_vocab():
            raise ModelError(
                f"--draft-model {path}: its tokenizer differs from the served model's; a "
                "draft model must share the vocabulary"
            )
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        self.path = path
        logger.info("draft model %s loaded (%d layers)", path,
                    self.model.config.num_hidden_layers)  # fmt: skip

    def session(self) -> DraftSession:
        return DraftSession(self.model)


class DraftSession:
    """One generation's draft cache: the tokens in it, and greedy proposals after a text."""

    def __init__(self, model) -> None:
        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.cache.activate_past_recording()  # sliding windows keep what a crop needs
        self.fed: list[int] = []  # the tokens the cache holds, by position

    @torch.inference_mode()
    def propose(self, context: list[int], k: int) -> list[int]:
        """``k`` tokens the draft model would write after ``context`` (greedy)."""
        if k <= 0 or not context:
            return []
        common = 0
        limit = min(len(self.fed), len(context) - 1)  # feed at least the last token again
        while common < limit and self.fed[common] == context[common]:
            common += 1
        if common < len(self.fed):
            crop_cache(self.cache, len(self.fed) - common)
            del self.fed[common:]
        crop_cache(self.cache, 0)  # sliding windows back to their size
        drafts: list[int] = []
        feed = context[common:]
        for _ in range(k):
            position = len(self.fed)
            ids = torch.tensor([feed])
            positions = torch.arange(position, position + len(feed)).unsqueeze(0)
            out = self.model(input_ids=ids, position_ids=positions, cache=self.cache,
                             use_cache=True)  # fmt: skip
            self.fed.extend(feed)
            token = int(torch.argmax(out.logits[0, -1]))
            drafts.append(token)
            feed = [token]
        return drafts
