"""Triton kernels vs the torch references on one CUDA GPU.

Checks every case against the reference first (bf16 within 1.5e-2 of an fp32 reference,
KV store exact), then times both with ``triton.testing.do_bench`` (CUDA events, L2 flushed
between runs, median) and prints one table naming the card:

- decode batches (every span 1) of 1 / 32 / 64 requests at 1k-4k cached tokens,
- mixed batches: decode + verify spans + a prefill chunk in one launch,
- the KV store of a step's tokens.

Attention rows also give the KV bytes read per microsecond (TB/s) against the card's
bandwidth. Shapes default to Llama-3.1-8B's attention (32 query heads, 8 KV heads, head_dim
128), bf16, 16-token blocks.

    python benchmarks/kernels_gpu.py [--dtype bf16] [--heads 32] [--kv-heads 8] [--block-size 16]
"""
from __future__ import annotations

import argparse
import random

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOLERANCE = {torch.bfloat16: 1.5e-2, torch.float16: 5e-3, torch.float32: 1e-4}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rep-ms", type=int, default=200, help="do_bench time budget per case")
    return parser.parse_args()


def attention_cases() -> list[tuple[str, list[tuple[int, int]]]]:
    """(name, [(query len, kv len) per request])."""
    rng = random.Random(0)
    cases = [(f"decode b={b} kv={kv}", [(1, kv)] * b) for b in (1, 32, 64) for kv in (1024, 4096)]
    cases.append(("decode b=64 kv~U(1k,4k)", [(1, rng.randint(1024, 4096)) for _ in range(64)]))
    cases.append(("verify b=32 k=4 kv=2k", [(5, 2048)] * 32))
    cases.append(("mixed (1,1328)(5,18)(129,463)", [(1, 1328), (5, 18), (129, 463)]))
    cases.append(("mixed 32 verify + prefill 512",
                  [(5, 2048)] * 32 + [(512, 1536)]))
    cases.append(("prefill chunk 2048 (kv 2048)", [(2048, 2048)]))
    return cases


