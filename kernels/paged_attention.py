"""Paged attention over a ragged batch in one launch (Triton), plus a split-KV reduce.

Same semantics as ``reference.paged_attention``: request i owns query rows
``cu_query_lens[i]:cu_query_lens[i+1]``, which are the last ``q_i`` of its ``seq_lens[i]``
cached tokens; they attend causally (and only to the last ``sliding_window`` positions when
a window is set) through ``block_tables[i]``, scores soft-capped when ``softcap`` is set.

How the work is split. The grid is ``(query tile, kv head, kv split)``:

- A *query tile* is up to ``BLOCK_Q`` consecutive query tokens of one request, together
  with all ``group = num_heads // num_kv_heads`` query heads that share one KV head, so
  each K/V tile is loaded once for ``BLOCK_M = BLOCK_Q * group`` (padded) query rows.
  Decode steps use ``BLOCK_Q = 1``; batches with longer spans (verification, prefill
  chunks) use bigger tiles. Request i's tiles start at ``cu_query_lens[i] // BLOCK_Q + i``
  (one spare tile per request), so a program finds its request by a binary search over
  ``cu_query_lens`` and the grid depends only on ``num_tokens`` and ``num_reqs`` — no
  host sync and no per-step index tensors.
- The KV range a tile needs (from its window start to its last query's position) is cut
  into ``num_splits`` chunks of whole ``BLOCK_N`` tiles (flash-decoding), so a small decode
  batch still fills the GPU. Each program runs an online softmax in fp32 over its chunk.
  With one split it writes the output directly; otherwise it writes a normalised partial
  output and its log-sum-exp, and ``_reduce_splits_kernel`` combines the splits in order.
  The deterministic plan instead splits at absolute multiples of
  ``DETERMINISTIC_SPLIT_TOKENS`` with fixed tiles, so a row's result does not depend on its
  batch.

All index math that can exceed 2**31 (cache block offsets, token offsets) is int64.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from specserve.kernels import pdl, reference

LOG2E = 1.4426950408889634
_MIN_SPLIT_TOKENS = 128   # never split the KV range finer than this
_MIN_DECODE_SPLIT_TOKENS = 32  # one-token tiles: a split count from this many keys of the longest (see plan_launch)
_MAX_SPLITS = 32
DETERMINISTIC_SPLIT_TOKENS = 512  # the deterministic plan's KV chunk (a multiple of BLOCK_N)
PREFETCH_KV = True  # under PDL: the first keys and values asked of L2 before the wait (for A/B runs)
REDUCE_USED_ONLY = True  # the split reduce stops after the last split that saw a key (for A/B runs)
TREE_SPAN = tl.constexpr(reference.TREE_SPAN)


# ---------------------------------------------------------------------------- kernels
@triton.jit
def _tile_start(cu_query_lens_ptr, req, BLOCK_Q: tl.constexpr):
    """First query-tile index of request ``req``."""
    if BLOCK_Q == 1:
        return tl.load(cu_query_lens_ptr + req)
    else:
        return tl.load(cu_query_lens_ptr + req) // BLOCK_Q + req


@triton.jit
def _find_request(cu_query_lens_ptr, num_reqs, tile, BLOCK_Q: tl.constexpr):
    """The request owning query tile ``tile``: the last i with ``_tile_start(i) <= tile``."""
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        if _tile_start(cu_query_lens_ptr, mid, BLOCK_Q) <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """``a @ b`` accumulated in fp32. ``UPCAST``: compute in fp32 (the interpreter cannot
    multiply bf16); ``IEEE``: no tf32 rounding for fp32 inputs."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


# Sizes that vary step by step are not specialised on (1, multiples of 16): each new
# combination would compile a variant in the middle of serving.
_VARYING = ["num_reqs", "num_splits", "window", "stride_lt", "stride_lh", "stride_bt"]


