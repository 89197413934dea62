"""An EAGLE-3 head for training (``--arch eagle3``), saved in the published EAGLE-3 layout.

The head is the one the engine runs (``models/eagle.py`` ``Eagle3ForCausalLM``): its entry
at position j reads token x_{j+1} and ``fc`` of the target's residual stream entering three
of its layers at j (low, middle, high: transformers' ``hidden_states[i]``), its decoder
layer attends over ``[input_layernorm(embedding); hidden_norm(feature)]`` with the feature
as residual, and ``lm_head(norm(output))`` over its draft vocabulary predicts x_{j+2}.
Drafting ahead, it reads its own output (pre-norm) as the next feature.

Training unrolls the draft steps exactly as ``eagle_head.py`` does for EAGLE-1 heads
(training-time test; the same pass masks and pass weights). Its parameters carry the
published names (``midlayer.*``, ``fc``, ``norm``, ``lm_head``; buffers ``d2t`` and
``t2d``), and ``save_eagle3`` writes them with a config.json as EAGLE-3 heads ship
(``LlamaForCausalLMEagle3``, ``draft_vocab_size``, ``target_hidden_size``,
``eagle_aux_hidden_state_layer_ids``): the names and fields vLLM's ``llama_eagle3.py`` reads
(checked against its source; not run here).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from specserve.training.eagle_head import EagleHead


class Eagle3Head(EagleHead):
    """The head for training. ``layer``: a decoder layer of the target's family (HF module)
    its midlayer starts from, q/k/v reading the embedding's and the feature's halves alike
    (each half the target layer's weights, so the layer starts on their sum; a Qwen layer's
    q/k/v biases and q/k norms left out, as the published head has none); ``norm``: its
    final norm. ``fc`` starts by passing the highest feature layer through, ``lm_head`` as
    the target's rows of the draft vocabulary ``vocab`` (None: the whole vocabulary)."""

    def __init__(self, target, layer, norm, feature_layers: tuple[int, ...], vocab: torch.Tensor | None) -> None:
        nn.Module.__init__(self)
        cfg = target.config
        hidden = cfg.hidden_size
        self.config = cfg
        self.input_norms = False
        self.feature_layers = tuple(sorted(feature_layers))
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, 2 * hidden:].copy_(torch.eye(hidden))
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(attn, name)
            new = nn.Linear(2 * hidden, old.out_features, bias=False, device=old.weight.device,
                            dtype=old.weight.dtype)
            with torch.no_grad():
                new.weight.copy_(torch.cat([old.weight, old.weight], dim=1))
            setattr(attn, name, new)
        for name in ("q_norm", "k_norm"):  # a Qwen3 layer's: the published head has none
            if hasattr(attn, name):
                delattr(attn, name)
        layer.hidden_norm = type(layer.input_layernorm)(hidden, eps=cfg.rms_norm_eps)
        with torch.no_grad():
            layer.hidden_norm.weight.copy_(layer.input_layernorm.weight)
        self.midlayer = layer
        self.norm = norm
        ids = torch.arange(cfg.vocab_size) if vocab is None else vocab.cpu().long()
        self.lm_head = nn.Linear(hidden, len(ids), bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(target.lm_head.weight[ids.to(target.lm_head.weight.device)].float().cpu())
        self.register_buffer("d2t", ids - torch.arange(len(ids)))
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        self.register_buffer("t2d", t2d)
        self.float()
        self._bind(target, attn)
        self.has_qk_norm = False

    def read_target(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.target.model(input_ids=ids, output_hidden_states=True)
        return torch.cat([out.hidden_states[i] for i in self.feature_layers], dim=-1), out.last_hidden_state

    def logits(self, out: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
        """Its own head over its draft vocabulary (``vocab``'s tokens, in its order)."""
        return self.lm_head(self.norm(out)).float()

    def forward(self, ids: torch.Tensor, features: torch.Tensor, num_passes: int):
        """``ids`` [B, L], ``features`` [B, L, 3H] the target's feature layers. Returns each
        pass's outputs [B, L, H] (pre-norm): row m of pass t predicts token m + 2."""
        batch, length = ids.shape
        nxt = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)  # x_{m+1}; the last row is never used
        layer = self.midlayer
        emb = layer.input_layernorm(self.target.model.embed_tokens(nxt).to(features.dtype))
        positions = torch.arange(length, device=ids.device).expand(batch, length)
        cos, sin = self.target.model.rotary_emb(features, positions)
        keys, values, outs, masks = [], [], [], {}
        feat = self.fc(features)
        for t in range(num_passes):
            x = self._attend(layer, torch.cat([emb, layer.hidden_norm(feat)], dim=-1), feat, cos, sin,
                             keys, values, t, masks)
            outs.append(x)
            feat = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)
        return outs


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE's choice of the target layers an EAGLE-3 head reads (low, middle, high), as
    ``models/eagle.eagle3_feature_layers`` takes it when a head names none."""
    return (2, num_layers // 2, num_layers - 3)


def save_eagle3(head: Eagle3Head, files, init_layers: list[int], out: Path) -> None:
    """The head in the published EAGLE-3 layout: ``model.safetensors`` (bf16 weights,
    int64 ``d2t``, bool ``t2d``) and a config.json of the form EAGLE-3 heads ship with."""
    out.mkdir(parents=True, exist_ok=True)
    state = {n: p.detach().to(torch.bfloat16).cpu().contiguous() for n, p in head.own_parameters().items()}
    state["d2t"], state["t2d"] = head.d2t.cpu().contiguous(), head.t2d.cpu().contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    target = json.loads((files.path / "config.json").read_text())
    cfg = head.config
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
              "hidden_size": cfg.hidden_size, "intermediate_size": head.midlayer.mlp.down_proj.in_features,
              "num_hidden_layers": 1, "num_attention_heads": head.num_heads,
              "num_key_value_heads": head.num_kv_heads, "head_dim": head.head_dim,
              "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
              "attention_bias": False, "mlp_bias": False,
              "vocab_size": cfg.vocab_size, "draft_vocab_size": int(head.lm_head.out_features),
              "target_hidden_size": cfg.hidden_size, "tie_word_embeddings": False,
              "max_position_embeddings": cfg.max_position_embeddings,
              "eagle_aux_hidden_state_layer_ids": list(head.feature_layers), "torch_dtype": "bfloat16"}
    for key in ("rope_theta", "rope_scaling", "rope_parameters", "bos_token_id", "eos_token_id", "pad_token_id"):
        if target.get(key) is not None:
            config[key] = target[key]
    config["specserve_draft"] = {"kind": "eagle", "layout": "eagle3", "target": files.name,
                                 "init_from_target_layers": init_layers,
                                 "trained_by": "python -m specserve.training --arch eagle3"}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_eagle3_weights(head: Eagle3Head, path: Path) -> None:
    """``--init-from`` an EAGLE-3 head saved here: its weights and draft vocabulary."""
    state = load_file(str(path))
    own = head.own_parameters()
    if set(state) != set(own) | {"d2t", "t2d"} or not torch.equal(state["d2t"], head.d2t.cpu()):
        raise SystemExit(f"--init-from {path}: its tensors or its draft vocabulary do not match this "
                         "EAGLE-3 head's (give it the same --draft-vocab and data)")
    with torch.no_grad():
        for name, param in own.items():
            param.copy_(state[name].float())
