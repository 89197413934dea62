"""A quantized llama's decoder layers in one C++ call on the CPU (``kernels/cpu_layer.cpp``),
for steps whose every span the C++ attention kernel takes (decode rows and verify spans;
prefill chunks longer than that run layer by layer in Python).

The call runs the same arithmetic as the layers' Python does, in the same order, so the
output is bitwise the same. It drops the module calls, views and Python-side dispatch
around them, which on a small model's decode step cost more than the layers' arithmetic
and do not shrink with threads; and where the step's rows are few, it runs all the layers
in one parallel region, its threads meeting at barriers instead of forking for each piece.
"""
from __future__ import annotations

import torch

from specserve.kernels import cpu_ops
from specserve.models.layer_ops import CpuLayerOps
from specserve.models.mlp import MLP
from specserve.models.quantized import QuantLinear


class FusedCpuLayers:
    def __init__(self, model) -> None:
        self.backend = model.attention_backend
        self.layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            weights = [layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()]
            meta = [attn.num_heads, attn.num_kv_heads, attn.head_dim]
            for linear in linears:
                weights += [linear.packed, linear.scales, linear.mins]
                meta += [linear.bits, linear.group]
            meta.append(min(linear.dequant_rows for linear in linears))  # (all alike: the model's setting)
            self.layers.append((weights, meta, layer.input_layernorm.eps, attn.scale))
        self._runs: dict[tuple[int, int], tuple] = {}  # (start, stop) -> the op's per-layer lists, joined

    @staticmethod
    def of(model) -> FusedCpuLayers | None:
        """The fused layers where every layer is a plain llama layer over QuantLinears
        with the C++ kernels (no biases, q/k norms, windows, soft-caps, MoE or Gemma
        norms), else None."""
        if not (isinstance(model.model.ops, CpuLayerOps) and cpu_ops.available() and model.tp.size == 1
                and model.model.rotary_local is None):
            return None
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if (layer.sandwich or not isinstance(mlp, MLP) or mlp.act_and_mul is not cpu_ops.silu_and_mul
                    or attn.q_norm is not None or attn.sliding_window is not None or attn.softcap
                    or attn.rotary_order is not None
                    or layer.input_layernorm._norm is not cpu_ops.rms_norm):
                return None
            for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                if not isinstance(linear, QuantLinear) or linear.bias is not None:
                    return None
        return FusedCpuLayers(model)

    def covers(self, batch) -> bool:
        """Whether the C++ attention kernel takes every span of this step."""
        return max(batch.query_lens_host, default=0) <= self.backend.max_kernel_span

    def run(self, hidden: torch.Tensor, residual: torch.Tensor | None, tables, kv_caches, batch,
            start: int, stop: int):
        """Layers ``start`` to ``stop`` (exclusive) over the residual stream ``hidden`` +
        ``residual`` (None: ``hidden`` alone); returns the next (hidden, residual)."""
        if start >= stop:
            return hidden, residual
        run = self._runs.get((start, stop))
        if run is None:
            layers = self.layers[start:stop]
            run = self._runs[(start, stop)] = ([w for weights, _, _, _ in layers for w in weights],
                                               [v for _, meta, _, _ in layers for v in meta],
                                               [eps for _, _, eps, _ in layers], [scale for *_, scale in layers])
        weights, meta, eps, scale = run
        cos, sin = tables
        return torch.ops.specserve_cpu.quant_decoder_layers(
            hidden, residual, weights, meta, eps, scale, cos, sin, [k for k, _ in kv_caches[start:stop]],
            [v for _, v in kv_caches[start:stop]], batch.slot_mapping, batch.block_tables, batch.cu_query_lens,
            batch.seq_lens, self.backend.max_kernel_span, batch.tree_masks)
