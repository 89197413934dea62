"""Tree attention: a draft tree verified in one ragged pass, each node seeing the context,
its ancestors and itself. The torch reference, the C++ CPU kernel and the Triton kernel
(interpreted on a CPU) against a dense oracle that reads each request's keys position by
position and builds each row's visible set from the tree itself, not from its mask bits."""
from __future__ import annotations

import random

import pytest
import torch
from paged_batches import make_batch

from specserve.batch import tree_rows
from specserve.kernels import cpu_ops, reference

F32, BF16 = torch.float32, torch.bfloat16
SCALE = 0.125


def random_parents(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(-1, i - 1) for i in range(n)]


def ancestors(parents: list[int], i: int) -> set[int]:
    seen = {i}
    while parents[i] >= 0:
        i = parents[i]
        seen.add(i)
    return seen


def tree_batch(seed: int, dtype, tree_sizes=(3, 9, 40)):
    """Causal requests (a decode row, a verify span, a prefill span) and draft trees of
    ``tree_sizes`` nodes after 1 fed token (the root), over contexts of random length."""
    rng = random.Random(seed)
    spans, trees = [], []
    for q_len in (1, 5, 23):
        spans.append((q_len, q_len + rng.randint(0, 90)))
        trees.append(None)
    for n in tree_sizes:
        spans.append((1 + n, 1 + n + rng.randint(0, 90)))
        trees.append(random_parents(rng, n))
    order = list(range(len(spans)))
    rng.shuffle(order)
    spans, trees = [spans[i] for i in order], [trees[i] for i in order]
    b = make_batch(spans, 9, 3, 64, 16, dtype, torch.device("cpu"), num_blocks=128, seed=seed)
    masks = []
    for (q_len, _), parents in zip(spans, trees):
        masks += [0] * q_len if parents is None else [0] + tree_rows(parents)[1]
    return b, trees, torch.tensor(masks, dtype=torch.int64)


def dense_oracle(b, trees) -> torch.Tensor:
    """Each row over its request's keys, position by position, in fp32."""
    keys = b.k_cache.float().flatten(0, 1)
    values = b.v_cache.float().flatten(0, 1)
    out, block_size = [], b.k_cache.shape[1]
    start = 0
    for r, (q_len, seq_len) in enumerate(zip(b.query_lens_host, b.seq_lens_host)):
        table = b.block_tables[r].long()
        pos = torch.arange(seq_len)
        slots = table[pos // block_size] * block_size + pos % block_size
        k, v = keys[slots], values[slots]                     # [seq_len, kv_heads, D]
        group = b.query.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        parents = trees[r]
        for i in range(q_len):
            own = seq_len - q_len + i
            if parents is None or i == 0:
                visible = pos <= own
            else:
                first_node = seq_len - len(parents)
                line = ancestors(parents, i - 1)
                visible = (pos < first_node) | torch.tensor([p - first_node in line for p in pos.tolist()])
            q = b.query[start + i].float()                    # [H, D]
            scores = torch.einsum("hd,khd->hk", q, k) * SCALE
            scores[:, ~visible] = float("-inf")
            out.append(torch.einsum("hk,khd->hd", scores.softmax(-1), v))
        start += q_len
    return torch.stack(out)


def check(out, want, dtype):
    tol = 1e-5 if dtype == F32 else 1.6e-2
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)


def test_tree_rows_depths_and_masks():
    # root -> 0 -> 1, root -> 2, 0 -> 3
    depths, masks = tree_rows([-1, 0, -1, 0])
    assert depths == [0, 1, 0, 1]
    n = 4
    bit = {i: 1 << (n - 1 - i) for i in range(n)}   # node i is n - 1 - i positions before the last
    context = -1 << n
    assert masks == [context | bit[0], context | bit[0] | bit[1], context | bit[2], context | bit[0] | bit[3]]
    assert all(-(2 ** 63) <= m < 2 ** 63 for m in tree_rows([-1] * 63)[1])  # fits int64
    with pytest.raises(ValueError, match="parent 1"):
        tree_rows([-1, 1])
    with pytest.raises(ValueError, match="at most 63"):
        tree_rows([-1] * 64)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("seed", range(3))
def test_reference_attends_trees_like_the_dense_oracle(dtype, seed):
    b, trees, masks = tree_batch(seed, dtype, tree_sizes=(3, 9, 40, 63))
    out = reference.paged_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.query_lens_host,
                                    b.seq_lens_host, SCALE, tree_masks=masks)
    check(out, dense_oracle(b, trees), dtype)


def test_the_masks_matter():
    """Without its masks a tree's rows attend causally, and that differs: the oracle's
    tree structure is what the kernels follow."""
    b, trees, masks = tree_batch(0, F32)
    causal = reference.paged_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.query_lens_host,
                                       b.seq_lens_host, SCALE)
    assert not torch.allclose(causal, dense_oracle(b, trees), atol=1e-3)


@pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU kernels did not build")
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("seed", range(3))
def test_cpu_kernel_attends_trees_like_the_dense_oracle(dtype, seed):
    b, trees, masks = tree_batch(seed, dtype, tree_sizes=(3, 9, 40, 63))
    out = torch.full_like(b.query, float("nan"))
    cpu_ops.paged_attention_short(b.query, b.k_cache, b.v_cache, b.block_tables, b.cu_query_lens,
                                  b.seq_lens, SCALE, None, 64, out, None, masks)
    covered = torch.cat([torch.full((n,), n <= 64) for n in b.query_lens_host])
    check(out[covered], dense_oracle(b, trees)[covered], dtype)


@pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU kernels did not build")
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_cpu_kernel_attends_a_lone_tree_alike_on_one_thread_and_split_across_two(dtype):
    """One tree over a context whose last 64 positions (the masks' reach) cross a 64-key
    chunk boundary: two threads split its keys by chunk, one takes them in turn; both
    match the oracle and each other bitwise, hidden keys weighing nothing in either."""
    rng = random.Random(5)
    parents = random_parents(rng, 12)
    b = make_batch([(13, 150)], 9, 3, 64, 16, dtype, torch.device("cpu"), num_blocks=32, seed=5)
    masks = torch.tensor([0] + tree_rows(parents)[1], dtype=torch.int64)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = torch.full_like(b.query, float("nan"))
            cpu_ops.paged_attention_short(b.query, b.k_cache, b.v_cache, b.block_tables, b.cu_query_lens,
                                          b.seq_lens, SCALE, None, 64, out, None, masks)
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    check(outs[1], dense_oracle(b, [parents]), dtype)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_triton_kernel_attends_trees_like_the_dense_oracle(dtype):
    pytest.importorskip("triton")
    from specserve.kernels import paged_attention as pa  # lazy: triton is optional

    if not pa.interpreted() and not torch.cuda.is_available():
        pytest.skip("Triton needs a GPU or its interpreter")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    b, trees, masks = tree_batch(1, dtype, tree_sizes=(3, 9, 40))  # (on the CPU: the oracle's data)
    want = dense_oracle(b, trees)
    on = [t.to(device) for t in (b.query, b.k_cache, b.v_cache, b.block_tables, b.cu_query_lens, b.seq_lens, masks)]
    for num_splits in (1, 3):
        out = pa.paged_attention(*on[:6], SCALE, max_query_len=max(b.query_lens_host),
                                 max_seq_len=max(b.seq_lens_host), num_splits=num_splits, tree_masks=on[6])
        check(out.cpu(), want, dtype)