class PagedBatch:
    """A random paged cache holding every request's K/V, and the batch's metadata."""

    def __init__(self, spans, args, dtype, device) -> None:
        bs = args.block_size
        blocks_needed = sum(-(-kv // bs) for _, kv in spans)
        num_blocks = blocks_needed + 1024
        shape = (num_blocks, bs, args.kv_heads, args.head_dim)
        self.k_cache = torch.randn(shape, dtype=dtype, device=device)
        self.v_cache = torch.randn(shape, dtype=dtype, device=device)
        free = torch.randperm(num_blocks).tolist()
        tables = [[free.pop() for _ in range(-(-kv // bs))] for _, kv in spans]
        width = max(map(len, tables))
        self.block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                         dtype=torch.int32, device=device)
        self.query_lens = [q for q, _ in spans]
        self.seq_lens = [kv for _, kv in spans]
        cu = [0]
        for q in self.query_lens:
            cu.append(cu[-1] + q)
        self.cu_query_lens = torch.tensor(cu, dtype=torch.int32, device=device)
        self.seq_lens_t = torch.tensor(self.seq_lens, dtype=torch.int32, device=device)
        self.query = torch.randn(cu[-1], args.heads, args.head_dim, dtype=dtype, device=device)
        self.scale = args.head_dim ** -0.5

    @property
    def kv_bytes(self) -> int:
        """K and V bytes attention must read at least once."""
        row = self.k_cache.shape[2] * self.k_cache.shape[3] * self.k_cache.element_size()
        return 2 * sum(self.seq_lens) * row


def bench_attention(name, spans, args, dtype, device, rows) -> None:
    from triton.testing import do_bench

    from specserve.kernels import paged_attention as pa, reference

    b = PagedBatch(spans, args, dtype, device)
    plan = pa.plan_launch(b.query, b.k_cache, len(spans), max(b.query_lens), max(b.seq_lens))
    ref_plan = reference.plan_attention(b.block_tables, b.query_lens, b.seq_lens, args.block_size, None)

    def run_triton():
        return pa.paged_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.cu_query_lens,
                                  b.seq_lens_t, b.scale, plan=plan)

    def run_torch():
        return reference.paged_attention(b.query, b.k_cache, b.v_cache, b.block_tables,
                                         b.query_lens, b.seq_lens, b.scale, None, ref_plan)

    want = reference.paged_attention(b.query.float(), b.k_cache.float(), b.v_cache.float(),
                                     b.block_tables, b.query_lens, b.seq_lens, b.scale)
    err = (run_triton().float() - want).abs().max().item()
    assert err <= TOLERANCE[dtype], f"{name}: max abs error {err:.2e} vs the fp32 reference"
    t_triton = do_bench(run_triton, rep=args.rep_ms, return_mode="median") * 1e3
    t_torch = do_bench(run_torch, rep=args.rep_ms, return_mode="median") * 1e3
    tiles = f"M{plan.block_m}/Q{plan.block_q} s{plan.num_splits}"
    rows.append((name, tiles, f"{err:.1e}", t_torch, t_triton, b.kv_bytes / t_triton / 1e6))


def bench_store_kv(num_tokens, args, dtype, device, rows) -> None:
    from triton.testing import do_bench

    from specserve.kernels import reference, store_kv

    num_blocks = 4 * num_tokens // args.block_size + 64
    shape = (num_blocks, args.block_size, args.kv_heads, args.head_dim)
    k_cache, v_cache = torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
    key = torch.randn(num_tokens, args.kv_heads, args.head_dim, dtype=dtype, device=device)
    value = torch.randn_like(key)
    slots = torch.randperm(num_blocks * args.block_size, device=device)[:num_tokens]
    slots[::7] = -1  # padding rows, as with CUDA graphs
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, want_k, want_v, slots)
    store_kv.store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v), "store_kv differs"
    t_triton = do_bench(lambda: store_kv.store_kv(key, value, k_cache, v_cache, slots),
                        rep=args.rep_ms, return_mode="median") * 1e3
    t_torch = do_bench(lambda: reference.store_kv(key, value, k_cache, v_cache, slots),
                       rep=args.rep_ms, return_mode="median") * 1e3
    moved = 2 * 2 * key.numel() * key.element_size()  # read + write, K and V
    rows.append((f"store_kv {num_tokens} tokens", "-", "exact", t_torch, t_triton, moved / t_triton / 1e6))


def print_table(rows, card: str, args) -> None:
    print(f"\n{card} — heads {args.heads}:{args.kv_heads}, head_dim {args.head_dim}, "
          f"block {args.block_size}, {args.dtype}; times are medians in µs")
    header = ("case", "tiles/splits", "max err", "torch µs", "triton µs", "speed-up", "TB/s")
    print(f"{header[0]:<34} {header[1]:>13} {header[2]:>8} {header[3]:>10} {header[4]:>10} "
          f"{header[5]:>9} {header[6]:>6}")
    for name, tiles, err, t_torch, t_triton, tbps in rows:
        print(f"{name:<34} {tiles:>13} {err:>8} {t_torch:>10.1f} {t_triton:>10.1f} "
              f"{t_torch / t_triton:>8.1f}x {tbps:>6.2f}")


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kernels_gpu.py needs a CUDA GPU")
    device, dtype = torch.device("cuda"), DTYPES[args.dtype]
    torch.manual_seed(0)
    rows: list[tuple] = []
    for name, spans in attention_cases():
        bench_attention(name, spans, args, dtype, device, rows)
    for num_tokens in (64, 512, 4096):
        bench_store_kv(num_tokens, args, dtype, device, rows)
    print_table(rows, torch.cuda.get_device_name(), args)


if __name__ == "__main__":
    main()
