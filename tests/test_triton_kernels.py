"""Triton kernels (KV store, ragged paged attention) against their torch references.

On a CPU they run under the Triton interpreter at small sizes; with a CUDA GPU present
they are compiled and run at real sizes (bf16 within 1.5e-2 of an fp32 reference). Every
cache starts as NaN, so any read of a stale slot or unowned block poisons the result.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")

from specserve.kernels import paged_attention as pa, store_kv as skv  # noqa: E402

# conftest.py sets TRITON_INTERPRET=1 on CPU before anything imports triton.
assert CUDA or pa.interpreted(), "on a CPU, run with TRITON_INTERPRET=1 set before triton is imported"

from specserve.attention import TorchAttentionBackend, TritonAttentionBackend, get_backend  # noqa: E402
from specserve.config import EngineConfig  # noqa: E402
from specserve.errors import SpecserveError  # noqa: E402
from specserve.kernels import cpu_ops, reference  # noqa: E402
from specserve.sampling_params import SamplingParams  # noqa: E402
import paged_batches  # noqa: E402
from paged_batches import Batch  # noqa: E402
from sm90_compile import compiles_for_sm90  # noqa: E402
from tiny_models import LLM32  # noqa: E402

TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 1.5e-2}
F32, F16, BF16, FP8 = torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn

# (query len, kv len) per request: decode, verify, prefill chunks, a first token, all in one batch.
if CUDA:
    MIXED_SPANS = [(1, 1328), (5, 18), (129, 463), (1, 1), (1, 4000), (8, 2055), (512, 512), (3, 3)]
    DECODE_LENS = [1, 17, 1000, 1024, 2049, 4096, 3000, 64] * 4
    NUM_BLOCKS = 20_000
else:
    MIXED_SPANS = [(1, 133), (5, 18), (29, 46), (1, 1), (3, 70)]
    DECODE_LENS = [133, 1, 40, 77]
    NUM_BLOCKS = 300


# ---------------------------------------------------------------------------- helpers
def make_batch(spans, num_heads, num_kv_heads, head_dim, block_size, dtype, num_blocks=NUM_BLOCKS, seed=0):
    return paged_batches.make_batch(spans, num_heads, num_kv_heads, head_dim, block_size, dtype,
                                    DEVICE, num_blocks, seed)


def triton_attention(b: Batch, scale, window=None, num_splits=None, query=None, softcap=None):
    query = b.query if query is None else query
    return pa.paged_attention(query, b.k_cache, b.v_cache, b.block_tables, b.cu_query_lens,
                              b.seq_lens, scale, window, max_query_len=max(b.query_lens_host),
                              max_seq_len=max(b.seq_lens_host), num_splits=num_splits, softcap=softcap)


def reference_attention(b: Batch, scale, window=None, softcap=None):
    """The torch reference in fp32 on the same (upcast) inputs."""
    return reference.paged_attention(b.query.float(), b.k_cache.float(), b.v_cache.float(),
                                     b.block_tables, b.query_lens_host, b.seq_lens_host, scale, window,
                                     softcap=softcap)


def assert_close(out, want, dtype):
    assert out.dtype == dtype and out.shape == want.shape
    assert torch.isfinite(out).all()
    err = (out.float() - want).abs().max().item()
    assert err <= TOLERANCE[dtype], f"max abs error {err:.2e} > {TOLERANCE[dtype]:.0e}"


# ---------------------------------------------------------------------------- attention
# (num_heads, num_kv_heads, head_dim, block_size, dtype, sliding_window, num_splits)
CPU_CASES = [
    (8, 2, 64, 16, F32, None, None),
    (8, 2, 64, 16, F32, None, 3),
    (5, 1, 128, 32, F32, None, 2),
    (5, 1, 64, 16, BF16, None, None),
    (8, 2, 128, 32, BF16, None, 4),
    (8, 2, 64, 32, F16, None, 1),
    (5, 1, 128, 16, F16, None, 3),
    (4, 4, 64, 16, F32, 7, None),
    (8, 2, 64, 32, BF16, 20, 2),
    (4, 2, 80, 16, F32, None, 2),   # head_dim not a power of two
]
GPU_CASES = [(h, kvh, d, bs, dt, None, None)
             for h, kvh in ((8, 2), (5, 1)) for d in (64, 128) for bs in (16, 32)
             for dt in (BF16, F16, F32)]
GPU_CASES += [(32, 8, 128, 16, BF16, None, None), (32, 8, 128, 32, F32, None, 2)]
GPU_CASES += [(h, kvh, 128, 16, dt, w, s) for h, kvh in ((8, 2), (5, 1)) for dt in (BF16, F32)
              for w, s in ((256, None), (None, 1), (None, 7), (4096, 3))]


def case_id(case):
    h, kvh, d, bs, dt, w, s = case
    return f"{h}:{kvh}-d{d}-bs{bs}-{str(dt)[6:]}-w{w}-s{s}"


@pytest.mark.parametrize("case", GPU_CASES if CUDA else CPU_CASES, ids=case_id)
def test_paged_attention_mixed_batch(case):
    num_heads, num_kv_heads, head_dim, block_size, dtype, window, num_splits = case
    b = make_batch(MIXED_SPANS, num_heads, num_kv_heads, head_dim, block_size, dtype)
    scale = head_dim ** -0.5
    out = triton_attention(b, scale, window, num_splits)
    assert_close(out, reference_attention(b, scale, window), dtype)


@pytest.mark.parametrize("dtype, window, num_splits", [(F32, None, None), (BF16, 7, 2), (F32, 20, 3)]
                         if not CUDA else [(dt, w, s) for dt in (BF16, F32) for w, s in ((None, None), (4096, 3))])
def test_paged_attention_softcap(dtype, window, num_splits):
    """Gemma 2's attention logit soft-capping, with windows and KV splits; the cap is low
    enough to change most rows."""
    b = make_batch(MIXED_SPANS, 8, 2, 128 if CUDA else 64, 16, dtype)
    out = triton_attention(b, 0.125, window, num_splits, softcap=0.5)
    assert_close(out, reference_attention(b, 0.125, window, softcap=0.5), dtype)
    assert (out.float() - reference_attention(b, 0.125, window)).abs().amax(dim=(1, 2)).median() > 0.05


@pytest.mark.parametrize("num_heads, num_kv_heads, dtype", [(8, 2, BF16), (5, 1, F32), (4, 4, F16)])
def test_paged_attention_decode_batch(num_heads, num_kv_heads, dtype):
    """All spans 1 (plain decode): one-token tiles, splits chosen from the lengths."""
    b = make_batch([(1, n) for n in DECODE_LENS], num_heads, num_kv_heads, 128, 16, dtype, seed=1)
    plan = pa.plan_launch(b.query, b.k_cache, len(DECODE_LENS), 1, max(DECODE_LENS))
    assert plan.block_q == 1 and plan.num_tiles == len(DECODE_LENS)
    out = pa.paged_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.cu_query_lens,
                             b.seq_lens, 128 ** -0.5, plan=plan)
    assert_close(out, reference_attention(b, 128 ** -0.5), dtype)


@pytest.mark.parametrize("dtype, scales", [(BF16, (1.0, 1.0)), (F32, (1.0, 1.0)), (BF16, (0.05, 3.0))])
def test_paged_attention_reads_a_float8_cache(dtype, scales):
    """A float8 cache (``--kv-cache-dtype fp8``; stale slots NaN) under queries in bf16 or
    fp32, with its layer's K and V scales: the Triton kernel and the torch reference's own
    float8 path both give the fp32 reference on the values the cache stands for."""
    b = make_batch(MIXED_SPANS, 8, 2, 128 if CUDA else 64, 16, dtype)
    k_scale, v_scale = scales
    b.k_cache, b.v_cache = (reference.to_cache_dtype(c, FP8, s) for c, s in ((b.k_cache, k_scale), (b.v_cache, v_scale)))
    scale = 0.125
    held = dataclasses.replace(b, k_cache=b.k_cache.float() * k_scale, v_cache=b.v_cache.float() * v_scale)
    want = reference_attention(held, scale, None)
    got = pa.paged_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.cu_query_lens, b.seq_lens, scale,
                             max_query_len=max(b.query_lens_host), max_seq_len=max(b.seq_lens_host), num_splits=2,
                             k_scale=k_scale, v_scale=v_scale)
    assert_close(got, want, dtype)
    got = reference.paged_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.query_lens_host,
                                    b.seq_lens_host, scale, k_scale=k_scale, v_scale=v_scale)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("window", [None, 40])
def test_deterministic_plan_splits_at_fixed_positions(window, monkeypatch):
    """The deterministic plan: fixed tiles, KV splits at absolute multiples of the split
    size (made small here so the CPU-sized spans cross several, windows starting inside
    one). It equals the reference, and a plan for longer sequences (a CUDA graph's upper
    bound: more splits, the extra ones empty) gives the same bits."""
    monkeypatch.setattr(pa, "DETERMINISTIC_SPLIT_TOKENS", 512 if CUDA else 64)
    b = make_batch(MIXED_SPANS, 8, 2, 64, 16, F32, seed=4)
    outs = []
    for max_seq_len in (max(b.seq_lens_host), 4 * max(b.seq_lens_host)):
        plan = pa.plan_launch(b.query, b.k_cache, len(MIXED_SPANS), max(b.query_lens_host), max_seq_len,
                              deterministic=True)
        assert plan.split_tokens == pa.DETERMINISTIC_SPLIT_TOKENS and plan.num_splits > 1
        outs.append(pa.paged_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.cu_query_lens,
                                       b.seq_lens, 0.125, window, plan=plan))
    assert_close(outs[0], reference_attention(b, 0.125, window), F32)
    assert torch.equal(outs[0], outs[1])


def test_paged_attention_padding_rows_and_strided_query():
    """Rows past the last request (CUDA-graph padding) are ignored; a query that is a
    strided view (q sliced out of a fused qk tensor, as the model passes it) works."""
    b = make_batch(MIXED_SPANS, 4, 2, 64, 16, F32, seed=2)
    qk = torch.randn(b.query.shape[0] + 3, 6, 64, device=DEVICE)
    qk[: b.query.shape[0], :4] = b.query
    out = triton_attention(b, 0.125, num_splits=2, query=qk[:, :4])
    assert_close(out[: b.query.shape[0]], reference_attention(b, 0.125), F32)


def shaped(*shape, dtype=BF16):
    """A tensor of this shape without the memory (plan_launch reads only shapes)."""
    return torch.empty(1, dtype=dtype, device=DEVICE).expand(*shape)


def test_plan_splits_small_batches_not_large_ones(monkeypatch):
    cache = shaped(1000, 16, 8, 128)
    one = pa.plan_launch(shaped(1, 8, 128), cache[:, :, :1], 1, 1, 4096)
    assert one.num_splits > 1 and one.block_q == 1 and one.num_tiles == 1
    assert pa.plan_launch(shaped(1, 8, 128), cache[:, :, :1], 1, 1, 32).num_splits == 1  # short
    prefill = pa.plan_launch(shaped(4096, 32, 128), cache, 1, 4096, 4096)
    assert prefill.num_splits == 1 and prefill.block_m == 128 and prefill.block_q == 32
    verify = pa.plan_launch(shaped(40, 32, 128), cache, 8, 5, 1000)
    assert verify.block_m == 32 and verify.block_q == 8 and verify.num_tiles == 40 // 8 + 8
    wide = pa.plan_launch(shaped(4096, 32, 128, dtype=F32), cache, 1, 4096, 4096)
    assert wide.block_n == 32  # fp32 K/V stages must fit in shared memory
    # On 132 SMs, one request over 512 keys: a decode token's tile splits by 32 keys of the
    # longest sequence (16 splits), a verify span's by 128 (4).
    monkeypatch.setattr(pa, "_num_sms", lambda device: 132)
    assert pa.plan_launch(shaped(1, 32, 128), cache, 1, 1, 512).num_splits == 16
    assert pa.plan_launch(shaped(5, 32, 128), cache, 1, 5, 512).num_splits == 4


@pytest.mark.parametrize("heads", [(9, 3), (32, 8), (8, 8)])
def test_spans_of_any_length_share_a_few_kernel_variants(heads):
    """What picks a compiled variant (the tile's query tokens, rows, keys and warps) takes
    at most five values over every longest span from 1 to 300 tokens: a span length first
    seen mid-run (a lazy draft's catch-up, a prompt chunk) finds its variant compiled by the
    steps before it, instead of stalling its step for a compilation."""
    num_heads, num_kv_heads = heads
    cache = shaped(1000, 16, num_kv_heads, 64)
    plans = [pa.plan_launch(shaped(n, num_heads, 64), cache, 1, n, 2000) for n in range(1, 301)]
    variants = {(p.block_q, p.block_m, p.block_n, p.num_warps, p.num_stages) for p in plans}
    assert len(variants) <= 5, sorted(variants)


def test_kv_splits_of_any_count_share_one_reduce_variant(monkeypatch):
    """The sum of KV splits compiles one variant for every split count (its split axis is
    as wide as the most splits, masked), and is still exact at each count."""
    reduce, widths = pa._reduce_splits_kernel, set()

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                widths.add(kwargs["BLOCK_S"])
                return reduce[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(pa, "_reduce_splits_kernel", Spy())
    b = make_batch(MIXED_SPANS, 4, 2, 64, 16, F32)
    for num_splits in (2, 3, 5, 9):
        assert_close(triton_attention(b, 0.125, num_splits=num_splits), reference_attention(b, 0.125), F32)
    assert len(widths) == 1, widths


def test_split_reduce_stops_after_the_last_split_with_keys(monkeypatch):
    """Splits past a row's last key (a plan made for longer sequences, as a CUDA graph's
    is) add exact zeros: the reduce that stops after the last split that saw a key (as
    shipped) gives the same bits as the one summing every split, and the reference. A NaN
    key in a row's last split (its newest) still reaches that row's output, as with one
    split: a split with a NaN log-sum-exp counts as seen."""
    b = make_batch([(1, 9), (1, 70), (3, 200)], 4, 2, 64, 16, F32, seed=5)

    def attend(used_only: bool) -> torch.Tensor:
        monkeypatch.setattr(pa, "REDUCE_USED_ONLY", used_only)
        plan = pa.plan_launch(b.query, b.k_cache, 3, 3, 200, num_splits=8)
        assert min(b.seq_lens_host) < plan.block_n < max(b.seq_lens_host) < 8 * plan.block_n  # some splits empty
        return pa.paged_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.cu_query_lens, b.seq_lens,
                                  0.125, plan=plan)

    used, every = attend(True), attend(False)
    assert torch.equal(used, every)
    assert_close(used, reference_attention(b, 0.125), F32)
    last = b.seq_lens_host[1] - 1  # request 1's newest key: the last split it reaches
    b.k_cache[b.block_tables[1, last // 16].long(), last % 16] = float("nan")
    for used_only in (True, False):
        out = attend(used_only)
        assert torch.isnan(out[1]).all() and not torch.isnan(out[0]).any()


def _variant(plan, tree: bool) -> tuple:
    """What picks a compiled attention variant for a step (beside the model's constants)."""
    return (plan.block_q, plan.block_m, plan.block_n, plan.num_warps, plan.num_stages,
            plan.num_splits > 1, plan.split_tokens, tree)


def _reachable_variants(attn, dtype, max_model_len, deterministic, trees) -> set:
    """Every variant a step of ``attn``'s layer can pick: brute force over spans, sequence
    lengths and batches."""
    num_heads, head_dim = attn.num_heads, attn.head_dim
    cache = shaped(1000, 16, attn.num_kv_heads, head_dim, dtype=dtype)
    found = set()
    for num_reqs in (1, 2, 5, 64):
        for span in range(1, 200):
            for seq in {*range(span, max_model_len + 1, 37), max_model_len}:
                if seq >= span:
                    plan = pa.plan_launch(shaped(span + num_reqs - 1, num_heads, head_dim, dtype=dtype), cache, num_reqs,
                                          span, seq, deterministic=deterministic)
                    found |= {_variant(plan, tree) for tree in trees}
    return found


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, dtype", [
    (9, 3, 64, BF16), (32, 8, 128, BF16), (16, 16, 64, F32), (64, 8, 256, BF16)])
