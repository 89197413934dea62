"""A quantized llama's decoder layers in one C++ call on the CPU (``kernels/cpu_layer.cpp``),
for steps whose every span the C++ attention kernel takes (decode rows and verify spans;
prefill chunks longer than that run layer by layer in Python). Where nothing reads the
layers' output but the LM head, the whole pass is that call, from token ids to float32
logits (``logits``).

The call runs the same arithmetic as the layers' Python does, in the same order, so the
output is bitwise the same. It drops the module calls, views and Python-side dispatch
around them, which on a small model's decode step cost more than the layers' arithmetic
and do not shrink with threads; and where the step's rows are few, it runs all the layers
in one parallel region, its threads meeting at barriers instead of forking for each piece.
"""
from __future__ import annotations

import torch
from torch import nn

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

    def logits(self, model, kv_caches, batch) -> torch.Tensor | None:
        """The float32 logits of the rows ``batch.logits_indices`` of ``model``'s pass over
        ``batch``, in one C++ call (``quant_model_logits``): the embedding rows, the rotary
        tables, the layers, the final norm and the LM head (or a draft's vocabulary head,
        its logits put in the full vocabulary's columns there, -inf elsewhere). The same ops
        on the same values as the pass from Python, so the same bits. None where the pass
        needs more than that: a span the attention kernel does not take, embeddings scaled
        or not a plain contiguous table, logits soft-capped, a head not quantized, the
        layers' rows read (an EAGLE-3 head's taps)."""
        inner = model.model
        head = model.vocab_head if model.vocab_ids is not None else model.lm_head
        if (not self.covers(batch) or not isinstance(head, QuantLinear) or inner.embed_scale is not None
                or inner.final_softcap or model.tp.size != 1 or model.feature_layers
                or inner.norm._add_norm is not cpu_ops.add_rms_norm
                or not isinstance(inner.embed_tokens, nn.Embedding) or not inner.embed_tokens.weight.is_contiguous()):
            return None
        weights, meta, eps, scale = self._run(0, len(self.layers))
        head_tensors = [inner.norm.weight, head.packed, head.scales, head.mins]
        if head.bias is not None:
            head_tensors.append(head.bias)
        return torch.ops.specserve_cpu.quant_model_logits(
            batch.input_ids, inner.embed_tokens.weight, batch.positions, cpu_ops.rope_tensors(inner.rotary),
            inner.rotary.long_offset, weights, meta, eps, scale, [k for k, _ in kv_caches], [v for _, v in kv_caches],
            batch.slot_mapping, batch.block_tables, batch.cu_query_lens, batch.seq_lens, self.backend.max_kernel_span,
            batch.tree_masks, head_tensors, [head.bits, head.group, head.dequant_rows], inner.norm.eps,
            batch.logits_indices, model.vocab_ids, model.config.vocab_size)

    def _run(self, start: int, stop: int) -> tuple:
        """Layers ``start`` to ``stop``'s arguments to the C++ op, joined (made once)."""
        run = self._runs.get((start, stop))
        if run is None:
            layers = self.layers[start:stop]
            run = self._runs[(start, stop)] = ([w for weights, _, _, _ in layers for w in weights],
                                               [v for _, meta, _, _ in layers for v in meta],
                                               [eps for _, _, eps, _ in layers], [scale for *_, scale in layers])
        return run

    def run(self, hidden: torch.Tensor, residual: torch.Tensor | None, tables, kv_caches, batch,
            start: int, stop: int):
        """Layers ``start`` to ``stop`` (exclusive) over the residual stream ``hidden`` +
        ``residual`` (None: ``hidden`` alone); returns the next (hidden, residual)."""
        if start >= stop:
            return hidden, residual
        weights, meta, eps, scale = self._run(start, stop)
        cos, sin = tables
        return torch.ops.specserve_cpu.quant_decoder_layers(
            hidden, residual, weights, meta, eps, scale, cos, sin, [k for k, _ in kv_caches[start:stop]],
            [v for _, v in kv_caches[start:stop]], batch.slot_mapping, batch.block_tables, batch.cu_query_lens,
            batch.seq_lens, self.backend.max_kernel_span, batch.tree_masks)
