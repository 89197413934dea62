"""Pure-torch reference ops: over the paged KV cache, and the decoder layer's glue
(RMSNorm + residual, SiLU·mul, rotary) that the fused kernels replace on CUDA.

Cache layout: ``k_cache`` / ``v_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``;
token slot ``s`` lives at block ``s // block_size``, offset ``s % block_size``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


FP8 = torch.float8_e4m3fn  # the KV cache's dtype with --kv-cache-dtype fp8


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``x`` as the KV cache holds it: float8 holds x / ``scale`` (its layer's), saturated
    at ±448 (e4m3 has no infinity)."""
    return (x.float() / scale).clamp(-448.0, 448.0).to(dtype) if dtype == FP8 else x.to(dtype)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor, has_padding: bool = True,
             k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the cache at
    ``slot_mapping`` ``[num_tokens]``; rows whose slot is -1 (padding) are skipped.
    ``has_padding=False`` promises there are none and skips the check. A float8 cache
    takes the values over ``k_scale`` / ``v_scale``, saturated to ±448, rounded to nearest."""
    if has_padding:
        valid = slot_mapping >= 0
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    for rows, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        rows = to_cache_dtype(rows, cache.dtype, scale)
        flat = cache.view(-1, *cache.shape[2:])
        if cache.dtype == FP8:  # a CPU has no float8 index_copy_: the same bytes as uint8
            flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)
        flat.index_copy_(0, slot_mapping, rows)


SHORT_SPAN = 16  # query spans up to this long (decode rows, verify spans) are batched

# Tree attention (a draft tree verified in one pass): a query row's visibility mask, int64,
# over its request's last TREE_SPAN keys. 0: the row attends causally. Otherwise bit j set
# means the row may see the key at position seq_len - 1 - j (its request's seq_len); keys
# further back are seen as ever, causally. A draft node's mask has its ancestors' bits,
# its own and every bit of the context before the tree set (``batch.tree_masks``).
TREE_SPAN = 64


def tree_visible(masks: torch.Tensor, back: torch.Tensor) -> torch.Tensor:
    """Whether rows with visibility ``masks`` may see keys ``back`` positions before their
    request's last (broadcast against each other), under the rule above."""
    bits = (masks >> back.clamp(0, TREE_SPAN - 1)) & 1
    return (masks == 0) | (back >= TREE_SPAN) | (bits != 0)


@dataclass
class AttentionPlan:
    """Per-step gather indices and masks, shared by every layer with the same window.

    Short query spans — decode rows and verify spans of 1 + k tokens — are attended
    together, each padded to the longest such span and its keys to the longest sequence,
    so verifying drafts for many requests costs one attention call per layer, not one
    per request. Longer spans (prefill chunks) go one request at a time.
    """

    short_rows: torch.Tensor | None        # [num_short, max_q] query row of each padded slot (padding: row 0)
    short_real: torch.Tensor | None        # [num_short, max_q] bool, a real query row; None: all real
    short_slots: torch.Tensor | None       # [num_short, max_seq_len] cache slot of each key
    short_keys_valid: torch.Tensor | None  # [num_short, max_seq_len] bool; None: every key real
    short_mask: torch.Tensor | None        # [num_short, max_q, max_seq_len]; None: nothing masked
    spans: list[tuple[slice, torch.Tensor, torch.Tensor]]  # (rows, slots [seq_len], mask [q_len, seq_len])