@pytest.mark.parametrize("deterministic", [False, True])
def test_warmup_lengths_reach_every_attention_variant(monkeypatch, num_heads, num_kv_heads, head_dim, dtype,
                                                      deterministic):
    """One request per pair of ``warmup_lengths`` plans every variant that any step could
    (brute force over spans, sequence lengths and batch sizes, on an H200's 132 SMs)."""
    monkeypatch.setattr(pa, "_num_sms", lambda device: 132)
    attn = dataclasses.make_dataclass("Attn", ["num_heads", "num_kv_heads", "head_dim"])(
        num_heads, num_kv_heads, head_dim)
    cache = shaped(1000, 16, num_kv_heads, head_dim, dtype=dtype)
    for max_model_len in (24, 100, 300, 2048):
        warmed = {_variant(pa.plan_launch(shaped(span, num_heads, head_dim, dtype=dtype), cache, 1, span, seq,
                                          deterministic=deterministic), False)
                  for span, seq in pa.warmup_lengths(max_model_len)}
        want = _reachable_variants(attn, dtype, max_model_len, deterministic, (False,))
        assert warmed == want, (sorted(warmed), sorted(want))
        splits = max_model_len > (pa.DETERMINISTIC_SPLIT_TOKENS if deterministic else pa._MIN_DECODE_SPLIT_TOKENS)
        assert {v[5] for v in want} == ({False, True} if splits else {False})


