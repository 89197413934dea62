"""Medusa heads: a few small heads on the target's final hidden state, head i proposing the
token i + 1 places after the one the target's own LM head gives.

As the Medusa repository defines them (``medusa/model/medusa_model.py``): head i is
``medusa_num_layers`` residual blocks ``x + SiLU(W x + b)`` and a linear LM head without
bias, over the target's final (normed) hidden state at the last position it computed.
Their weights ship as ``medusa_lm_head.pt`` (the state dict of the heads' ``ModuleList``:
``{i}.{j}.linear.weight``/``.bias``, ``{i}.{L}.weight``), or as safetensors /
``pytorch_model.bin`` with those names under ``medusa_head.``. The number of heads is
read from the tensors (the repository's own loader forces 5, whatever config.json says).
"""
from __future__ import annotations

import json
import re

import torch
import torch.nn.functional as F
from torch import nn

from specserve.errors import ModelLoadError

HEAD_FILE = "medusa_lm_head.pt"
_NAME = re.compile(r"medusa_head\.(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)")


class MedusaHeads(nn.Module):
    """``num_heads`` heads of ``num_layers`` residual blocks and an LM head each."""

    def __init__(self, num_heads: int, num_layers: int, hidden: int, vocab: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(num_layers))
                                    for _ in range(num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(hidden, vocab, bias=False) for _ in range(num_heads))
        self.num_heads, self.num_layers = num_heads, num_layers

    def forward(self, hidden: torch.Tensor, head: int) -> torch.Tensor:
        """Head ``head``'s logits ``[rows, vocab]`` (float32) over final hidden states ``hidden``."""
        x = hidden
        for linear in self.blocks[head]:
            x = x + F.silu(linear(x))
        return self.lm_heads[head](x).float()


def is_medusa_checkpoint(path) -> bool:
    """Whether a draft folder holds Medusa heads (their own file, or a config.json that
    names ``medusa_num_heads``), which are no model of their own and load apart."""
    if (path / HEAD_FILE).is_file():
        return True
    try:
        return "medusa_num_heads" in json.loads((path / "config.json").read_text())
    except (OSError, ValueError, TypeError):  # no config, or not one: not Medusa's (the loader says why)
        return False


def load_medusa_heads(name: str, path, tensors: dict[str, torch.Tensor] | None, hidden: int, vocab: int,
                      dtype: torch.dtype, device: torch.device) -> MedusaHeads:
    """The heads in folder ``path`` (``tensors``: its checkpoint's, where it has no
    ``medusa_lm_head.pt``) for a target of width ``hidden`` and vocabulary ``vocab``,
    loaded exactly: every tensor named as Medusa names them, of the right shape, none
    missing, nothing else."""
    if (path / HEAD_FILE).is_file():
        try:
            state = torch.load(path / HEAD_FILE, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise ModelLoadError(f"{name}: unreadable {HEAD_FILE} ({type(exc).__name__})") from None
        tensors = {f"medusa_head.{key}": value for key, value in state.items()}
    found: dict[tuple[int, int, str], torch.Tensor] = {}
    for key, value in tensors.items():
        match = _NAME.fullmatch(key)
        if match is None:
            raise ModelLoadError(f"{name}: tensor {key!r} is not a Medusa head's (a checkpoint with its base "
                                 "model inside: give the heads alone, medusa_lm_head.pt or medusa_head.* tensors)")
        found[(int(match[1]), int(match[2]), match[3])] = value
    num_heads = 1 + max((i for i, _, _ in found), default=-1)
    lm = {i: j for i, j, kind in found if kind == "weight"}
    if not num_heads or len(lm) != num_heads or len(set(lm.values())) != 1:
        raise ModelLoadError(f"{name}: Medusa heads need an LM head each ({{i}}.{{L}}.weight), at the same depth L")
    num_layers = next(iter(lm.values()))
    model = MedusaHeads(num_heads, num_layers, hidden, vocab)
    expected = {(i, j, kind): param for i in range(num_heads) for j in range(num_layers)
                for kind, param in (("linear.weight", model.blocks[i][j].weight),
                                    ("linear.bias", model.blocks[i][j].bias))}
    expected.update({(i, num_layers, "weight"): model.lm_heads[i].weight for i in range(num_heads)})
    for key in sorted(set(found) | set(expected)):
        label = f"medusa_head.{key[0]}.{key[1]}.{key[2]}"
        if key not in expected:
            raise ModelLoadError(f"{name}: unexpected tensor {label!r} for {num_heads} heads of {num_layers} block(s)")
        if key not in found:
            raise ModelLoadError(f"{name}: Medusa heads lack tensor {label!r}")
        if tuple(found[key].shape) != tuple(expected[key].shape):
            raise ModelLoadError(f"{name}: tensor {label!r} has shape {tuple(found[key].shape)}, expected "
                                 f"{tuple(expected[key].shape)} (a target of hidden size {hidden} and "
                                 f"{vocab} tokens)")
        if not found[key].is_floating_point():
            raise ModelLoadError(f"{name}: tensor {label!r} is {found[key].dtype}, not float weights")
        with torch.no_grad():
            expected[key].copy_(found[key])
    return model.to(device=device, dtype=dtype).eval()
