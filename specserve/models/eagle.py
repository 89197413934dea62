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

An EAGLE-3 head (``Eagle3ForCausalLM``, ``"layout": "eagle3"``) reads more of its target:
the residual stream entering three of its layers (low, middle, high), concatenated.
"""
from __future__ import annotations

from itertools import islice

import torch
from torch import nn

from specserve.batch import ForwardBatch
from specserve.errors import ModelLoadError
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
        features = self.input_features(batch.features.to(embeds.dtype))
        if self.input_norms:
            embeds, features = self.embed_norm(embeds), self.feature_norm(features)
        hidden = self.fc(torch.cat([embeds, features], dim=-1))
        return self.decode(hidden, positions, kv_caches, batch, num_layers)

    @property
    def feature_input_width(self) -> int:
        """The width of the feature rows its passes read (``batch.features``), once
        ``input_features`` has made them."""
        return self.config.hidden_size

    def input_features(self, rows: torch.Tensor) -> torch.Tensor:
        """Feature rows as its passes read them, from the target's kept rows or its own
        outputs: the same rows (an EAGLE-3 head fuses the target's)."""
        return rows

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


class MtpForCausalLM(EagleForCausalLM):
    """A target's own multi-token-prediction layer as its draft: MiMo's
    ``model.mtp_layers.0`` (as vLLM's ``mimo_mtp.py`` runs it), an EAGLE head written another
    way. Its entry at position j norms the embedding of x_{j+1} (``token_layernorm``; zero
    at position 0) and the target's final hidden state h_j (``hidden_layernorm``), maps
    ``[h_j; embedding]`` through ``input_proj``, runs one decoder layer of the target's
    family and ``final_layernorm``; the target's LM head predicts x_{j+2}, and the output is
    the next draft step's feature. Built with input norms; ``input_proj``'s two halves are
    swapped at load to this class's [embedding; feature] order (a permutation: exact).
    Only the first MTP layer drafts (as in vLLM); the checkpoint's others are left."""

    def __init__(self, config, spec, backend, tp) -> None:
        super().__init__(config, spec, backend, tp)
        self.weights_layout = "mtp"

    RENAMED_MTP = {"token_layernorm.weight": "embed_norm.weight", "hidden_layernorm.weight": "feature_norm.weight",
                   "input_proj.weight": "fc.weight", "final_layernorm.weight": "model.norm.weight"}

    def checkpoint_name(self, name: str) -> str | None:
        prefix = "model.mtp_layers.0."
        if not name.startswith(prefix):
            return None  # the target's tensors, and further MTP layers
        rest = name[len(prefix):]
        return self.RENAMED_MTP.get(rest, "model.layers.0." + rest)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], batch: ForwardBatch,
                num_layers: int | None = None) -> torch.Tensor:
        embeds = self.model.embed_tokens(input_ids).masked_fill((positions == 0)[:, None], 0.0)
        hidden = self.fc(torch.cat([self.embed_norm(embeds), self.feature_norm(batch.features.to(embeds.dtype))],
                                   dim=-1))
        return self.decode(hidden, positions, kv_caches, batch, num_layers)

    def finish_loading(self) -> None:
        """``input_proj`` reads [feature; embedding]: its halves swapped to this order."""
        hidden = self.config.hidden_size
        with torch.no_grad():
            self.fc.weight.copy_(torch.cat([self.fc.weight[:, hidden:], self.fc.weight[:, :hidden]], dim=1))


