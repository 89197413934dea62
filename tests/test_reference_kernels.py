"""The paged-attention and KV-store references against dense attention on unpaged K/V."""
from __future__ import annotations

import pytest
import torch

from specserve.kernels import reference


def dense_attention(q, k, v, scale, window=None, softcap=None):
    """q [Lq, H, D] are the last Lq positions of k/v [Lk, Hkv, D]; as transformers' eager
    attention writes soft-capping (Gemma 2): scores / cap, tanh, × cap, then the mask."""
    lq, lk = q.shape[0], k.shape[0]
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    qpos = torch.arange(lk - lq, lk)[:, None]
    kpos = torch.arange(lk)[None, :]
    allowed = kpos <= qpos
    if window is not None:
        allowed &= kpos > qpos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("heads, kv_heads, window, softcap", [(8, 2, None, None), (5, 1, None, None),
                                                              (4, 4, 6, None), (8, 2, None, 0.5), (4, 4, 6, 0.5)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_attention_matches_dense(heads, kv_heads, window, softcap, block_size):
    g = torch.Generator().manual_seed(0)
    head_dim, num_blocks = 16, 400
    # (query len, kv len): decode rows, verify-length spans and a whole short prompt share
    # one batched call (up to SHORT_SPAN tokens); longer spans go one by one.
    spans = [(1, 133), (5, 18), (29, 46), (1, 1), (1, 7), (reference.SHORT_SPAN, reference.SHORT_SPAN),
             (reference.SHORT_SPAN + 1, 40), (3, 70)]
    # Unwritten slots hold NaN: keys past a request's length must never reach its output.
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables, qs, dense_kv = [], [], []
    for q_len, kv_len in spans:
        table = [free.pop() for _ in range(-(-kv_len // block_size))]
        k = torch.randn(kv_len, kv_heads, head_dim, generator=g)
        v = torch.randn(kv_len, kv_heads, head_dim, generator=g)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(kv_len)])
        reference.store_kv(k, v, k_cache, v_cache, slots)
        tables.append(table)
        qs.append(torch.randn(q_len, heads, head_dim, generator=g))
        dense_kv.append((k, v))
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    out = reference.paged_attention(torch.cat(qs), k_cache, v_cache, block_tables,
                                    [s[0] for s in spans], [s[1] for s in spans], 0.25, window,
                                    softcap=softcap)
    want = torch.cat([dense_attention(q, k, v, 0.25, window, softcap) for q, (k, v) in zip(qs, dense_kv)])
    assert (out - want).abs().max().item() < 1e-5
    if softcap is not None:  # a cap this low changes most rows (not one with a single key)
        uncapped = torch.cat([dense_attention(q, k, v, 0.25, window) for q, (k, v) in zip(qs, dense_kv)])
        assert (out - uncapped).abs().amax(dim=(1, 2)).median() > 0.05


def test_short_spans_share_one_batched_call():
    """Decode rows and verify spans form one padded group; only the prefill chunk is a span."""
    block_tables = torch.arange(12, dtype=torch.int32).view(3, 4)
    plan = reference.plan_attention(block_tables, [1, 5, 20], [9, 14, 30], 8, None)
    assert plan.short_rows.tolist() == [[0, 0, 0, 0, 0], [1, 2, 3, 4, 5]]
    assert plan.short_real.tolist() == [[True] + [False] * 4, [True] * 5]
    assert [rows for rows, _, _ in plan.spans] == [slice(6, 26)]
    # Request 1's queries sit at positions 9..13: query j sees keys 0..9+j.
    assert plan.short_mask[1].sum(-1).tolist() == [10, 11, 12, 13, 14]
    # The padding rows of request 0 attend like its real row (position 8), never to nothing.
    assert plan.short_mask[0].sum(-1).tolist() == [9] * 5


def test_store_kv_skips_padding_slots():
    k_cache = torch.zeros(4, 2, 1, 3)
    v_cache = torch.zeros_like(k_cache)
    key = torch.arange(9.0).view(3, 1, 3) + 1
    reference.store_kv(key, -key, k_cache, v_cache, torch.tensor([5, -1, 0]))
    flat = k_cache.view(-1, 1, 3)
    assert torch.equal(flat[5], key[0]) and torch.equal(flat[0], key[2])
    assert torch.count_nonzero(flat).item() == 6  # only the two real rows were written
    assert torch.equal(v_cache.view(-1, 1, 3)[5], -key[0])
