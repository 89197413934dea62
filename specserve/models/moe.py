"""Mixture of experts: top-k routed SwiGLU experts in place of a layer's MLP (Mixtral,
Qwen2-MoE, Qwen3-MoE), with Qwen2-MoE's shared expert and its sigmoid gate.

Routing is transformers': softmax over the router's logits in float32, the k largest,
renormalised to sum to 1 where the model says so (``norm_topk_prob``; Mixtral always),
cast to the activations' dtype. Every token is routed on its own, so a verify pass of
1 + k tokens routes each draft as a decode step would.

On a CPU only the experts some token chose run, each over its tokens (the routing is on
the host already). On a GPU the chosen experts run in two grouped GEMM launches, the
(token, expert) pairs sorted by expert on the device (``kernels/fused_moe.py``): no sync,
a step CUDA graphs can capture. ``_dense`` (every expert over every token, weighted) is
the GPU's fallback for experts with a bias, and the tests' reference.
"""
from __future__ import annotations

import torch
from torch import nn

from specserve.distributed import SINGLE, TPGroup
from specserve.errors import ModelLoadError
from specserve.models.mlp import MLP


def num_experts_of(config) -> int:
    return int(getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0)


def is_sparse_layer(config, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` has experts (Qwen-MoE may keep some layers dense)."""
    if layer_idx in (getattr(config, "mlp_only_layers", None) or ()):
        return False
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return num_experts_of(config) > 0 and (layer_idx + 1) % step == 0


class SparseMoE(nn.Module):
    def __init__(self, config, ops, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.num_experts = num_experts_of(config)
        self.top_k = int(config.num_experts_per_tok)
        if not 1 <= self.top_k <= self.num_experts:
            raise ModelLoadError(f"num_experts_per_tok {self.top_k} must be between 1 and the "
                                 f"{self.num_experts} experts")
        # Mixtral's config has no norm_topk_prob: it always renormalises.
        self.norm_topk_prob = bool(getattr(config, "norm_topk_prob", True))
        # Under tensor parallelism each rank holds every expert's share of its rows (as a
        # dense MLP's); the router is replicated, and one all-reduce sums the layer.
        intermediate = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        self.gate = nn.Linear(config.hidden_size, self.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(config, ops, intermediate // tp.size, SINGLE)
                                     for _ in range(self.num_experts))
        shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
        self.shared_expert = MLP(config, ops, shared // tp.size, SINGLE) if shared else None
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False) if shared else None
        self.ops = ops
        self.w13 = self.w2 = None  # the experts' weights stacked, for the grouped GEMMs (``stack_experts``)

    def finish_loading(self) -> None:
        self.stack_experts()

    def linears_replaced(self) -> None:
        """Some linears became other layers (batch-invariant or quantized ones): if the
        experts' are among them, the grouped GEMMs, which read the stacked float weights,
        give way to the experts' own layers."""
        if any(not isinstance(getattr(expert, name), nn.Linear)
               for expert in self.experts for name in ("gate_up_proj", "down_proj")):
            self.w13 = self.w2 = None

    def stack_experts(self) -> None:
        """On a GPU: the experts' gate/up and down weights as ``[E, 2I, H]`` and
        ``[E, H, I]`` tensors for the grouped GEMMs, each expert's own weights becoming
        views into them (no second copy). Called once the weights are loaded."""
        if self.experts[0].gate_up_proj.weight.device.type != "cuda" or self.experts[0].gate_up_proj.bias is not None:
            return
        for name, attr in (("w13", "gate_up_proj"), ("w2", "down_proj")):
            stacked = torch.stack([getattr(e, attr).weight.data for e in self.experts])
            for i, expert in enumerate(self.experts):
                getattr(expert, attr).weight = nn.Parameter(stacked[i], requires_grad=False)
            setattr(self, name, stacked)

    def routing(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights ``[num_tokens, k]`` in x's dtype, experts ``[num_tokens, k]``)."""
        probs = self.gate(x).float().softmax(dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.routing(x)
        if x.device.type == "cpu":
            out = self._routed(x, weights, experts)
        elif self.w13 is not None:
            out = self._grouped(x, weights, experts)
        else:
            out = self._dense(x, weights, experts)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out)

    def _routed(self, x, weights, experts) -> torch.Tensor:
        """Only the chosen experts, each over the tokens that chose it."""
        out = torch.zeros_like(x)
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens, flat_weights = order // self.top_k, weights.flatten()[order]
        start = 0
        for expert, count in enumerate(counts):
            if count:
                rows = tokens[start:start + count]
                out.index_add_(0, rows, self.experts[expert](x[rows]) * flat_weights[start:start + count, None])
                start += count
        return out

    def _grouped(self, x, weights, experts) -> torch.Tensor:
        """The chosen experts in two grouped GEMM launches (``kernels/fused_moe.py``)."""
        from specserve.kernels import fused_moe  # lazy: triton, only on a GPU

        return fused_moe.moe_forward(x, self.w13, self.w2, weights, experts, self.ops.silu_and_mul)

    def _dense(self, x, weights, experts) -> torch.Tensor:
        """Every expert over every token, weighted by its routing weight (0 if not chosen)."""
        dense = torch.zeros(x.shape[0], self.num_experts, dtype=x.dtype, device=x.device)
        dense.scatter_(1, experts, weights)
        out = torch.zeros_like(x)
        for expert, mlp in enumerate(self.experts):
            out += mlp(x) * dense[:, expert:expert + 1]
        return out