def plan_attention(block_tables: torch.Tensor, query_lens: list[int], seq_lens: list[int],
                   block_size: int, sliding_window: int | None, short_spans: bool = True,
                   long_spans: bool = True, tree_masks: torch.Tensor | None = None) -> AttentionPlan:
    """``short_spans=False``: plan only the long spans (another kernel does the short ones);
    ``long_spans=False``: none of them (another kernel does them all). ``tree_masks``:
    the rows' visibility masks (``TREE_SPAN``), None: every row attends causally."""
    device = block_tables.device
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    short = [i for i, q_len in enumerate(query_lens) if q_len <= SHORT_SPAN] if short_spans else []
    rows = real = slots = keys_valid = mask = None
    if short:
        max_q = max(query_lens[i] for i in short)
        max_len = max(seq_lens[i] for i in short)
        q_lens = torch.tensor([query_lens[i] for i in short], device=device)
        lens = torch.tensor([seq_lens[i] for i in short], device=device)
        offsets = torch.arange(max_q, device=device)
        real = offsets[None, :] < q_lens[:, None]
        rows = torch.tensor([starts[i] for i in short], device=device)[:, None] + offsets
        rows = torch.where(real, rows, 0)
        slots = _slots(block_tables[short], max_len, block_size)
        key_pos = torch.arange(max_len, device=device)
        keys_valid = key_pos[None, :] < lens[:, None]
        # A padding query sits at its request's last position, so it has keys to attend to.
        q_pos = lens[:, None] - q_lens[:, None] + torch.minimum(offsets[None, :], q_lens[:, None] - 1)
        mask = key_pos[None, None, :] <= q_pos[:, :, None]
        if sliding_window is not None:
            mask &= key_pos[None, None, :] > q_pos[:, :, None] - sliding_window
        if tree_masks is not None:
            back = lens[:, None] - 1 - key_pos[None, :]
            row_masks = torch.where(real, tree_masks[rows], 0)  # (padding: causal)
            mask &= tree_visible(row_masks[:, :, None], back[:, None, :])
        real = None if bool(real.all()) else real
        keys_valid = None if bool(keys_valid.all()) else keys_valid
        mask = None if bool(mask.all()) else mask
    spans = []
    for i, q_len in enumerate(query_lens):
        if q_len > SHORT_SPAN and long_spans:
            span_slots = _slots(block_tables[i:i + 1], seq_lens[i], block_size)[0]
            span_mask = _mask(seq_lens[i] - q_len, q_len, seq_lens[i], sliding_window, device)
            if tree_masks is not None:
                back = seq_lens[i] - 1 - torch.arange(seq_lens[i], device=device)
                span_mask &= tree_visible(tree_masks[starts[i]:starts[i + 1], None], back[None, :])
            spans.append((slice(starts[i], starts[i + 1]), span_slots, span_mask))
    return AttentionPlan(rows, real, slots, keys_valid, mask, spans)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_lens: list[int], seq_lens: list[int],
                    scale: float, sliding_window: int | None = None,
                    plan: AttentionPlan | None = None, out: torch.Tensor | None = None,
                    softcap: float | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
                    tree_masks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a ragged batch over the paged cache.

    query: ``[num_tokens, num_heads, head_dim]``, request i owning ``query_lens[i]``
    consecutive rows. Request i has ``seq_lens[i]`` cached tokens (this step's included);
    its queries are the last ``query_lens[i]`` of them and attend causally, and only to the
    last ``sliding_window`` positions when a window is set. ``softcap`` (Gemma 2's
    attention logit soft-capping) maps each scaled score s to ``softcap · tanh(s /
    softcap)`` before the softmax. Returns ``[num_tokens, num_heads, head_dim]``. ``plan`` (from ``plan_attention`` with the same arguments)
    lets many layers share the index work; ``out`` receives the rows the plan covers.
    ``k_scale`` / ``v_scale``: what a unit of the cache's K and V stands for (a float8
    cache's scales): K's goes into ``scale``, V's multiplies the output. ``tree_masks``
    ``[num_tokens]`` int64: each row's visibility mask (``TREE_SPAN``; None: all causal).
    """
    scale = scale * k_scale
    if plan is None:
        plan = plan_attention(block_tables, query_lens, seq_lens, k_cache.shape[1], sliding_window,
                              tree_masks=tree_masks)
    keys = k_cache.view(-1, *k_cache.shape[2:])
    values = v_cache.view(-1, *v_cache.shape[2:])
    out = torch.empty_like(query) if out is None else out
    if plan.short_rows is not None:
        q = query[plan.short_rows]                           # [num_short, max_q, H, D]
        flat = plan.short_slots.flatten()  # index_select is ~3x cheaper than advanced indexing
        # (a float8 cache's values are exact in the queries' dtype)
        k = keys.index_select(0, flat).view(*plan.short_slots.shape, *keys.shape[1:]).to(query.dtype)
        v = values.index_select(0, flat).view(*plan.short_slots.shape, *values.shape[1:]).to(query.dtype)
        if plan.short_keys_valid is not None:
            # Keys past a request's own length may hold anything, even NaN from a stale
            # block: zero them so masked-out keys cannot poison the row.
            valid = plan.short_keys_valid[:, :, None, None]
            k, v = torch.where(valid, k, 0), torch.where(valid, v, 0)
        attended = _sdpa(q, k, v, plan.short_mask, scale, softcap, v_scale)
        if plan.short_real is None:
            out[plan.short_rows.flatten()] = attended.flatten(0, 1)
        else:
            out[plan.short_rows[plan.short_real]] = attended[plan.short_real]
    for rows, slots, mask in plan.spans:
        out[rows] = _sdpa(query[rows].unsqueeze(0), keys.index_select(0, slots).unsqueeze(0).to(query.dtype),
                          values.index_select(0, slots).unsqueeze(0).to(query.dtype), mask[None], scale, softcap,
                          v_scale)[0]
    return out


def _slots(block_tables: torch.Tensor, num_tokens: int, block_size: int) -> torch.Tensor:
    """Cache slot of each of the first ``num_tokens`` positions: ``[batch, num_tokens]``."""
    num_blocks = -(-num_tokens // block_size)
    blocks = block_tables[:, :num_blocks].long() * block_size
    offsets = torch.arange(block_size, device=block_tables.device)
    return (blocks[:, :, None] + offsets).flatten(1)[:, :num_tokens]


def _mask(first_pos: int, q_len: int, kv_len: int, sliding_window: int | None, device):
    q_pos = torch.arange(first_pos, first_pos + q_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def _sdpa(q, k, v, mask, scale, softcap=None, v_scale=1.0):
    """q ``[B, Lq, H, D]``, k/v ``[B, Lk, Hkv, D]``, mask ``[B or 1, Lq, Lk]``; the output
    times ``v_scale``."""
    if v_scale != 1.0:
        return (_sdpa(q, k, v, mask, scale, softcap).float() * v_scale).to(q.dtype)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    mask = None if mask is None else mask.unsqueeze(1)
    if softcap:  # not a form SDPA takes: scores, capped, masked, softmax in fp32
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.tanh(q.float() @ k.float().transpose(-1, -2) * (scale / softcap)) * softcap
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return (scores.softmax(-1).to(q.dtype) @ v.to(q.dtype)).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                         scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)


# ---------------------------------------------------------------------------- layer glue
# References of the fused kernels in fused_norm.py, fused_act.py and fused_rotary.py; the
# norms and the activation are also the model's CPU path, op for op as it always was.
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight · x / rms(x)`` over the last dim, as transformers does it: normalise in
    fp32, cast back to x's dtype, then scale."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add fused into the next norm: ``(rms_norm(x + residual), x + residual)``,
    the sum rounded to x's dtype before it is normalised."""
    residual = x + residual
    normed = F.rms_norm(residual.float(), (x.shape[-1],), eps=eps)  # rms_norm, inlined: the CPU path
    return weight * normed.to(residual.dtype), residual


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm, as transformers does it: ``(1 + weight) · x / rms(x)`` all in
    fp32, rounded to x's dtype once."""
    return (F.rms_norm(x.float(), (x.shape[-1],), eps=eps) * (1.0 + weight.float())).to(x.dtype)


def gemma_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gemma_rms_norm(x + residual), x + residual)``, the sum rounded to x's dtype."""
    residual = x + residual
    return gemma_rms_norm(residual, weight, eps), residual


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) · up`` (GeGLU, Gemma's MLP) of the merged gate/up projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) · up`` of the merged gate/up projection ``[num_tokens, 2 · intermediate]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_cos_sin_cache(inv_freq: torch.Tensor, scaling: float | torch.Tensor,
                         max_positions: int) -> torch.Tensor:
    """``[max_positions, head_dim]`` fp32: ``cos`` of each position's angles in the first
    half, ``sin`` in the second, both times the rope type's attention scaling (a scalar,
    or one per frequency)."""
    angles = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)[:, None] * inv_freq
    return torch.cat((angles.cos() * scaling, angles.sin() * scaling), dim=-1)


def rotary_embedding(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary of query ``[num_tokens, num_heads, head_dim]`` and key
    ``[num_tokens, num_kv_heads, head_dim]`` at ``positions`` ``[num_tokens]``: with
    ``x = (x₁, x₂)`` halves, ``(x₁·cos − x₂·sin, x₂·cos + x₁·sin)``, in fp32, cast back."""
    cos, sin = cos_sin_cache[positions][:, None].chunk(2, dim=-1)  # [num_tokens, 1, head_dim / 2]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(query), rotate(key)


def rotary_store_kv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    positions: torch.Tensor, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                    v_scale: float = 1.0) -> torch.Tensor:
    """Rotary on query and key, then the rotated key and the value stored at
    ``slot_mapping`` (-1 rows skipped); returns the rotated query."""
    query, key = rotary_embedding(query, key, positions, cos_sin_cache)
    store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    return query