def test_start_up_passes_compile_every_attention_variant_a_step_can_pick(tiny_model_dir, monkeypatch):
    """``ModelRunner.compile_kernels`` (run before the CUDA graphs are captured) runs the
    model over every pair of ``warmup_lengths``, and again as a tree's rows where the
    engine verifies trees, so its layers plan every variant a later step could and none
    compiles in the middle of serving; it writes nothing to the cache. (The layers' other
    ops run in torch and the attention kernel is not run: the interpreter is slow, and the
    kernels' own tests run them.)"""
    monkeypatch.setattr(pa, "_num_sms", lambda device: 132)
    max_model_len = 160
    llm = LLM32(str(tiny_model_dir("llama")), attention_backend="torch", max_model_len=max_model_len, **ENGINE)
    runner, triton = llm.engine.runner, TritonAttentionBackend()
    monkeypatch.setattr(runner.model, "attention_backend", triton)
    for layer in runner.model.model.layers:
        monkeypatch.setattr(layer.self_attn, "backend", triton)
    seen = set()

    def spy(query, *args, plan=None, tree_masks=None, **kwargs):
        seen.add(_variant(plan, tree_masks is not None))
        return torch.zeros_like(query)

    monkeypatch.setattr(pa, "paged_attention", spy)
    cache = runner.kv_storage.clone()
    attn = runner.model.model.layers[0].self_attn
    for trees in (0, 3):
        seen.clear()
        monkeypatch.setattr(runner.config, "draft_tree_nodes", trees)
        passes = runner.compile_kernels(max_model_len)
        want = _reachable_variants(attn, runner.dtype, max_model_len, False, (False, True) if trees else (False,))
        assert seen == want, (sorted(seen), sorted(want))
        assert {variant[5] for variant in want} == {False, True}  # with one KV split and with several
        assert passes == len(pa.warmup_lengths(max_model_len)) * (2 if trees else 1)
    assert torch.equal(runner.kv_storage, cache)


