"""The decoder layer's glue — RMSNorm (the residual add fused into it), SiLU·mul, rotary
and the KV store — behind one small interface, chosen once per model by its attention
backend.

``TorchLayerOps`` runs the torch references, op for op what the model always ran.
``CpuLayerOps`` (the torch backend on a CPU, once its kernels are built) runs each piece
as one C++ op (``kernels/cpu_ops.cpp``) with the references' numerics: on a CPU a small
model's decode step spends as long dispatching the references' ~25 tiny ops per layer as
it does in their arithmetic. ``TritonLayerOps`` (with the Triton backend, i.e. on CUDA) runs fused
kernels instead — one launch per norm, one for the activation, one for rotary + KV store —
where the torch ops launch about 25 tiny kernels per layer and a small model's decode step
is bound by those launches, not by its weights. Both take and give the same tensors.

The Triton norms and activations can also hand their one consumer, a float8 layer that
rounds its input at run time, that input rounded (``fp8_fusable``; ``Fp8Rows``).
"""
from __future__ import annotations

import torch

from specserve.batch import ForwardBatch
from specserve.kernels import cpu_ops, reference
from specserve.models.rotary import Rotary, apply_rotary

KVCache = tuple[torch.Tensor, torch.Tensor]


class TorchLayerOps:
    """The torch references; rotary from per-step cos/sin tables, the KV store by the
    attention backend."""

    fused = False  # the model's Rotary needs no cos/sin cache
    rms_norm = staticmethod(reference.rms_norm)
    add_rms_norm = staticmethod(reference.add_rms_norm)
    silu_and_mul = staticmethod(reference.silu_and_mul)
    # Gemma's norm and GeGLU: the references here and on the CPU (no C++ kernels for them).
    gemma_rms_norm = staticmethod(reference.gemma_rms_norm)
    gemma_add_rms_norm = staticmethod(reference.gemma_add_rms_norm)
    gelu_tanh_and_mul = staticmethod(reference.gelu_tanh_and_mul)

    def __init__(self, backend) -> None:
        self.backend = backend

    @staticmethod
    def fp8_fusable(width: int, group: int) -> bool:
        """Whether a norm of ``width`` outputs can hand them rounded to float8 in groups of
        ``group`` (its functions' ``fp8_group``): the Triton ones only."""
        return False

    fp8_act_fusable = fp8_fusable  # the same for the activation (``fused_act.fp8_fusable``)

    def rotary_tables(self, rotary: Rotary, positions: torch.Tensor, dtype: torch.dtype):
        """What ``rotary_store_kv`` needs for this step's positions, made once per step."""
        return rotary(positions, dtype)

    def rotary_store_kv(self, qk: torch.Tensor, value: torch.Tensor, tables, kv_cache: KVCache,
                        batch: ForwardBatch, kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
        """Rotate q and k (``qk`` ``[num_tokens, num_heads + num_kv_heads, head_dim]``),
        store k and ``value`` ``[num_tokens, num_kv_heads, head_dim]`` in the cache (a
        float8 one over ``kv_scales``); returns the rotated q ``[num_tokens, num_heads,
        head_dim]``."""
        qk = apply_rotary(qk, *tables)  # q and k rotated together
        num_heads = qk.shape[1] - value.shape[1]
        self.backend.store_kv(qk[:, num_heads:], value, *kv_cache, batch, kv_scales)
        return qk[:, :num_heads]


class CpuLayerOps(TorchLayerOps):
    """The C++ CPU kernels; rotary tables from one C++ op (the torch path's values but for a
    float's last bit of cos / sin), and rotary + KV store in one op, so the attention
    backend's store_kv is not used."""

    def __init__(self, backend) -> None:
        super().__init__(backend)
        self.rms_norm = cpu_ops.rms_norm
        self.add_rms_norm = cpu_ops.add_rms_norm
        self.silu_and_mul = cpu_ops.silu_and_mul
        self.gemma_rms_norm = cpu_ops.gemma_rms_norm
        self.gemma_add_rms_norm = cpu_ops.gemma_add_rms_norm
        self.gelu_tanh_and_mul = cpu_ops.gelu_tanh_and_mul
        self._rotary_store_kv = cpu_ops.rotary_store_kv

    def rotary_tables(self, rotary: Rotary, positions: torch.Tensor, dtype: torch.dtype):
        return cpu_ops.rotary_tables(rotary, positions, dtype)

    def rotary_store_kv(self, qk, value, tables, kv_cache, batch, kv_scales=(1.0, 1.0)):
        # (the C++ kernels' caches are in the model's dtype: kv_scales are 1)
        return self._rotary_store_kv(qk, value, *tables, *kv_cache, batch.slot_mapping)


class TritonLayerOps:
    """The fused Triton kernels (compiled on CUDA, interpreted under TRITON_INTERPRET=1).
    Rotary and the KV store are one launch, so the attention backend's store_kv is not used."""

    fused = True  # the model's Rotary keeps a cos/sin cache

    def __init__(self) -> None:
        # lazy: triton, only on CUDA (or interpreted in tests); the kernels are compiled or
        # interpreted as decided when their module is first imported.
        from specserve.kernels import fused_act, fused_norm, fused_rotary

        self.rms_norm = fused_norm.rms_norm
        self.add_rms_norm = fused_norm.add_rms_norm
        self.silu_and_mul = fused_act.silu_and_mul
        self.gemma_rms_norm = fused_norm.gemma_rms_norm
        self.gemma_add_rms_norm = fused_norm.gemma_add_rms_norm
        self.gelu_tanh_and_mul = fused_act.gelu_tanh_and_mul
        self.fp8_fusable = fused_norm.fp8_fusable
        self.fp8_act_fusable = fused_act.fp8_fusable
        self._rotary_store_kv = fused_rotary.rotary_store_kv

    def rotary_tables(self, rotary: Rotary, positions: torch.Tensor, dtype: torch.dtype):
        return positions, rotary.cos_sin_cache

    def rotary_store_kv(self, qk, value, tables, kv_cache, batch, kv_scales=(1.0, 1.0)):
        positions, cos_sin_cache = tables
        num_heads = qk.shape[1] - value.shape[1]
        return self._rotary_store_kv(qk[:, :num_heads], qk[:, num_heads:], value, positions,
                                     cos_sin_cache, *kv_cache, batch.slot_mapping, *kv_scales)


LayerOps = TorchLayerOps | CpuLayerOps | TritonLayerOps


def layer_ops_for(backend) -> LayerOps:
    """The one switch: fused kernels go with the Triton attention backend, the C++ ones
    with a torch backend made for a CPU that has them."""
    if backend.name == "triton":
        return TritonLayerOps()
    return CpuLayerOps(backend) if backend.cpu_kernels else TorchLayerOps(backend)