@triton.jit(do_not_specialize=_VARYING)
def _paged_attention_kernel(
    out_ptr, part_out_ptr, part_lse_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_query_lens_ptr, seq_lens_ptr, tree_masks_ptr,
    num_reqs, num_splits, qk_scale, softcap_log2, window, v_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT_KV: tl.constexpr, SPLIT_TOKENS: tl.constexpr, USE_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr, UPCAST_DOT: tl.constexpr, IEEE_DOT: tl.constexpr, FP16_DOT: tl.constexpr,
    TREE: tl.constexpr, PDL: tl.constexpr = 0, PREFETCH: tl.constexpr = False,
):
    """One (query tile, kv head, kv split): online softmax over the split's KV chunk.
    Scores are in log2 units: ``qk_scale`` is scale·log2(e), or with ``SOFTCAP`` scale /
    cap, the tanh's argument, and ``softcap_log2`` = cap·log2(e); a float8 cache's K
    scale is in ``scale``, its V scale multiplies the output. ``FP16_DOT``: a float8
    cache under bf16 queries; its tiles widen to fp16 (one instruction for two values,
    where bf16 takes several) and the queries round to fp16 once, exactly where they lie
    in fp16's normal range. ``TREE``: rows carry visibility masks (``reference.TREE_SPAN``).

    Under PDL the program reads the batch's layout (``cu_query_lens``, ``seq_lens``; with
    ``PREFETCH`` its block table row too) before its wait: the kernel before it (the KV
    store) writes none of it, and every kernel before that has completed
    (``kernels/pdl.py``). ``PREFETCH``: it also asks L2 for its first keys and values
    there (``_kv_lines``), cached by earlier steps; a line the KV store is writing is only
    fetched early, never read early."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = _find_request(cu_query_lens_ptr, num_reqs, tile, BLOCK_Q)
    q_begin = tl.load(cu_query_lens_ptr + req)
    q_len = tl.load(cu_query_lens_ptr + req + 1) - q_begin
    q_first = (tile - _tile_start(cu_query_lens_ptr, req, BLOCK_Q)) * BLOCK_Q
    # A spare tile ends after its wait, not before: were every program of a grid to end
    # before its wait, the next kernel could start before the one before this had ended.
    spare = q_first >= q_len
    kv_len = tl.load(seq_lens_ptr + req)

    # Row r of the tile is query token q_first + r // GROUP, head kv_head * GROUP + r % GROUP.
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_first + rows // GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    head = kv_head * GROUP + rows % GROUP
    q_pos = kv_len - q_len + q_idx                            # [BLOCK_M] absolute positions
    token = (q_begin + q_idx).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM

    # KV range of the whole tile, cut into num_splits chunks of whole BLOCK_N tiles.
    kv_hi = kv_len - q_len + tl.minimum(q_first + BLOCK_Q, q_len)
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(kv_len - q_len + q_first - window + 1, 0)
    kv_lo = kv_lo // BLOCK_N * BLOCK_N
    if SPLIT_TOKENS > 0:  # splits at absolute multiples of SPLIT_TOKENS, whatever the batch
        chunk_lo = (kv_lo // SPLIT_TOKENS + split) * SPLIT_TOKENS
        start = tl.maximum(chunk_lo, kv_lo)
        end = tl.minimum(chunk_lo + SPLIT_TOKENS, kv_hi)
    else:
        chunk = tl.cdiv(tl.cdiv(kv_hi - kv_lo, BLOCK_N), num_splits) * BLOCK_N
        start = kv_lo + split * chunk
        end = tl.minimum(start + chunk, kv_hi)
    table = block_tables_ptr + req.to(tl.int64) * stride_bt
    if PREFETCH:  # (a line the KV store is writing, this step's keys, is only fetched early)
        if (start < end) & (not spare):
            pdl.prefetch_l2(_kv_lines(k_cache_ptr, table, start, end, kv_head, stride_kb, stride_ks, stride_kh,
                                      HEAD_DIM, BLOCK_D, BLOCK_SIZE, 2 * BLOCK_N))
            pdl.prefetch_l2(_kv_lines(v_cache_ptr, table, start, end, kv_head, stride_vb, stride_vs, stride_vh,
                                      HEAD_DIM, BLOCK_D, BLOCK_SIZE, 2 * BLOCK_N))

    pdl.wait(PDL)
    if spare:
        return
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_valid[:, None] & d_valid[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if FP16_DOT:
        q = q.to(tl.float16)
    if TREE:
        tree_mask = tl.load(tree_masks_ptr + token, mask=row_valid, other=0)  # [BLOCK_M] int64

    # m starts finite so fully masked rows and empty splits give exp2(-inf) = 0, never NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for kv_start in range(start, end, BLOCK_N):
        k_pos = kv_start + tl.arange(0, BLOCK_N)              # [BLOCK_N]
        k_valid = k_pos < end
        block = tl.load(table + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
        offset = k_pos % BLOCK_SIZE
        kv_mask = k_valid[:, None] & d_valid[None, :]
        # Masked loads: slots past a request's length may hold stale data (even NaN).
        # (A float8 cache's values are exact in the queries' dtype, and in fp16.)
        k = tl.load(k_cache_ptr + (block * stride_kb + offset * stride_ks + kv_head * stride_kh)[:, None]
                    + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_cache_ptr + (block * stride_vb + offset * stride_vs + kv_head * stride_vh)[:, None]
                    + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        s = _dot(q, tl.trans(k), UPCAST_DOT, IEEE_DOT) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        if SOFTCAP:  # cap · tanh(x), tanh(x) = 2σ(2x) − 1 (saturates to ±1, never NaN)
            s = (2.0 / (1.0 + tl.exp(-2.0 * s)) - 1.0) * softcap_log2
        allowed = row_valid[:, None] & k_valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
        if TREE:  # bit j: the key j positions before the request's last
            back = kv_len - 1 - k_pos                                      # [BLOCK_N]
            shift = tl.minimum(tl.maximum(back, 0), TREE_SPAN - 1).to(tl.int64)
            bit = (tree_mask[:, None] >> shift[None, :]) & 1
            allowed = allowed & ((tree_mask[:, None] == 0) | (back[None, :] >= TREE_SPAN) | (bit != 0))
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST_DOT, IEEE_DOT)
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    result = acc / l_safe[:, None] * v_scale  # (a float8 cache's V scale; else 1)
    store_mask = row_valid[:, None] & d_valid[None, :]
    if SPLIT_KV:
        part = part_out_ptr + token * stride_pt + head * stride_ph + split * stride_ps
        tl.store(part[:, None] + d[None, :], result, mask=store_mask)
        # -inf: no key seen; NaN: a NaN score (kept, so the reduce neither skips nor hides it)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), tl.where(l_i == 0, float("-inf"), l_i))
        tl.store(part_lse_ptr + token * stride_lt + head * stride_lh + split, lse, mask=row_valid)
    else:
        out = out_ptr + token * stride_ot + head * stride_oh
        tl.store(out[:, None] + d[None, :], result.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit(do_not_specialize=["num_reqs", "num_splits", "stride_lt", "stride_lh"])
def _reduce_splits_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, cu_query_lens_ptr, num_reqs, num_splits,
    stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, USED_ONLY: tl.constexpr = True,
    PDL: tl.constexpr = 0,
):
    """One (token, head): out = Σ_s exp2(lse_s) · part_s / Σ_s exp2(lse_s), summed split by
    split in order, so splits a row does not reach (weight 0) change nothing, bit for bit.
    ``USED_ONLY``: the sum stops after the last split that saw a key (those after it add
    exact zeros), so a plan made for the longest sequence costs a short one little. A
    split whose log-sum-exp is NaN (a NaN score) counts as seen: the NaN reaches the
    output, as it does with one split."""
    pdl.wait(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if token >= tl.load(cu_query_lens_ptr + num_reqs):  # padding row past every request
        return
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    lse_row = part_lse_ptr + token * stride_lt + head * stride_lh
    lse = tl.load(lse_row + s, mask=s < num_splits, other=float("-inf"))
    top = tl.max(lse, 0)
    used = num_splits
    if USED_ONLY:
        used = tl.max(tl.where(lse == float("-inf"), 0, s + 1), 0)
    part = part_out_ptr + token * stride_pt + head * stride_ph
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    total = 0.0
    for split in range(used):
        weight = tl.exp2(tl.load(lse_row + split) - top)
        acc += weight * tl.load(part + split * stride_ps + d, mask=d_valid, other=0.0)
        total += weight
    result = acc / total
    out = out_ptr + token * stride_ot + head * stride_oh + d
    tl.store(out, result.to(out_ptr.dtype.element_ty), mask=d_valid)


@triton.jit
def _kv_lines(cache_ptr, table, start, end, kv_head, stride_b, stride_s, stride_h, HEAD_DIM: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, KEYS: tl.constexpr):
    """The addresses (int64 ``[KEYS, lines]``) of the 128-byte lines that ``kv_head``'s rows
    in ``cache`` lie in, at the first KEYS positions of [start, end), through the request's
    block ``table`` (positions past ``end`` repeat its last; needs start < end). A row whose
    bytes are not a multiple of 128 may start mid-line and take one line more; the lines
    are a power of two from ``BLOCK_D`` (HEAD_DIM's), the last ones repeating."""
    size: tl.constexpr = cache_ptr.dtype.element_ty.primitive_bitwidth // 8
    ROW_BYTES: tl.constexpr = HEAD_DIM * size
    LINES: tl.constexpr = (BLOCK_D * size + 127) // 128 * (1 if ROW_BYTES % 128 == 0 else 2)
    pos = tl.minimum(start + tl.arange(0, KEYS), end - 1)
    block = tl.load(table + pos // BLOCK_SIZE).to(tl.int64)
    row = cache_ptr.to(tl.int64) + size * (block * stride_b + (pos % BLOCK_SIZE) * stride_s + kv_head * stride_h)
    first, last = row // 128 * 128, (row + ROW_BYTES - 1) // 128 * 128
    return tl.minimum(first[:, None] + 128 * tl.arange(0, LINES).to(tl.int64)[None, :], last[:, None])


# ---------------------------------------------------------------------------- host side
@dataclass(frozen=True)
class LaunchPlan:
    """Tile sizes and grid of one step's attention; depends only on host-known sizes."""

    block_q: int       # query tokens per tile
    block_m: int       # query rows per tile (block_q tokens × group heads, padded)
    block_n: int       # keys per inner iteration
    num_tiles: int     # grid axis 0 (an upper bound; spare tiles exit after their PDL wait)
    num_splits: int    # grid axis 2
    num_warps: int
    num_stages: int
    split_tokens: int = 0  # > 0: splits at fixed multiples of this many tokens (deterministic)


def plan_launch(query: torch.Tensor, k_cache: torch.Tensor, num_reqs: int, max_query_len: int,
                max_seq_len: int, num_splits: int | None = None, deterministic: bool = False) -> LaunchPlan:
    """Tile sizes from the group size and the longest query span; the number of KV splits
    so that about two programs per SM run, never fewer than _MIN_SPLIT_TOKENS keys a split
    of the longest sequence. One-token tiles count _MIN_DECODE_SPLIT_TOKENS instead: a
    decode program waits on a chain of dependent loads for each tile of keys it takes in
    turn, so one tile each, over more programs, finishes sooner. A split is whole tiles of
    ``block_n`` keys, so such a plan may hold twice the splits its longest sequence fills
    (a graph's plan for 512 keys: 16, of which 513 keys fill 9); the reduce skips the
    empty ones. Only shapes are read from ``query`` / ``k_cache``. ``num_splits`` forces
    the count.

    ``deterministic``: the same tiles for every batch, and KV splits at fixed multiples of
    DETERMINISTIC_SPLIT_TOKENS, so a row's keys are summed in the same chunks and order
    whether it decodes, verifies or prefills, alone or beside others (programs and splits
    a row does not reach add exact zeros)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    wide = head_dim > 128 or query.element_size() > 2  # keep K/V stages within shared memory
    if deterministic:
        block_m = max(64, triton.next_power_of_2(group))
        block_q = block_m // group
        return LaunchPlan(block_q, block_m, 32 if wide else 64, num_tokens // block_q + num_reqs,
                          triton.cdiv(max(max_seq_len, 1), DETERMINISTIC_SPLIT_TOKENS), num_warps=4,
                          num_stages=2, split_tokens=DETERMINISTIC_SPLIT_TOKENS)
    # Decode: one token per tile. Longer spans: up to 128 rows, so prefill tiles reuse each
    # K/V tile for many queries; decode rows in such a batch waste compute, not bandwidth.
    # A tile holds as many query tokens as its rows allow, whatever the longest span: the
    # tile size alone picks the compiled variant, so spans of every length (a draft's
    # catch-ups, prompt chunks) share a few, compiled early, not in the middle of a run.
    block_m = max(16, triton.next_power_of_2(max_query_len * group))
    block_m = max(min(block_m, 128), triton.next_power_of_2(group))
    block_q = 1 if max_query_len <= 1 else max(1, block_m // group)
    num_tiles = num_tokens if block_q == 1 else num_tokens // block_q + num_reqs
    if num_splits is None:
        wanted = triton.cdiv(2 * _num_sms(query.device), num_tiles * num_kv_heads)
        by_length = triton.cdiv(max_seq_len, _MIN_DECODE_SPLIT_TOKENS if block_q == 1 else _MIN_SPLIT_TOKENS)
        num_splits = max(1, min(wanted, by_length, _MAX_SPLITS))
    block_n = 32 if wide and block_m >= 64 else 64
    num_warps = 8 if block_m >= 128 else 4
    return LaunchPlan(block_q, block_m, block_n, num_tiles, num_splits, num_warps, num_stages=2)


def warmup_lengths(max_model_len: int) -> list[tuple[int, int]]:
    """(longest span, longest sequence) pairs whose one-request steps, run once at start-up,
    compile every variant ``plan_launch`` can pick: each tile size (spans of 1, 2, 4, ...
    128 tokens: any group size reaches its 16 to 128 rows by then) with one KV split and
    with several. The variants depend on nothing else that varies between steps (request
    counts, split counts and their strides are not specialised on), so no step met later,
    however its spans and lengths fall (a draft's backlog, a prompt chunk), waits for a
    compilation. A deterministic plan has one tile; its pairs still cover one and several
    splits."""
    spans = dict.fromkeys(min(1 << i, max_model_len) for i in range(8))  # 1 .. 128
    long = min(max_model_len, 1024)  # many keys for one request: the plan splits them
    return [(span, seq) for span in spans for seq in dict.fromkeys((span, long))]


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, cu_query_lens: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                    *, softcap: float | None = None, max_query_len: int | None = None, max_seq_len: int | None = None,
                    plan: LaunchPlan | None = None, num_splits: int | None = None,
                    k_scale: float = 1.0, v_scale: float = 1.0,
                    tree_masks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a ragged batch over the paged cache, in one launch (two with
    KV splits); returns ``[num_tokens, num_heads, head_dim]`` in ``query``'s dtype.

    query ``[num_tokens, num_heads, head_dim]``; k_cache / v_cache ``[num_blocks,
    block_size, num_kv_heads, head_dim]``; block_tables ``[num_reqs, max_blocks]`` int32;
    cu_query_lens ``[num_reqs + 1]`` int32; seq_lens ``[num_reqs]`` int32.
    Give either ``plan`` (from ``plan_launch``, shared by a step's layers) or the host-side
    ``max_query_len`` / ``max_seq_len`` to plan from (no device sync); ``num_splits``
    forces the split count. Rows past ``cu_query_lens[-1]`` (padding) are left unwritten.
    ``k_scale`` / ``v_scale``: what the cache's K and V values stand for a unit of (a
    float8 cache's per-layer scales). ``tree_masks`` ``[num_tokens]`` int64: the rows'
    visibility masks (``reference.TREE_SPAN``; None: every row causal).
    """
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    _check_shapes(query, k_cache, v_cache, num_heads, num_kv_heads, head_dim)
    if plan is None:
        if max_query_len is None or max_seq_len is None:
            raise ValueError("paged_attention needs a plan or max_query_len and max_seq_len")
        plan = plan_launch(query, k_cache, block_tables.shape[0], max_query_len, max_seq_len,
                           num_splits)
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    query = query if query.stride(-1) == 1 else query.contiguous()
    split_kv = plan.num_splits > 1
    if split_kv:
        part_out = torch.empty(num_tokens, num_heads, plan.num_splits, head_dim,
                               dtype=torch.float32, device=query.device)
        part_lse = torch.empty(num_tokens, num_heads, plan.num_splits, dtype=torch.float32,
                               device=query.device)
    else:  # unused by the kernel; any fp32 tensor will do
        part_out = part_lse = out.new_empty(1, 1, 1, 1, dtype=torch.float32)
    block_d = max(16, triton.next_power_of_2(head_dim))
    upcast = interpreted() and query.dtype == torch.bfloat16
    launch = pdl.launch(query.device)
    _paged_attention_kernel[(plan.num_tiles, num_kv_heads, plan.num_splits)](
        out, part_out, part_lse,
        query, k_cache, v_cache, block_tables, cu_query_lens, seq_lens,
        tree_masks if tree_masks is not None else seq_lens,  # (unread without masks)
        block_tables.shape[0], plan.num_splits, scale * k_scale / softcap if softcap else scale * k_scale * LOG2E,
        (softcap or 0.0) * LOG2E, sliding_window or 0, v_scale,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, BLOCK_Q=plan.block_q, BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n, SPLIT_KV=split_kv, SPLIT_TOKENS=plan.split_tokens, USE_WINDOW=sliding_window is not None,
        SOFTCAP=bool(softcap), UPCAST_DOT=upcast, IEEE_DOT=query.dtype == torch.float32,
        FP16_DOT=k_cache.dtype == torch.float8_e4m3fn and query.dtype == torch.bfloat16 and not upcast,
        TREE=tree_masks is not None, num_warps=plan.num_warps, num_stages=plan.num_stages,
        PREFETCH=bool(launch["PDL"]) and PREFETCH_KV, **launch)
    if split_kv:
        _reduce_splits_kernel[(num_tokens, num_heads)](
            out, part_out, part_lse, cu_query_lens, block_tables.shape[0], plan.num_splits,
            out.stride(0), out.stride(1), part_out.stride(0), part_out.stride(1),
            part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_S=max(_MAX_SPLITS, triton.next_power_of_2(plan.num_splits)), USED_ONLY=REDUCE_USED_ONLY,
            num_warps=4, **launch)
    return out


def _check_shapes(query, k_cache, v_cache, num_heads, num_kv_heads, head_dim) -> None:
    if k_cache.shape != v_cache.shape or k_cache.shape[3] != head_dim:
        raise ValueError(f"cache shapes {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not "
                         f"match head_dim {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if head_dim < 16:
        raise ValueError(f"head_dim must be at least 16 for tl.dot, got {head_dim}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV cache's head_dim must be contiguous")


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: few programs, but still exercise the split path


def interpreted() -> bool:
    """Whether these kernels run under the Triton interpreter (TRITON_INTERPRET=1 was set
    when this module was imported): then they take CPU tensors."""
    from triton.runtime.interpreter import InterpretedFunction  # lazy: only under the interpreter

    return isinstance(_paged_attention_kernel, InterpretedFunction)
