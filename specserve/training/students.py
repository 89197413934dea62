"""What training trains, behind one interface (``Student``): a layers-only draft, or an
EAGLE head that drafts from the target's hidden states. ``make_student`` builds either
from the arguments: new, warm-started from a checkpoint, or grown by target layers."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from specserve.training.draft import (
    build_draft,
    grow_draft,
    own_parameters,
    parse_added_layers,
    parse_init_layers,
    save_draft,
)
from specserve.training.eagle3_head import Eagle3Head, default_feature_layers, load_eagle3_weights, save_eagle3
from specserve.training.eagle_head import EagleHead, head_losses, load_head_weights, save_head
from specserve.training.losses import TargetDistribution, distill_loss, logits_at


# Target families whose dense decoder layer an EAGLE-3 head (a Llama layer) can start from.
EAGLE3_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


class Student(Protocol):
    """A draft in training, bound to its target and draft vocabulary."""

    module: nn.Module
    init_layers: list[int]  # the target layers it started from
    passes: int             # the draft depth its validation replays

    def parameters(self) -> dict[str, nn.Parameter]:
        """What it trains, by checkpoint name."""

    def param_groups(self, weight_decay: float, fc_lr_mult: float) -> list[dict]:
        """AdamW's groups (``lr_mult`` scales the learning rate)."""

    def losses(self, ids: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
               ce_weight: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss, kl, ce) on a batch's training rows."""

    def score(self, ids: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Validation's (mean KL, agreement with the target ``[passes, rows]``)."""

    def save(self, files, out: Path) -> None:
        """The checkpoint the engine loads."""

    def record(self) -> dict:
        """What the training record says of it beyond the arguments."""


def _param_groups(params: dict[str, nn.Parameter], weight_decay: float,
                  lr_mults: dict[str, float] | None = None) -> list[dict]:
    """Matrices decay, vectors do not; parameters under a prefix of ``lr_mults`` get a
    group of their own at that multiple of the learning rate."""
    lr_mults = lr_mults or {}
    scaled = {prefix: [p for n, p in params.items() if n.startswith(prefix)] for prefix in lr_mults}
    rest = {n: p for n, p in params.items() if not n.startswith(tuple(lr_mults))}
    groups = [{"params": [p for p in rest.values() if p.dim() >= 2], "weight_decay": weight_decay, "lr_mult": 1.0},
              {"params": [p for p in rest.values() if p.dim() < 2], "weight_decay": 0.0, "lr_mult": 1.0}]
    groups += [{"params": ps, "weight_decay": weight_decay, "lr_mult": lr_mults[prefix]}
               for prefix, ps in scaled.items() if ps]
    return groups


class LayersStudent:
    """A few decoder layers of the target's family on the target's own embeddings and LM
    head, distilled under teacher forcing: one row of logits per position."""

    passes = 4

    def __init__(self, draft, target, init_layers: list[int], vocab: torch.Tensor | None,
                 weights: str = "bfloat16") -> None:
        self.module, self.target, self.init_layers = draft, target, init_layers
        self.vocab, self.weights = vocab, weights

    def parameters(self) -> dict[str, nn.Parameter]:
        return own_parameters(self.module)

    def param_groups(self, weight_decay: float, fc_lr_mult: float) -> list[dict]:
        return _param_groups(self.parameters(), weight_decay)

    def losses(self, ids, rows, cols, ce_weight):
        with torch.no_grad():
            t_logits = logits_at(self.target, ids, rows, cols)
        d_logits = logits_at(self.module, ids, rows, cols, self.vocab)
        return distill_loss(d_logits, t_logits, ce_weight, self.vocab)

    def score(self, ids, rows, cols):
        t_logits = logits_at(self.target, ids, rows, cols)
        d_logits = logits_at(self.module, ids, rows, cols, self.vocab)
        _, kl, _, agree = TargetDistribution(t_logits, self.vocab).loss(d_logits, 0.0)
        return kl, agree[None]

    def save(self, files, out: Path) -> None:
        save_draft(self.module, files, self.init_layers, out, self.weights)
        _save_vocab(out, self.vocab)

    def record(self) -> dict:
        return {}


class EagleStudent:
    """An EAGLE head, its ``passes`` draft steps unrolled in training (``eagle_head.py``)."""

    def __init__(self, head: EagleHead, target, init_layers: list[int], vocab: torch.Tensor | None,
                 passes: int) -> None:
        self.module, self.target, self.init_layers = head, target, init_layers
        self.vocab, self.passes = vocab, passes

    def parameters(self) -> dict[str, nn.Parameter]:
        return self.module.own_parameters()

    def param_groups(self, weight_decay: float, fc_lr_mult: float) -> list[dict]:
        # fc is the head's only path from the features: a head started from a trained
        # draft has its features' half at zero while its layers are already trained.
        return _param_groups(self.parameters(), weight_decay, {"fc.": fc_lr_mult})

    def losses(self, ids, rows, cols, ce_weight):
        loss, kl, ce, _ = head_losses(self.module, self.target, ids, rows, cols, self.passes, ce_weight,
                                      self.vocab)
        return loss, kl, ce

    def score(self, ids, rows, cols):
        _, kl, _, agree = head_losses(self.module, self.target, ids, rows, cols, self.passes, 0.0, self.vocab)
        return kl, agree

    def save(self, files, out: Path) -> None:
        save_head(self.module, files, self.init_layers, out)
        _save_vocab(out, self.vocab)

    def record(self) -> dict:
        return {"input_norms": self.module.input_norms}


class Eagle3Student(EagleStudent):
    """An EAGLE-3 head (``eagle3_head.py``): as an EAGLE head, over three target layers'
    features and its own LM head; saved in the published layout, its draft vocabulary in
    its ``d2t`` map."""

    def save(self, files, out: Path) -> None:
        save_eagle3(self.module, files, self.init_layers, out)

    def record(self) -> dict:
        return {"feature_layers": list(self.module.feature_layers)}


def _save_vocab(out: Path, vocab: torch.Tensor | None) -> None:
    """``draft_vocab.json``: the tokens a draft proposes among (``--draft-vocab``)."""
    if vocab is not None:
        (out / "draft_vocab.json").write_text(json.dumps(vocab.tolist()) + "\n")


def make_student(args, target, device: torch.device, vocab: torch.Tensor | None) -> Student:
    """The student ``args`` ask for: ``--arch`` layers, eagle or eagle3, new (from target
    layers), or from ``--init-from`` a checkpoint (a layers-only draft may grow by
    ``--add-layers``; an EAGLE head may start as a layers-only draft; an EAGLE-3 head
    continues only from one). Sets ``args.num_layers`` and
    ``args.intermediate_size`` to the student's (the record reports them)."""
    total = target.config.num_hidden_layers
    start = json.loads((Path(args.init_from) / "config.json").read_text()) if args.init_from else None
    start_layout = start and start["specserve_draft"].get("layout")
    if start_layout == "eagle3" and args.arch != "eagle3":
        raise SystemExit(f"--init-from {args.init_from} is an EAGLE-3 head: add --arch eagle3")
    if args.arch == "eagle3" and start and start_layout != "eagle3":
        raise SystemExit(f"--arch eagle3 continues only from an EAGLE-3 head; {args.init_from} is not one")
    if start:  # a warm start: the checkpoint's shape, then its weights
        init_layers = start["specserve_draft"]["init_from_target_layers"]
        args.num_layers, args.intermediate_size = len(init_layers), start["intermediate_size"]
    elif args.arch in ("eagle", "eagle3"):
        try:
            init_layers = [int(x) % total for x in args.eagle_init_layers.split(",")]
        except ValueError:
            raise SystemExit(f"--eagle-init-layers {args.eagle_init_layers!r}: comma-separated layer indices") from None
        args.num_layers, args.intermediate_size = len(init_layers), target.config.intermediate_size
    else:
        init_layers = parse_init_layers(args.init_layers, args.num_layers, total)
    width = target.config.intermediate_size * 2 // 3
    args.intermediate_size = args.intermediate_size or (width // 64 * 64 if width >= 64 else width)
    start_is_eagle = bool(start) and start["specserve_draft"].get("kind") == "eagle"
    if args.weights != "bfloat16" and args.arch != "layers":
        raise SystemExit("--weights int8 stores a layers-only draft; an EAGLE head is saved in bf16")
    if args.arch == "eagle3":
        if target.config.model_type not in EAGLE3_FAMILIES:
            raise SystemExit(f"--arch eagle3: its head is a Llama layer, started from a target layer of a "
                             f"family with the same layer ({', '.join(EAGLE3_FAMILIES)}); the target is "
                             f"{target.config.model_type}")
        if len(init_layers) != 1:
            raise SystemExit("--arch eagle3: a head of one layer (--eagle-init-layers names one target layer)")
        draft = build_draft(target, init_layers, device, args.intermediate_size)
        layers = _feature_layers(args.eagle3_layers, total)
        if start:
            layers = tuple(start["eagle_aux_hidden_state_layer_ids"])
        head = Eagle3Head(target, draft.model.layers[0], draft.model.norm, layers, vocab).to(device)
        if start:
            load_eagle3_weights(head, Path(args.init_from) / "model.safetensors")
        return Eagle3Student(head, target, init_layers, vocab, args.passes)
    if start_is_eagle and args.arch != "eagle":
        raise SystemExit(f"--init-from {args.init_from} is an EAGLE head: add --arch eagle")
    from_layers_draft = bool(start) and not start_is_eagle
    added = parse_added_layers(args, from_layers_draft, total)
    if from_layers_draft:  # a warm start, grown by the added layers if any
        draft, init_layers = grow_draft(target, init_layers, added, device, args.intermediate_size,
                                        Path(args.init_from) / "model.safetensors")
        args.num_layers = len(init_layers)
    else:
        draft = build_draft(target, init_layers, device, args.intermediate_size)
    if args.arch != "eagle":
        return LayersStudent(draft, target, init_layers, vocab, args.weights)
    # From a layers-only draft: start as that draft; else on embedding + feature.
    norms = args.eagle_input_norms
    if start_is_eagle:
        had = bool(start["specserve_draft"].get("input_norms"))
        if norms is not None and norms != had:
            raise SystemExit(f"--init-from {args.init_from} has input_norms {had}: drop --[no-]eagle-input-norms")
        norms = had
    head = EagleHead(target, draft.model.layers, draft.model.norm, "tokens" if from_layers_draft else "sum",
                     input_norms=not from_layers_draft if norms is None else norms).to(device)
    if start_is_eagle:
        load_head_weights(head, Path(args.init_from) / "model.safetensors")
    return EagleStudent(head, target, init_layers, vocab, args.passes)


def _feature_layers(spec: str | None, total: int) -> tuple[int, ...]:
    """``--eagle3-layers``: three distinct target layers (negative: from the end), else EAGLE's."""
    if not spec:
        layers = default_feature_layers(total)
    else:
        try:
            layers = tuple(int(x) % total for x in spec.split(","))
        except ValueError:
            raise SystemExit(f"--eagle3-layers {spec!r}: three comma-separated layer indices") from None
    if len(set(layers)) != 3 or not all(0 <= i < total for i in layers):
        raise SystemExit(f"--eagle3-layers: three distinct layers of the target's {total}, got {list(layers)}")
    return tuple(sorted(layers))