@pytest.mark.skipif(not CUDA, reason="compiles happen on a GPU (the interpreter compiles nothing)")
def test_no_attention_kernel_compiles_after_start_up(tiny_model_dir):
    """On a GPU, once the engine has started (its CUDA graphs captured after
    ``compile_kernels``), steps of every kind of span (prompt chunks of many lengths,
    decode, verify of drafts) compile no attention kernel. Steps over 32 tokens run
    eagerly here, planned from their real lengths (a 400-token prompt alone: the widest
    tile with its keys split), which no graph's worst-case plan reaches."""
    from triton import knobs  # lazy: triton's knobs, on a GPU only

    compiled = []

    def hook(*args, **kwargs):
        fn = kwargs.get("fn")
        compiled.append(getattr(getattr(fn, "jit_function", fn), "__name__", str(kwargs.get("key", ""))))
        return False

    llm = LLM32(str(tiny_model_dir("llama")), speculative_method="ngram", num_speculative_tokens=3,
                max_num_batched_tokens=512, max_num_seqs=8, block_size=16, max_model_len=512,
                cuda_graph_max_tokens=32)
    before, knobs.runtime.jit_post_compile_hook = knobs.runtime.jit_post_compile_hook, hook
    try:
        prompts = [list(range(3, 3 + n)) for n in (1, 3, 7, 20, 45, 90, 200, 400)]
        for prompt in prompts:
            llm.generate([prompt], GREEDY, use_tqdm=False)
        llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        knobs.runtime.jit_post_compile_hook = before
    assert not [name for name in compiled if "attention" in name or "splits" in name], compiled