class Eagle3ForCausalLM(LlamaForCausalLM):
    """An EAGLE-3 head, as the EAGLE repository defines it (``eagle/model/cnets.py``,
    ``Model`` and ``LlamaDecoderLayeremb``) and vLLM loads it
    (``vllm/model_executor/models/llama_eagle3.py``).

    Its entry at position j reads token x_{j+1} and a feature f_j: where the target computed
    position j, ``fc`` of the target's residual stream entering its ``feature_layers``
    (``LlamaForCausalLM.kept_rows``: 3 × the target's hidden size, concatenated, ``fc``
    maps them to the head's width); while it drafts ahead, its own output at j (no ``fc``).
    Its first layer takes residual = f and runs attention over
    ``[input_layernorm(embed(x_{j+1})); hidden_norm(f)]`` (q/k/v read 2 × hidden; with
    ``norm_before_residual`` the residual is ``hidden_norm(f)``), then the MLP as usual;
    further layers (a multi-layer head) are plain decoder layers. Its output, the residual
    stream, is the next entry's feature; ``norm`` and its own LM head over its draft
    vocabulary give the logits, draft token d being target token ``d + d2t[d]`` (every
    other token gets logit -inf: probability 0 in q, so verification stays exact)."""

    INDEX_TABLES = frozenset({"d2t", "t2d"})

    def __init__(self, config, spec, backend, tp) -> None:
        super().__init__(config, spec, backend, tp)
        hidden = config.hidden_size
        self.weights_layout = "eagle3"
        self.feature_width = 3 * (getattr(config, "target_hidden_size", None) or hidden)
        self.fc = nn.Linear(self.feature_width, hidden, bias=False)
        first = self.model.layers[0]
        attn = first.self_attn
        attn.qkv_proj = nn.Linear(2 * hidden, attn.q_size + 2 * attn.kv_size, bias=attn.qkv_proj.bias is not None)
        first.hidden_norm = RMSNorm(hidden, config.rms_norm_eps, self.model.ops)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))
        self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.lm_head = nn.Linear(hidden, self.draft_vocab_size, bias=False)
        self.tie_word_embeddings = False  # its head is its own, over its draft vocabulary
        self.index_tables: dict[str, torch.Tensor] = {}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], batch: ForwardBatch,
                num_layers: int | None = None) -> torch.Tensor:
        """The residual stream after the head's layers (not normed: the next feature)."""
        ops = self.model.ops
        embeds = self.model.embed_tokens(input_ids)
        tables = ops.rotary_tables(self.model.rotary, positions, embeds.dtype)
        features = self.input_features(batch.features.to(embeds.dtype))
        first = self.model.layers[0]
        normed = first.hidden_norm(features)
        residual = normed if self.norm_before_residual else features
        hidden = first.self_attn(torch.cat([first.input_layernorm(embeds), normed], dim=-1), tables,
                                 kv_caches[0], batch)
        hidden, residual = first.post_attention_layernorm(hidden, residual)
        hidden = first.mlp(hidden)
        for layer, kv_cache in zip(islice(self.model.layers, 1, num_layers), kv_caches[1:]):
            hidden, residual = layer(hidden, residual, tables, kv_cache, batch)
        return hidden + residual

    @property
    def feature_input_width(self) -> int:
        """The width of the feature rows its passes read: its own (see ``input_features``)."""
        return self.config.hidden_size

    def input_features(self, rows: torch.Tensor) -> torch.Tensor:
        """The target's kept rows (its feature layers' states, concatenated) fused by
        ``fc`` to the head's width; its own outputs (already that wide) as they are.
        The drafter fuses them before a pass, so that a captured pass reads rows of one
        width whichever they are."""
        return self.fc(rows) if rows.shape[-1] == self.feature_width else rows

    @property
    def vocab_head(self) -> nn.Module:
        """Its own LM head is over its draft vocabulary (``vocab_ids``, from d2t)."""
        return self.lm_head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(self.model.norm(hidden))  # its output is not normed yet

    def restrict_vocab(self, ids: torch.Tensor) -> bool:
        raise ModelLoadError("an EAGLE-3 head carries its draft vocabulary in its d2t map; "
                             "a draft_vocab.json beside it would be a second one")

    def checkpoint_name(self, name: str) -> str:
        """The published names (``midlayer.*``, ``fc``, ``norm``, ``lm_head``; ``layers.N.*``
        for a multi-layer head's further layers; ``embed_tokens``, where stored, a copy of
        the target's) as ours."""
        if name.startswith("midlayer."):
            return "model.layers.0." + name[len("midlayer."):]
        if name.startswith(("layers.", "norm.", "embed_tokens.")):
            return "model." + name
        return name

    def finish_loading(self) -> None:
        """The draft vocabulary from ``d2t``, checked: distinct target ids, within the
        vocabulary, and where ``t2d`` is stored, the same set."""
        n, vocab = self.draft_vocab_size, self.config.vocab_size
        d2t, t2d = self.index_tables.get("d2t"), self.index_tables.get("t2d")
        if d2t is None:
            if n != vocab:
                raise ModelLoadError(f"an EAGLE-3 head with a draft vocabulary of {n} tokens "
                                     "(draft_vocab_size) and no d2t map")
            return
        if d2t.dtype.is_floating_point or tuple(d2t.shape) != (n,):
            raise ModelLoadError(f"an EAGLE-3 head's d2t must hold {n} integers (draft_vocab_size), "
                                 f"it has shape {tuple(d2t.shape)} of {d2t.dtype}")
        ids = torch.arange(n) + d2t.long().cpu()
        if int(ids.min()) < 0 or int(ids.max()) >= vocab or len(torch.unique(ids)) != n:
            raise ModelLoadError("an EAGLE-3 head's d2t maps its draft tokens outside the vocabulary, "
                                 "or two of them to one token")
        if t2d is not None:
            expected = torch.zeros(vocab, dtype=torch.bool)
            expected[ids] = True
            if tuple(t2d.shape) != (vocab,) or not torch.equal(t2d.cpu().bool(), expected):
                raise ModelLoadError("an EAGLE-3 head's t2d and d2t name different draft vocabularies")
        self.vocab_ids = ids.to(self.lm_head.weight.device)


def eagle3_feature_layers(config, target_layers: int) -> tuple[int, ...]:
    """The target layers whose input an EAGLE-3 head reads, ascending: its config's
    ``eagle_aux_hidden_state_layer_ids`` (at the top level, or in ``eagle_config``, as vLLM
    reads them), else EAGLE's own choice (2, L // 2, L - 3) for a target of L layers."""
    nested = getattr(config, "eagle_config", None) or {}
    if nested.get("use_aux_hidden_state") is False:
        raise ModelLoadError("an EAGLE-3 head without auxiliary hidden states "
                             "(eagle_config.use_aux_hidden_state false) is not supported")
    ids = getattr(config, "eagle_aux_hidden_state_layer_ids", None) or nested.get("eagle_aux_hidden_state_layer_ids")
    ids = tuple(ids) if ids else (2, target_layers // 2, target_layers - 3)
    if len(ids) != 3 or len(set(ids)) != 3 or not all(isinstance(i, int) and 0 <= i < target_layers for i in ids):
        raise ModelLoadError(f"an EAGLE-3 head reads 3 distinct target layers below {target_layers}; "
                             f"its eagle_aux_hidden_state_layer_ids are {list(ids)}")
    return tuple(sorted(ids))
