"""Attention backends: how a layer stores its K/V and attends over the paged cache.

The model calls ``backend.store_kv`` then ``backend.attend`` with the step's ForwardBatch;
backends differ only in the kernels behind them. The torch backend runs the references in
``specserve.kernels.reference`` (the CPU path and the test oracle).
"""
from __future__ import annotations

from typing import Protocol

import torch

from specserve.batch import ForwardBatch
from specserve.errors import SpecserveError
from specserve.kernels import reference


class AttentionBackend(Protocol):
    name: str

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, batch: ForwardBatch) -> None: ...

    def attend(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               batch: ForwardBatch, scale: float, sliding_window: int | None) -> torch.Tensor: ...


class TorchAttentionBackend:
    name = "torch"

    def store_kv(self, key, value, k_cache, v_cache, batch):
        reference.store_kv(key, value, k_cache, v_cache, batch.slot_mapping, batch.has_padding)

    def attend(self, query, k_cache, v_cache, batch, scale, sliding_window):
        # Index work is done once per step (per window) and shared by all layers.
        plan = batch.attn_plans.get(sliding_window)
        if plan is None:
            plan = reference.plan_attention(batch.block_tables, batch.query_lens_host,
                                            batch.seq_lens_host, k_cache.shape[1], sliding_window)
            batch.attn_plans[sliding_window] = plan
        return reference.paged_attention(query, k_cache, v_cache, batch.block_tables,
                                         batch.query_lens_host, batch.seq_lens_host,
                                         scale, sliding_window, plan)


def get_backend(name: str, device: torch.device) -> AttentionBackend:
    """``auto`` picks the fastest backend available on ``device``."""
    if name in ("auto", "torch"):
        return TorchAttentionBackend()
    raise SpecserveError(f"unknown attention backend {name!r}")