def test_paged_attention_rejects_bad_shapes():
    b = make_batch([(1, 5)], 6, 4, 64, 16, F32, num_blocks=4)
    with pytest.raises(ValueError, match="multiple"):
        triton_attention(b, 0.1)
    b = make_batch([(1, 5)], 2, 1, 8, 16, F32, num_blocks=4)
    with pytest.raises(ValueError, match="head_dim"):
        triton_attention(b, 0.1)


# Compiles (does not run) a few variants of each kernel for Hopper in a fresh process
# without the interpreter: catches what only the compiler rejects (types of loop-carried
# values, shapes tl.dot refuses, shared memory). No GPU is needed for this.
COMPILE_FOR_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from specserve.kernels import paged_attention as pa, store_kv as skv

def compile(fn, pointers, constants, num_warps, num_stages=2, i64=()):
    signature = {name: "constexpr" if name in constants else pointers.get(name, "i64" if name in i64 else "i32")
                 for name in fn.arg_names}
    constexprs = {(fn.arg_names.index(name),): value for name, value in constants.items()}
    triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                   target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))

for dtype, cache, group, head_dim, block_size, block_q, block_m, block_n, split, window in (
        ("bf16", "bf16", 4, 128, 16, 1, 16, 64, True, False),      # decode, split KV
        ("fp32", "fp32", 5, 64, 32, 25, 128, 32, False, True),     # prefill tile, window, IEEE dot
        ("fp16", "fp16", 2, 80, 16, 16, 32, 64, True, True),       # padded head_dim
        ("bf16", "fp8e4nv", 4, 128, 16, 5, 32, 64, True, False)):  # verify, a float8 cache (fp16 dots)
    pointers = {n: "*" + dtype for n in ("out_ptr", "q_ptr")}
    pointers.update(k_cache_ptr="*" + cache, v_cache_ptr="*" + cache)
    pointers.update(part_out_ptr="*fp32", part_lse_ptr="*fp32", block_tables_ptr="*i32",
                    cu_query_lens_ptr="*i32", seq_lens_ptr="*i32", tree_masks_ptr="*i64", qk_scale="fp32",
                    v_scale="fp32")
    compile(pa._paged_attention_kernel, pointers, dict(
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT_KV=split,
        USE_WINDOW=window, UPCAST_DOT=False, IEEE_DOT=dtype == "fp32", FP16_DOT=cache == "fp8e4nv",
        TREE=block_q == 5),  # (the verify tile: a draft tree's visibility masks)
        num_warps=8 if block_m >= 128 else 4, i64=("stride_kb", "stride_vb"))
