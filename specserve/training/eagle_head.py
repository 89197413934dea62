"""An EAGLE-style draft head for training (``--arch eagle``).

The head drafts from the target's own features: its entry at position j reads the token
x_{j+1} and the target's final hidden state h_j (the LM head's input),
``fc([embed(x_{j+1}); h_j])``, runs its decoder layer(s) over its own KV cache and a norm,
and its output g_j goes through the target's LM head to predict x_{j+2}. When drafting,
only the context has target features: the head's second proposal reads its own g from the
first step, and so on (``drafts/eagle.py``).

Training unrolls that (training-time test, as EAGLE-3): pass 0 feeds every position the
target's features; pass t feeds position m the output of pass t-1 at m-1 and lets it
attend to pass 0's keys at positions <= m - t (the context, computed from target features)
and to pass s's key at m - t + s for 1 <= s <= t (the chain's earlier drafts): exactly what
the t-th draft step sees in the engine. Each pass's logits at m are distilled to the
target's at m + 1, pass t weighted ``PASS_DECAY ** t``, on response positions only. The
same passes give an exact teacher-forced replay of greedy chain drafting at k =
``num_passes`` (``validation.chain_acceptance``).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from specserve.training.losses import TargetDistribution, head_logits

PASS_DECAY = 0.8


class EagleHead(nn.Module):
    """The head for training: parameter names match the checkpoint the engine loads
    (``fc.weight``, ``model.layers.*`` in the target family's names, ``model.norm.weight``);
    the target's embeddings, rotary tables and LM head are used, never trained.

    ``layers`` and ``norm`` (HF modules, float32) become the head's own. ``fc_init``:
    ``"sum"`` starts the layers on embedding + feature; ``"tokens"`` on the embedding alone,
    so a head made from a trained layers-only draft starts as exactly that draft (up to
    positions shifted by one, which rotary attention does not see) and learns to use the
    features from there. ``input_norms``: RMS-norm each input before ``fc`` (learned
    weights ``embed_norm``, ``feature_norm``), so both start on an equal footing."""

    def __init__(self, target, layers, norm, fc_init: str = "sum", input_norms: bool = False) -> None:
        super().__init__()
        cfg = target.config
        hidden = cfg.hidden_size
        self.config = cfg
        self.input_norms = input_norms
        if input_norms:  # RMS-norm the embedding and the feature before fc (models/eagle.py)
            norm_class = type(norm)
            self.embed_norm = norm_class(hidden, eps=cfg.rms_norm_eps)
            self.feature_norm = norm_class(hidden, eps=cfg.rms_norm_eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        eye = torch.eye(hidden)
        with torch.no_grad():
            self.fc.weight.copy_(torch.cat([eye, eye if fc_init == "sum" else torch.zeros_like(eye)], dim=1))
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(layers)
        self.model.norm = norm
        self.float()
        self._bind(target, self.model.layers[0].self_attn)

    def _bind(self, target, attn) -> None:
        cfg = target.config
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.scale = self.head_dim ** -0.5
        self.has_qk_norm = hasattr(attn, "q_norm")
        # Not registered: shared with the target, frozen.
        self.__dict__["target"] = target

    def own_parameters(self) -> dict[str, nn.Parameter]:
        return dict(self.named_parameters())

    def read_target(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the features the head reads, the target's final hidden states) of ``ids``."""
        hidden = self.target.model(input_ids=ids).last_hidden_state
        return hidden, hidden

    def logits(self, out: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
        """The logits of output rows ``out`` (over ``vocab``'s tokens, in its order, if given)."""
        return head_logits(self.target.lm_head, out, vocab)

    def _attend(self, layer, x: torch.Tensor, u: torch.Tensor, cos, sin, keys: list, values: list, t: int,
                masks: dict) -> torch.Tensor:
        """One decoder layer on pass ``t``'s normed inputs ``x`` [B, L, *] over residual
        stream ``u`` [B, L, H]; appends this pass's keys and values to ``keys`` / ``values``
        (one entry per pass)."""
        attn = layer.self_attn
        batch, length, _ = u.shape
        q = attn.q_proj(x).view(batch, length, self.num_heads, self.head_dim)
        k = attn.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)
        v = attn.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)
        if self.has_qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if self.num_kv_heads != self.num_heads:  # the fused kernels take masks without GQA
            group = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        keys.append(k)
        values.append(v)
        if t == 0:  # plain causal attention: the flash kernel
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            mask = masks.get((t, length))
            if mask is None:
                mask = masks[(t, length)] = _pass_mask(t, length, u.device)
            out = F.scaled_dot_product_attention(q, torch.cat(keys, dim=2), torch.cat(values, dim=2),
                                                 attn_mask=mask, scale=self.scale)
        out = attn.o_proj(out.transpose(1, 2).reshape(batch, length, -1))
        h = u + out
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def forward(self, ids: torch.Tensor, features: torch.Tensor, num_passes: int):
        """``ids`` [B, L] the sequences, ``features`` [B, L, H] the target's final hidden
        states. Returns each pass's normed outputs [B, L, H]: row m of pass t predicts
        token m + 2 (its logits are the target LM head's of it)."""
        target = self.target
        batch, length = ids.shape
        nxt = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)  # x_{m+1}; the last row is never used
        emb = target.model.embed_tokens(nxt).to(features.dtype)
        if self.input_norms:
            emb = self.embed_norm(emb)
        positions = torch.arange(length, device=ids.device).expand(batch, length)
        cos, sin = target.model.rotary_emb(features, positions)
        layers = self.model.layers
        keys, values = [[] for _ in layers], [[] for _ in layers]
        outs, masks = [], {}
        feat = features
        for t in range(num_passes):
            x = self.fc(torch.cat([emb, self.feature_norm(feat) if self.input_norms else feat], dim=-1))
            for i, layer in enumerate(layers):
                x = self._attend(layer, layer.input_layernorm(x), x, cos, sin, keys[i], values[i], t, masks)
            g = self.model.norm(x)
            outs.append(g)
            feat = torch.cat([torch.zeros_like(g[:, :1]), g[:, :-1]], dim=1)
        return outs


