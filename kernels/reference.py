"""Pure-torch reference ops over the paged KV cache.

Cache layout: ``k_cache`` / ``v_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``;
token slot ``s`` lives at block ``s // block_size``, offset ``s % block_size``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the cache at
    ``slot_mapping`` ``[num_tokens]``; rows whose slot is -1 (padding) are skipped."""
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_lens: list[int], seq_lens: list[int],
                    scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of a ragged batch over the paged cache.

    query: ``[num_tokens, num_heads, head_dim]``, request i owning ``query_lens[i]``
    consecutive rows. Request i has ``seq_lens[i]`` cached tokens (this step's included);
    its queries are the last ``query_lens[i]`` of them and attend causally, and only to the
    last ``sliding_window`` positions when a window is set. Returns ``[num_tokens,
    num_heads, head_dim]``. Requests with one query token (decode) are attended in one
    batched call; longer spans one request at a time.
    """
    out = torch.empty_like(query)
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    decode = [i for i, q_len in enumerate(query_lens) if q_len == 1]
    if decode:
        rows = torch.tensor([starts[i] for i in decode], device=query.device)
        out[rows] = _decode_attention(query[rows], k_cache, v_cache, block_tables[decode],
                                      [seq_lens[i] for i in decode], scale, sliding_window)
    for i, q_len in enumerate(query_lens):
        if q_len == 1:
            continue
        rows = slice(starts[i], starts[i + 1])
        k, v = _gather(k_cache, v_cache, block_tables[i:i + 1], seq_lens[i])
        mask = _mask(seq_lens[i] - q_len, q_len, seq_lens[i], sliding_window, query.device)
        out[rows] = _sdpa(query[rows].unsqueeze(0), k, v, mask[None], scale)[0]
    return out


def _decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window):
    max_len = max(seq_lens)
    k, v = _gather(k_cache, v_cache, block_tables, max_len)
    lens = torch.tensor(seq_lens, device=query.device)
    key_pos = torch.arange(max_len, device=query.device)
    mask = key_pos[None, :] < lens[:, None]
    if sliding_window is not None:
        mask &= key_pos[None, :] > (lens[:, None] - 1 - sliding_window)
    return _sdpa(query.unsqueeze(1), k, v, mask[:, None, :], scale)[:, 0]


def _gather(k_cache, v_cache, block_tables, num_tokens):
    """K and V of each row of ``block_tables``: ``[batch, num_tokens, num_kv_heads, head_dim]``."""
    block_size = k_cache.shape[1]
    num_blocks = -(-num_tokens // block_size)
    blocks = block_tables[:, :num_blocks]
    k = k_cache[blocks].flatten(1, 2)[:, :num_tokens]
    v = v_cache[blocks].flatten(1, 2)[:, :num_tokens]
    return k, v


def _mask(first_pos: int, q_len: int, kv_len: int, sliding_window: int | None, device):
    q_pos = torch.arange(first_pos, first_pos + q_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def _sdpa(q, k, v, mask, scale):
    """q ``[B, Lq, H, D]``, k/v ``[B, Lk, Hkv, D]``, mask ``[B or 1, Lq, Lk]``."""
    groups = q.shape[2] // k.shape[2]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype),
                                         attn_mask=mask.unsqueeze(1), scale=scale)
    return out.transpose(1, 2)