compile(pa._reduce_splits_kernel, dict(out_ptr="*bf16", part_out_ptr="*fp32", part_lse_ptr="*fp32",
        cu_query_lens_ptr="*i32"), dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=32), num_warps=4)
for cache in ("bf16", "fp8e4nv"):
    compile(skv._store_kv_kernel, dict(key_ptr="*bf16", value_ptr="*bf16", k_cache_ptr="*" + cache,
            v_cache_ptr="*" + cache, slot_mapping_ptr="*i64", k_scale="fp32", v_scale="fp32"),
            dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=128, KV_FP8=cache != "bf16"),
            num_warps=4)
print("compiled")
"""


@pytest.mark.skipif(CUDA, reason="with a GPU every test above compiles the kernels for real")
def test_kernels_compile_for_hopper():
    compiles_for_sm90(COMPILE_FOR_SM90)


# ---------------------------------------------------------------------------- KV store
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_store_kv_matches_reference_and_skips_padding(dtype, block_size):
    """Random scattered slots with -1 rows; a strided key (sliced from a fused tensor);
    fp32 inputs cast to the cache dtype. -1 rows and every other slot stay untouched."""
    g = torch.Generator(device=DEVICE).manual_seed(3)
    num_blocks, kv_heads, head_dim = (4096, 8, 128) if CUDA else (64, 2, 64)
    num_tokens = 1000 if CUDA else 40
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g, device=DEVICE).to(dtype)
    v_cache = torch.randn(shape, generator=g, device=DEVICE).to(dtype)
    fused = torch.randn(num_tokens, 3 * kv_heads, head_dim, generator=g, device=DEVICE)
    key, value = fused[:, kv_heads:2 * kv_heads], fused[:, 2 * kv_heads:]
    slots = torch.randperm(num_blocks * block_size, generator=g, device=DEVICE)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=g, device=DEVICE)[: num_tokens // 4]] = -1
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, want_k, want_v, slots)
    before = k_cache.clone()
    skv.store_kv(key, value, k_cache, v_cache, slots)
    if CUDA or dtype != BF16:
        assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    else:  # the interpreter truncates fp32 -> bf16 where the GPU rounds to nearest even
        for got, want in ((k_cache, want_k), (v_cache, want_v)):
            torch.testing.assert_close(got, want, rtol=2**-7, atol=0)
    changed = k_cache.view(-1, kv_heads, head_dim) != before.view(-1, kv_heads, head_dim)
    written = changed.flatten(1).any(1).nonzero().flatten()  # slots that differ now
    assert set(written.tolist()) <= set(slots[slots >= 0].tolist())


@pytest.mark.parametrize("dtype, scales", [(F32, (1.0, 1.0)), (BF16, (1.0, 1.0)), (BF16, (0.03, 2.5))])
def test_store_kv_into_a_float8_cache(dtype, scales):
    """``--kv-cache-dtype fp8``: values over the layer's scales, saturated at ±448 and
    rounded to nearest as torch's division and cast do (subnormals included): the
    reference's values; -1 rows skipped."""
    g = torch.Generator(device=DEVICE).manual_seed(4)
    num_blocks, kv_heads, head_dim, block_size = (4096, 8, 128, 16) if CUDA else (64, 2, 64, 16)
    num_tokens = 1000 if CUDA else 40
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = (torch.full(shape, float("nan"), device=DEVICE).to(FP8) for _ in range(2))
    spread = torch.logspace(-4, 3, head_dim, device=DEVICE)  # 2⁻⁹ (subnormal) to past 448
    key = (torch.randn(num_tokens, kv_heads, head_dim, generator=g, device=DEVICE) * spread).to(dtype)
    value = (torch.randn(num_tokens, kv_heads, head_dim, generator=g, device=DEVICE) * spread).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g, device=DEVICE)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=g, device=DEVICE)[: num_tokens // 4]] = -1
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, want_k, want_v, slots, k_scale=scales[0], v_scale=scales[1])
    skv.store_kv(key, value, k_cache, v_cache, slots, *scales)
    for got, want in ((k_cache, want_k), (v_cache, want_v)):
        assert same_values(got, want)
    stored = k_cache.view(-1, kv_heads, head_dim)[slots[slots >= 0]].float()
    assert stored.abs().max() == 448 and torch.isfinite(stored).all()
    want = (key[slots >= 0].float() / scales[0]).clamp(-448, 448).to(FP8).float()
    assert same_values(stored, want)


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where the other has NaN (+0 and −0 are the same value: a GPU's
    float8 rounding may give +0 where torch's gives −0)."""
    a, b = a.float(), b.float()
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def test_store_kv_all_padding_writes_nothing():
    k_cache = torch.zeros(4, 16, 2, 64, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    key = torch.ones(5, 2, 64, device=DEVICE)
    skv.store_kv(key, key, k_cache, v_cache, torch.full((5,), -1, device=DEVICE))
    assert not k_cache.any() and not v_cache.any()


# ---------------------------------------------------------------------------- index overflow
def test_large_num_blocks_index_math():
    """A cache of more than 2**31 elements, used at its last blocks: int32 offsets would
    wrap. The cache is left uninitialised (only touched pages cost memory); the result is
    compared with the reference over a compact cache holding the same blocks."""
    block_size, kv_heads, head_dim, dtype = 16, 1, 16, BF16
    used = sum(-(-kv_len // block_size) for _, kv_len in MIXED_SPANS[:3])  # GPU spans are long
    num_blocks = 2**31 // (block_size * kv_heads * head_dim) + used
    small = make_batch(MIXED_SPANS[:3], 4, kv_heads, head_dim, block_size, dtype, num_blocks=used)
    big_k = torch.empty(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    big_v = torch.empty_like(big_k)
    far = torch.arange(num_blocks - used, num_blocks, device=DEVICE).flip(0)  # small block j -> far[j]
    big_k[far], big_v[far] = small.k_cache, small.v_cache
    big = Batch(small.query, big_k, big_v, far[small.block_tables.long()].int(), small.cu_query_lens,
                small.seq_lens, small.query_lens_host, small.seq_lens_host)
    out = triton_attention(big, 0.25, num_splits=2)
    assert_close(out, reference_attention(small, 0.25), dtype)

    key = torch.randn(3, kv_heads, head_dim, device=DEVICE).to(dtype)
    slots = torch.tensor([(num_blocks - 1) * block_size + 5, -1, (num_blocks - 2) * block_size],
                         device=DEVICE)
    skv.store_kv(key, -key, big_k, big_v, slots)
    assert torch.equal(big_k[-1, 5], key[0]) and torch.equal(big_v[-2, 0], -key[2])


# ---------------------------------------------------------------------------- backend + engine
def test_backend_selection(monkeypatch):
    assert isinstance(get_backend("auto", torch.device("cpu")), TorchAttentionBackend)
    assert isinstance(get_backend("torch", DEVICE), TorchAttentionBackend)
    assert isinstance(get_backend("triton", DEVICE), TritonAttentionBackend)
    if CUDA:
        assert isinstance(get_backend("auto", DEVICE), TritonAttentionBackend)
    with pytest.raises(SpecserveError, match="unknown attention backend"):
        get_backend("flash", DEVICE)
    monkeypatch.setattr(pa, "interpreted", lambda: False)
    with pytest.raises(SpecserveError, match="needs a CUDA device"):
        get_backend("triton", torch.device("cpu"))
    assert EngineConfig(attention_backend="triton").attention_backend == "triton"
    with pytest.raises(SpecserveError, match="attention_backend"):
        EngineConfig(attention_backend="flash")


GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
ENGINE = dict(max_num_batched_tokens=24, max_num_seqs=4, block_size=16, num_kv_blocks=32)


@pytest.mark.parametrize("variant, extra", [
    ("llama", dict(speculative_method="ngram", num_speculative_tokens=3)),  # decode+verify+prefill
    ("mistral_window", dict()),                                             # sliding window
])
def test_engine_greedy_output_matches_torch_backend(tiny_model_dir, variant, extra):
    prompts = [[5, 9, 11, 5, 9, 11, 5, 9], list(range(3, 40)), [7]]
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM32(str(tiny_model_dir(variant)), attention_backend=backend, **ENGINE, **extra)
        assert llm.engine.runner.model.model.layers[0].self_attn.backend.name == backend
        outputs[backend] = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert outputs["triton"] == outputs["torch"]


def test_engine_with_a_float8_kv_cache(tiny_model_dir):
    """``kv_cache_dtype="fp8"``: the cache is float8 with scales calibrated per layer, a
    block costs a quarter of fp32's, speculative greedy decoding equals plain greedy on it,
    and every block comes back (the calibration's too). The C++ CPU kernels refuse it in
    one line, as do tensor parallelism and an unknown dtype."""
    path = str(tiny_model_dir("llama"))
    prompts = [[5, 9, 11, 5, 9, 11, 5, 9], list(range(3, 40)), [7]]
    common = dict(attention_backend="triton", kv_cache_dtype="fp8", **ENGINE)
    plain = LLM32(path, **common)
    runner = plain.engine.runner
    assert runner.kv_storage.dtype == FP8
    scales = [layer.self_attn.kv_scales for layer in runner.model.model.layers]
    assert all(0 < s < 1 for pair in scales for s in pair) and len(set(scales)) > 1, scales  # calibrated
    assert runner.bytes_per_block * 4 == LLM32(path, attention_backend="triton", **ENGINE).engine.runner.bytes_per_block
    want = [o.token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    spec = LLM32(path, speculative_method="ngram", num_speculative_tokens=3, speculative_adaptive=False, **common)
    assert [o.token_ids for o in spec.generate(prompts, GREEDY, use_tqdm=False)] == want
    assert spec.engine.num_free_blocks == spec.engine.kv.num_blocks
    if not CUDA and cpu_ops.available():  # the torch backend on the C++ CPU kernels
        with pytest.raises(SpecserveError, match="kv_cache_dtype fp8 runs on CUDA"):
            LLM32(path, kv_cache_dtype="fp8", attention_backend="torch", **ENGINE)
    with pytest.raises(SpecserveError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int8")
    with pytest.raises(SpecserveError, match="tensor parallelism"):
        EngineConfig(kv_cache_dtype="fp8", tensor_parallel_size=2)