def _pass_mask(t: int, length: int, device) -> torch.Tensor:
    """Pass ``t``'s attention mask [L, (t + 1) L]: pass 0's keys at n <= m - t, pass s's key
    at n = m - t + s. Every row sees at least its own key (pass t's at n = m); rows m < t
    have no context (a chain cannot start before position 0) and are never trained on."""
    m = torch.arange(length, device=device)[:, None]
    n = torch.arange(length, device=device)[None, :]
    return torch.cat([n <= m - t] + [n == m - t + s for s in range(1, t + 1)], dim=1)


def head_losses(head: EagleHead, target, ids, rows, cols, num_passes: int, ce_weight: float,
                vocab: torch.Tensor | None = None):
    """(loss, kl, ce, agree) over the response positions ``rows, cols`` (positions whose
    next token is a response token, as ``data.collate`` gives them): pass t at
    m = col - 1 against the target's logits at col, where m >= t. ``agree[t]`` is the
    draft's argmax == the target's at those rows (False where m < t). ``vocab``: the draft
    vocabulary, the logits and the target's distribution over those tokens only
    (``losses.TargetDistribution``)."""
    with torch.no_grad():
        features, final = head.read_target(ids)
        teacher = TargetDistribution(target.lm_head(final[rows, cols]).float(), vocab)
    outs = head(ids, features, num_passes)
    loss = kl_sum = ce_sum = 0.0
    agree = []
    for t, g in enumerate(outs):
        d_logits = head.logits(g[rows, (cols - 1).clamp(min=0)], vocab)
        loss_t, kl_t, ce_t, agree_t = teacher.loss(d_logits, ce_weight, valid=(cols - 1) >= t)
        loss = loss + PASS_DECAY ** t * loss_t
        kl_sum, ce_sum = kl_sum + kl_t.detach(), ce_sum + ce_t.detach()
        agree.append(agree_t)
    return loss, kl_sum / num_passes, ce_sum / num_passes, torch.stack(agree)


def save_head(head: EagleHead, files, init_layers: list[int], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    state = {n: p.detach().to(torch.bfloat16).cpu().contiguous() for n, p in head.own_parameters().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((files.path / "config.json").read_text())
    for key in ("_name_or_path", "_model_name_or_path", "transformers_version", "id2label", "label2id"):
        config.pop(key, None)
    config["num_hidden_layers"] = len(init_layers)
    config["intermediate_size"] = head.model.layers[0].mlp.down_proj.in_features
    if config.get("layer_types"):
        config["layer_types"] = [config["layer_types"][i] for i in init_layers]
    config["dtype"] = "bfloat16"
    config["specserve_draft"] = {"kind": "eagle", "shares_target_embeddings": True, "target": files.name,
                                 "input_norms": head.input_norms, "init_from_target_layers": init_layers,
                                 "trained_by": "python -m specserve.training --arch eagle"}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_head_weights(head: EagleHead, path: Path) -> None:
    state = load_file(str(path))
    own = head.own_parameters()
    if set(state) != set(own):
        raise SystemExit(f"--init-from {path}: its tensors do not match an EAGLE head")
    with torch.no_grad():
        for name, tensor in state.items():
            own[name].copy_(tensor.float())
