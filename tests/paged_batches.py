"""Ragged batches over a paged KV cache for the attention kernels' tests (Triton and C++):
each request's keys and values at the slots of its own blocks, every other slot NaN."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.kernels import reference


@dataclass
class Batch:
    query: torch.Tensor          # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor        # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor   # [num_reqs, max_blocks] int32
    cu_query_lens: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor       # [num_reqs] int32
    query_lens_host: list[int]
    seq_lens_host: list[int]


def make_batch(spans, num_heads, num_kv_heads, head_dim, block_size, dtype, device,
               num_blocks: int, seed: int = 0) -> Batch:
    """A NaN cache with random K/V at each request's slots, reached through block tables
    drawn from a random permutation (non-contiguous, unordered block ids)."""
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    free = torch.randperm(num_blocks, generator=g, device=device).tolist()
    tables = []
    for _, kv_len in spans:
        table = [free.pop() for _ in range(-(-kv_len // block_size))]
        slots = torch.tensor(table, device=device)[:, None] * block_size + torch.arange(block_size, device=device)
        slots = slots.flatten()[:kv_len]
        kv = torch.randn(2, kv_len, num_kv_heads, head_dim, generator=g, device=device).to(dtype)
        reference.store_kv(kv[0], kv[1], k_cache, v_cache, slots, has_padding=False)
        tables.append(table)
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    query_lens = [q for q, _ in spans]
    seq_lens = [kv for _, kv in spans]
    cu = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=g, device=device).to(dtype)
    return Batch(query, k_cache, v_cache, block_tables, cu,
                 torch.tensor(seq_lens, dtype=torch.int32, device=device), query_lens, seq_lens)
