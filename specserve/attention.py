"""Attention backends: how a layer stores its K/V and attends over the paged cache.

The model calls ``backend.store_kv`` then ``backend.attend`` with the step's ForwardBatch;
backends differ only in the kernels behind them. The torch backend runs the references in
``specserve.kernels.reference`` (the CPU path and the test oracle); the Triton backend runs
``specserve.kernels.store_kv`` and ``specserve.kernels.paged_attention`` (the CUDA path).
With the Triton backend the model also fuses its layer glue (``models/layer_ops.py``),
and its rotary kernel stores K/V itself: only ``attend`` is called then.
"""
from __future__ import annotations

import importlib.util
from typing import Protocol

import torch

from specserve.batch import ForwardBatch
from specserve.errors import SpecserveError
from specserve.kernels import cpu_ops, reference


class AttentionBackend(Protocol):
    name: str
    padded_span: int  # query spans up to this long are padded to the longest of them (0: none)
    # Whether it needs the step's real host-side lengths (else upper bounds will do, as a
    # CUDA graph captured for the worst case gives it).
    exact_lengths: bool
    # Batch-invariant numerics: a row's result does not depend on the rest of its step
    # (the model's linears then run invariant kernels too; models/invariant.py).
    deterministic: bool

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, batch: ForwardBatch, kv_scales: tuple[float, float] = (1.0, 1.0)) -> None:
        """``kv_scales``: a float8 cache's K and V scales for this layer (values are stored
        over them)."""

    def attend(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               batch: ForwardBatch, scale: float, sliding_window: int | None,
               softcap: float | None = None, kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
        """``softcap``: attention logit soft-capping (``reference.paged_attention``);
        ``kv_scales`` as ``store_kv``'s."""

    def warmup_lengths(self, max_model_len: int) -> list[tuple[int, int]]:
        """(longest span, longest sequence) pairs of one-request steps that, run once before
        serving, compile every kernel variant a later step can need (none: nothing compiles
        on first use)."""


class TorchAttentionBackend:
    """The torch references. ``cpu_kernels``: decode rows and verify spans attend in one
    C++ call, and the model's layer glue runs the C++ CPU kernels too
    (``kernels/cpu_ops.py``), instead of the torch ops."""

    name = "torch"
    exact_lengths = True

    def __init__(self, cpu_kernels: bool = False, deterministic: bool = False) -> None:
        self.cpu_kernels = cpu_kernels
        self.deterministic = deterministic
        if deterministic and not cpu_kernels:
            raise SpecserveError("deterministic mode on a CPU needs the C++ CPU kernels, which did not "
                                 "build here (see the warning above) or are switched off "
                                 f"({cpu_ops.ENV_SWITCH}=0)")
        # The references attend decode rows and verify spans together, padded to the
        # longest; the C++ kernel attends each span's own rows. Deterministic: every span,
        # prefill chunks too, goes to the C++ kernel, which sums a row's keys in position
        # order whatever its span (SDPA's order depends on the chunk's shape).
        self.padded_span = 0 if cpu_kernels else reference.SHORT_SPAN
        self.max_kernel_span = (1 << 30) if deterministic else reference.SHORT_SPAN

    def store_kv(self, key, value, k_cache, v_cache, batch, kv_scales=(1.0, 1.0)):
        reference.store_kv(key, value, k_cache, v_cache, batch.slot_mapping, batch.has_padding, *kv_scales)

    def warmup_lengths(self, max_model_len):
        return []  # torch ops and the C++ kernels: nothing compiles per shape

    def attend(self, query, k_cache, v_cache, batch, scale, sliding_window, softcap=None, kv_scales=(1.0, 1.0)):
        # Index work is done once per step (per window) and shared by all layers. With the
        # CPU kernels, the short spans go to one C++ call and the plan keeps the long ones.
        plan = batch.attn_plans.get(sliding_window)
        if plan is None:
            plan = reference.plan_attention(batch.block_tables, batch.query_lens_host,
                                            batch.seq_lens_host, k_cache.shape[1], sliding_window,
                                            short_spans=not self.cpu_kernels,
                                            long_spans=not self.deterministic, tree_masks=batch.tree_masks)
            batch.attn_plans[sliding_window] = plan
        out = None
        if self.cpu_kernels:  # (whose caches are in the model's dtype: kv_scales are 1)
            out = torch.empty_like(query)
            cpu_ops.paged_attention_short(query, k_cache, v_cache, batch.block_tables, batch.cu_query_lens,
                                          batch.seq_lens, scale, sliding_window, self.max_kernel_span, out,
                                          softcap, batch.tree_masks)
            if not plan.spans:
                return out
        return reference.paged_attention(query, k_cache, v_cache, batch.block_tables,
                                         batch.query_lens_host, batch.seq_lens_host,
                                         scale, sliding_window, plan, out, softcap, *kv_scales)


class TritonAttentionBackend:
    """Triton kernels: one KV-store launch and one ragged paged-attention launch (plus a
    split reduce) per layer. Tile sizes and split counts are planned once per step from
    the batch's host-side lengths, so no layer syncs with the device."""

    name = "triton"
    padded_span = 0
    exact_lengths = False  # lengths only plan tiles and splits; the kernels read the real ones

    def __init__(self, deterministic: bool = False) -> None:
        self.deterministic = deterministic
        # lazy: triton, only for this backend; the kernels are compiled (or interpreted, under
        # TRITON_INTERPRET=1) as decided when their module is first imported.
        from specserve.kernels import paged_attention, store_kv

        self._attention = paged_attention
        self._store_kv = store_kv.store_kv

    def store_kv(self, key, value, k_cache, v_cache, batch, kv_scales=(1.0, 1.0)):
        self._store_kv(key, value, k_cache, v_cache, batch.slot_mapping, *kv_scales)

    def warmup_lengths(self, max_model_len):
        return self._attention.warmup_lengths(max_model_len)

    def attend(self, query, k_cache, v_cache, batch, scale, sliding_window, softcap=None, kv_scales=(1.0, 1.0)):
        key = ("triton", *query.shape[1:], k_cache.shape[2])
        plan = batch.attn_plans.get(key)
        if plan is None:
            plan = self._attention.plan_launch(query, k_cache, len(batch.seq_lens_host),
                                               max(batch.query_lens_host), max(batch.seq_lens_host),
                                               deterministic=self.deterministic)
            batch.attn_plans[key] = plan
        return self._attention.paged_attention(
            query, k_cache, v_cache, batch.block_tables, batch.cu_query_lens, batch.seq_lens,
            scale, sliding_window, plan=plan, softcap=softcap, k_scale=kv_scales[0], v_scale=kv_scales[1],
            tree_masks=batch.tree_masks)


BACKENDS = ("auto", "torch", "triton")


def get_backend(name: str, device: torch.device, deterministic: bool = False) -> AttentionBackend:
    """``auto``: Triton on CUDA (when triton is installed), the torch reference elsewhere
    (on a CPU with the C++ layer kernels, where they build). ``deterministic``: batch-
    invariant kernels (the C++ kernels on a CPU, Triton on CUDA).
    ``triton`` on a CPU device runs only under the Triton interpreter (TRITON_INTERPRET=1,
    set before the kernels are first imported) — slow, for tests."""
    if name not in BACKENDS:
        raise SpecserveError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "auto":
        name = "triton" if device.type == "cuda" and _triton_installed() else "torch"
    if name == "torch":
        if device.type != "cpu":
            if deterministic:
                raise SpecserveError("deterministic mode on CUDA needs the triton attention backend")
            return TorchAttentionBackend()
        return TorchAttentionBackend(cpu_kernels=cpu_ops.available(), deterministic=deterministic)
    if not _triton_installed():
        raise SpecserveError("attention backend 'triton' needs the triton package (pip install triton)")
    from specserve.kernels.paged_attention import interpreted  # lazy: triton, only for its backend

    if device.type != "cuda" and not interpreted():
        raise SpecserveError(f"attention backend 'triton' needs a CUDA device, not {device.type}; "
                             "use 'torch', or run under the Triton interpreter (TRITON_INTERPRET=1)")
    return TritonAttentionBackend(deterministic)


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None
