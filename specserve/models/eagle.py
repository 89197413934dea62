"""An EAGLE-style draft head: a decoder layer (or a few) that drafts from its target's features.

Its entry at position j reads token x_{j+1} and a feature vector f_j — the target's final
hidden state h_j (the LM head's input) where the target has computed it, else the head's
own output for the previous position while it drafts ahead — as
``fc([embed(x_{j+1}); f_j])`` — with ``"input_norms": true`` in its config's
``specserve_draft``, ``fc([norm_e(embed(x_{j+1})); norm_f(f_j)])``, each input RMS-normed
first (as EAGLE-3: the target's embeddings are much smaller than its final hidden states,
so unnormed the token is a faint signal beside the feature) — runs its decoder layer(s)
over its own paged KV cache and the final norm; its output goes through the target's LM head (shared, same storage) to give
x_{j+2}, and is the next entry's feature. The features come in ``batch.features``, one row
per token. ``specserve/training/eagle_head.py`` trains it; ``drafts/eagle.py`` drafts with it.

The published EAGLE-1/EAGLE-2 heads (``"layout": "eagle1"``, found by ``drafts``) are the
same computation written another way, as the EAGLE repository's ``eagle/model/cnets.py``
builds it (and vLLM's ``llama_eagle.py`` loads it): tensors named ``fc.weight`` (with
``fc.bias`` when trained with one) and ``layers.N.*`` with no ``model.`` prefix, no input
norm in the first layer and no final norm (the last layer's output plus its residual goes
to the LM head), and a copy of the target's ``embed_tokens`` that must equal the target's.
"""
from __future__ import annotations

import torch
from torch import nn

from specserve.batch import ForwardBatch
from specserve.models.llama import LlamaForCausalLM, RMSNorm


class EagleForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` of one layer (or a few) whose input is ``fc`` of the token's
    embedding and the feature row, instead of the embedding alone."""

    def __init__(self, config, spec, backend, tp) -> None:
        super().__init__(config, spec, backend, tp)
        draft = getattr(config, "specserve_draft", None) or {}
        self.weights_layout = draft.get("layout", "specserve")
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=bool(draft.get("fc_bias")))
        if self.weights_layout == "eagle1":  # no input norm in the first layer, no final norm
            self.model.layers[0].input_layernorm = ResidualAdd()
            self.model.norm = ResidualAdd()
        self.input_norms = bool(draft.get("input_norms"))
        if self.input_norms:
            ops = self.model.ops
            self.embed_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
            self.feature_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], batch: ForwardBatch,
                num_layers: int | None = None) -> torch.Tensor:
        embeds = self.model.embed_tokens(input_ids)
        features = batch.features.to(embeds.dtype)
        if self.input_norms:
            embeds, features = self.embed_norm(embeds), self.feature_norm(features)
        hidden = self.fc(torch.cat([embeds, features], dim=-1))
        return self.decode(hidden, positions, kv_caches, batch, num_layers)

    def checkpoint_name(self, name: str) -> str:
        if self.weights_layout == "eagle1" and name.startswith(("layers.", "embed_tokens.")):
            return "model." + name
        return name


class ResidualAdd(nn.Module):
    """Where an EAGLE-1 head has no norm: the input as it is, and with ``residual`` the
    sum, as ``RMSNorm``'s call returns (normed, sum)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return x
        total = x + residual
        return total, total
