"""An EAGLE-style draft head: one decoder layer that drafts from its target's features.

Its entry at position j reads token x_{j+1} and a feature vector f_j — the target's final
hidden state h_j (the LM head's input) where the target has computed it, else the head's
own output for the previous position while it drafts ahead — as
``fc([embed(x_{j+1}); f_j])``, runs its decoder layer over its own paged KV cache and the
final norm; its output goes through the target's LM head (shared, same storage) to give
x_{j+2}, and is the next entry's feature. The features come in ``batch.features``, one row
per token. ``drafts/eagle_training.py`` trains it; ``drafts/eagle.py`` drafts with it.

A head may draft among a subset of the vocabulary only (``restrict_vocab``: the tokens its
target writes most, as FR-Spec): its LM head is then that many rows of the target's, and
the other tokens get logit -inf — probability 0 in q, never proposed, so verification stays
exact. On a CPU the full LM head is most of a draft step's cost.
"""
from __future__ import annotations

import torch
from torch import nn

from specserve.batch import ForwardBatch
from specserve.models.llama import LlamaForCausalLM


class EagleForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` of one layer (or a few) whose input is ``fc`` of the token's
    embedding and the feature row, instead of the embedding alone."""

    def __init__(self, config, spec, backend, tp) -> None:
        super().__init__(config, spec, backend, tp)
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], batch: ForwardBatch,
                num_layers: int | None = None) -> torch.Tensor:
        embeds = self.model.embed_tokens(input_ids)
        hidden = self.fc(torch.cat([embeds, batch.features.to(embeds.dtype)], dim=-1))
        return self.decode(hidden, positions, kv_caches, batch, num_layers)

    vocab_ids: torch.Tensor | None = None

    def restrict_vocab(self, ids: torch.Tensor) -> bool:
        """Draft only among token ids ``ids``; False (and the full head kept) when the
        target's LM head weights cannot be read (an untied head prepacked for the CPU)."""
        from specserve.models.packed_linear import PackedLinear

        if isinstance(self.lm_head, nn.Linear):
            weight = self.lm_head.weight
        elif self.tie_word_embeddings:
            weight = self.model.embed_tokens.weight
        else:
            return False
        ids = ids.to(device=weight.device, dtype=torch.int64)
        head = nn.Linear(weight.shape[1], len(ids), bias=False, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            head.weight.copy_(weight.index_select(0, ids))
        self.vocab_head = PackedLinear(head) if isinstance(self.lm_head, PackedLinear) else head
        self.vocab_ids = ids
        return True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.vocab_ids is None:
            return super().compute_logits(hidden)
        logits = self.vocab_head(hidden)
        out = logits.new_full((hidden.shape[0], self.config.vocab_size), float("-inf"))
        return out.index_copy_(1, self.vocab_ids, logits)
