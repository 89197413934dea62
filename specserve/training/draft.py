"""A layers-only draft: built from the target's own layers, warm-started from a
checkpoint and grown by more layers, and saved in the format the engine loads."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specserve.errors import ModelLoadError
from specserve.loader import INT8_SCALE_SUFFIX, dequantize_int8_state, quantize_int8_rows


def parse_init_layers(spec: str, num_layers: int, target_layers: int) -> list[int]:
    if spec == "first-last":
        layers = list(range(num_layers - 1)) + [target_layers - 1]
    elif spec == "spread":
        layers = [round(i * (target_layers - 1) / max(1, num_layers - 1)) for i in range(num_layers)]
    elif spec == "first":
        layers = list(range(num_layers))
    else:
        layers = [int(x) for x in spec.split(",")]
    if len(layers) != num_layers or not all(0 <= i < target_layers for i in layers):
        raise SystemExit(f"--init-layers {spec!r}: need {num_layers} indices in [0, {target_layers})")
    return layers


def parse_added_layers(args, from_layers_draft: bool, target_layers: int) -> list[int]:
    if not args.add_layers:
        return []
    if not from_layers_draft or args.arch == "eagle":
        raise SystemExit("--add-layers grows a layers-only draft: name it with --init-from")
    try:
        added = [int(x) % target_layers for x in args.add_layers.split(",")]
    except ValueError:
        raise SystemExit(f"--add-layers {args.add_layers!r}: comma-separated layer indices") from None
    return added


def build_draft(target, init_layers: list[int], device: torch.device, intermediate_size: int | None = None):
    """A ``len(init_layers)``-layer HF model of the target's family: its layers and final
    norm copied from the target (float32 master weights), its embeddings and LM head the
    target's own modules (frozen). A narrower MLP keeps the target's widest neurons."""
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = len(init_layers)
    config.intermediate_size = intermediate_size or config.intermediate_size
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in init_layers]
    draft = type(target)(config)
    for mine, theirs in zip(draft.model.layers, init_layers):
        mine.load_state_dict(_narrowed(target.model.layers[theirs].state_dict(), config.intermediate_size))
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    draft = draft.float().to(device)
    draft.model.embed_tokens = target.model.embed_tokens
    draft.lm_head = target.lm_head
    return draft


def load_own_weights(draft, path: Path, layer_at: list[int] | None = None) -> None:
    """The draft's own layers and norm from a checkpoint ``save_draft`` wrote (its int8
    matrices dequantised). ``layer_at[i]``: the draft layer that takes checkpoint layer i (a
    grown draft, ``grow_draft``); the other layers keep their weights."""
    try:
        state = dequantize_int8_state(load_file(str(path)), str(path))
    except ModelLoadError as exc:
        raise SystemExit(f"--init-from: {exc}") from None
    own = own_parameters(draft)
    expected = set(own)
    if layer_at is not None:
        def moved(name: str) -> str:
            parts = name.split(".")
            if parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) < len(layer_at):
                parts[2] = str(layer_at[int(parts[2])])
            return ".".join(parts)
        state = {moved(name): t for name, t in state.items()}
        taken = {str(i) for i in layer_at}
        expected = {n for n in own if not n.startswith("model.layers.") or n.split(".")[2] in taken}
    if set(state) != expected:
        raise SystemExit(f"--init-from {path}: its tensors do not match a {len(draft.model.layers)}-layer draft")
    with torch.no_grad():
        for name, tensor in state.items():
            own[name].copy_(tensor.float())


def grow_draft(target, start_layers: list[int], added: list[int], device: torch.device,
               intermediate_size: int, checkpoint: Path):
    """A draft of target layers ``start_layers`` + ``added`` (in target order; none added:
    the checkpoint as it is): the checkpoint's layers where they were, each added layer copied from the target (MLP
    narrowed as ``build_draft``) with ``o_proj`` and ``down_proj`` at zero. Those layers
    then add nothing to the residual stream: the grown draft computes exactly what the
    checkpoint does, and training starts from there. Returns (draft, its target layers)."""
    if set(added) & set(start_layers) or len(set(added)) != len(added):
        raise SystemExit(f"--add-layers {added}: the checkpoint already has target layers {start_layers}")
    layers = list(start_layers)  # their order kept; each added one before the first higher one
    for i in sorted(added):
        layers.insert(next((at for at, j in enumerate(layers) if j > i), len(layers)), i)
    draft = build_draft(target, layers, device, intermediate_size)
    load_own_weights(draft, checkpoint, [layers.index(i) for i in start_layers])
    with torch.no_grad():
        for i in added:
            layer = draft.model.layers[layers.index(i)]
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return draft, layers


def _narrowed(state: dict, width: int) -> dict:
    """A decoder layer's weights with only the ``width`` MLP neurons of largest
    ‖down column‖ · (‖gate row‖ + ‖up row‖)."""
    gate, up, down = (state[f"mlp.{n}_proj.weight"] for n in ("gate", "up", "down"))
    if gate.shape[0] == width:
        return state
    importance = down.float().norm(dim=0) * (gate.float().norm(dim=1) + up.float().norm(dim=1))
    keep = importance.topk(width).indices.sort().values
    state = dict(state)
    for name in ("gate_proj.weight", "up_proj.weight", "gate_proj.bias", "up_proj.bias"):
        if f"mlp.{name}" in state:
            state[f"mlp.{name}"] = state[f"mlp.{name}"][keep]
    state["mlp.down_proj.weight"] = down[:, keep]
    return state


def own_parameters(draft) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in draft.named_parameters()
            if n.startswith(("model.layers.", "model.norm."))}


def save_draft(draft, files, init_layers: list[int], out: Path, weights: str = "bfloat16") -> None:
    """The draft's own layers and norm; with ``weights="int8"`` each matrix as int8 values
    and a scale per row (``loader.quantize_int8_rows``), the norms in bf16."""
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, p in own_parameters(draft).items():
        p = p.detach().cpu()
        if weights == "int8" and p.dim() == 2:
            state[name], state[name + INT8_SCALE_SUFFIX] = quantize_int8_rows(p)
        else:
            state[name] = p.to(torch.bfloat16).contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((files.path / "config.json").read_text())
    for key in ("_name_or_path", "_model_name_or_path", "transformers_version", "id2label", "label2id"):
        config.pop(key, None)
    config["num_hidden_layers"] = len(init_layers)
    config["intermediate_size"] = draft.config.intermediate_size
    if config.get("layer_types"):
        config["layer_types"] = [config["layer_types"][i] for i in init_layers]
    config["dtype"] = "bfloat16"
    config["specserve_draft"] = {"shares_target_embeddings": True, "target": files.name,
                                 "init_from_target_layers": init_layers, "weights": weights,
                                 "trained_by": "python -m specserve.training"}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
