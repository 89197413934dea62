"""Fused layer-glue kernels (RMSNorm + residual, SiLU·mul, rotary + KV store) against their
torch references, and the model with them (the Triton backend) against the torch path.

On a CPU the kernels run under the Triton interpreter at small sizes; with a CUDA GPU
present they are compiled and run at real sizes (bf16 within 1.5e-2 + 1.6e-2·|x| of an
fp32 reference, i.e. within its two bf16 roundings).
"""
from __future__ import annotations


import pytest
import torch

pytest.importorskip("triton")

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")

from specserve.kernels import fused_act, fused_norm, fused_rotary, reference  # noqa: E402
from specserve.kernels.paged_attention import interpreted  # noqa: E402

# conftest.py sets TRITON_INTERPRET=1 on CPU before anything imports triton.
assert CUDA or interpreted(), "on a CPU, run with TRITON_INTERPRET=1 set before triton is imported"

from specserve.attention import TorchAttentionBackend, get_backend  # noqa: E402
from specserve.loader import ModelFiles, build_model, load_hf_config  # noqa: E402
from specserve.kernels import cpu_ops  # noqa: E402
from specserve.models.layer_ops import CpuLayerOps, TorchLayerOps, TritonLayerOps  # noqa: E402
from specserve.models.rotary import Rotary, apply_rotary  # noqa: E402
from specserve.sampling_params import SamplingParams  # noqa: E402
from sm90_compile import compiles_for_sm90  # noqa: E402
from model_steps import chunked_prefill_logits  # noqa: E402
from tiny_models import LLM32, VARIANTS  # noqa: E402

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPES = [F32, BF16, F16]
# Against an fp32 reference: absolute + relative (two roundings to the output dtype; the
# interpreter truncates fp32 -> bf16 where a GPU rounds to nearest even).
ATOL = {F32: 1e-5, F16: 5e-3, BF16: 1.5e-2}
RTOL = {F32: 1e-5, F16: 2e-3, BF16: 1.6e-2}
NUM_TOKENS = [1, 7, 64, 2048] if CUDA else [1, 7, 64]
HIDDEN = [576, 4096, 8192] if CUDA else [576, 96]
INTERMEDIATE = [1536, 14336, 1000] if CUDA else [1536, 96]
# (num_heads, num_kv_heads, head_dim): SmolLM2-135M, the 8B shape, a tiny test model,
# a head_dim whose half is no power of two.
HEADS = [(9, 3, 64), (32, 8, 128), (4, 2, 16), (5, 1, 80)] if CUDA else [(9, 3, 64), (4, 2, 16), (5, 1, 80)]


def randn(*shape, dtype=F32, seed=0, scale=1.0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g, device=DEVICE)).to(dtype)


def assert_close(out, want, dtype):
    """``out`` (in ``dtype``) against an fp32 reference ``want``."""
    assert out.dtype == dtype and out.shape == want.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), want, atol=ATOL[dtype], rtol=RTOL[dtype])


def assert_same_roundings(out, want):
    """``out`` against the torch path in the same dtype, which rounds where the kernel does:
    within one unit in the last place on a GPU (the fp32 reductions differ), two under the
    interpreter in bf16 (it truncates)."""
    ulps = 2 if out.dtype == BF16 and not CUDA else 1
    rtol = {F32: 1e-5, F16: 2**-10, BF16: 2**-7}[out.dtype] * ulps
    torch.testing.assert_close(out, want, rtol=rtol, atol=ATOL[out.dtype] / 3)


def exact_unless_interpreted_bf16(out, want):
    """Equal where both round to nearest even (the GPU, or fp16/fp32 in the interpreter)."""
    if CUDA or out.dtype != BF16:
        assert torch.equal(out, want)
    else:
        torch.testing.assert_close(out, want, rtol=2**-7, atol=0)


# ---------------------------------------------------------------------------- RMSNorm
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_rms_norm(num_tokens, hidden, dtype):
    x = randn(num_tokens, hidden, dtype=dtype, scale=3.0)
    weight = (1 + randn(hidden, seed=1, scale=0.2)).to(dtype)
    out = fused_norm.rms_norm(x, weight, 1e-5)
    assert_close(out, reference.rms_norm(x.float(), weight.float(), 1e-5), dtype)
    assert_same_roundings(out, reference.rms_norm(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_add_rms_norm(num_tokens, hidden, dtype):
    x = randn(num_tokens, hidden, dtype=dtype, seed=2)
    residual = randn(num_tokens, hidden, dtype=dtype, seed=3, scale=4.0)
    weight = (1 + randn(hidden, seed=4, scale=0.2)).to(dtype)
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = fused_norm.add_rms_norm(x, residual, weight, 1e-6)
    exact_unless_interpreted_bf16(new_residual, x + residual)  # rounded once, as torch does
    assert_close(out, reference.rms_norm(new_residual.float(), weight.float(), 1e-6), dtype)
    assert_same_roundings(out, reference.add_rms_norm(new_residual, torch.zeros_like(x), weight, 1e-6)[0])
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)  # out of place


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN)
def test_gemma_rms_norm_with_and_without_the_residual(hidden, dtype):
    """Gemma's norm: (1 + weight) in fp32, one rounding (its weights sit near 0)."""
    x = randn(7, hidden, dtype=dtype, seed=2)
    residual = randn(7, hidden, dtype=dtype, seed=3, scale=4.0)
    weight = randn(hidden, seed=4, scale=0.2).to(dtype)
    out = fused_norm.gemma_rms_norm(x, weight, 1e-6)
    assert_close(out, reference.gemma_rms_norm(x.float(), weight.float(), 1e-6), dtype)
    assert_same_roundings(out, reference.gemma_rms_norm(x, weight, 1e-6))
    out, new_residual = fused_norm.gemma_add_rms_norm(x, residual, weight, 1e-6)
    exact_unless_interpreted_bf16(new_residual, x + residual)
    assert_same_roundings(out, reference.gemma_rms_norm(new_residual, weight, 1e-6))


def test_rms_norm_rows_of_a_strided_view_and_3d_input():
    """q-norm style input: heads of a merged qkv tensor, normalised over head_dim."""
    qkv = randn(5, 7, 32)
    q = qkv[:, :4]  # [5, 4, 32], not contiguous
    weight = 1 + randn(32, seed=5, scale=0.2)
    assert_close(fused_norm.rms_norm(q, weight, 1e-6), reference.rms_norm(q, weight, 1e-6), F32)
    wide = randn(6, 200)
    x = wide[:, :96]
    assert_close(fused_norm.rms_norm(x, weight.repeat(3), 1e-6),
                 reference.rms_norm(x, weight.repeat(3), 1e-6), F32)


def test_rms_norm_empty_and_bad_shapes():
    assert fused_norm.rms_norm(randn(0, 64), randn(64), 1e-6).shape == (0, 64)
    with pytest.raises(ValueError, match="weight"):
        fused_norm.rms_norm(randn(3, 64), randn(32), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        fused_norm.add_rms_norm(randn(3, 64), randn(3, 64, dtype=BF16), randn(64), 1e-6)


# ---------------------------------------------------------------------------- SiLU·mul
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate", INTERMEDIATE)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_silu_and_mul(num_tokens, intermediate, dtype):
    gate_up = randn(num_tokens, 2 * intermediate, dtype=dtype, seed=6, scale=3.0)
    out = fused_act.silu_and_mul(gate_up)
    assert out.shape == (num_tokens, intermediate)
    assert_close(out, reference.silu_and_mul(gate_up.float()), dtype)
    assert_same_roundings(out, reference.silu_and_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate", INTERMEDIATE)
def test_gelu_tanh_and_mul(intermediate, dtype):
    """GeGLU (Gemma's MLP): transformers' gelu_pytorch_tanh of the gate, times up."""
    gate_up = randn(9, 2 * intermediate, dtype=dtype, seed=6, scale=3.0)
    out = fused_act.gelu_tanh_and_mul(gate_up)
    assert_close(out, reference.gelu_tanh_and_mul(gate_up.float()), dtype)
    assert_same_roundings(out, reference.gelu_tanh_and_mul(gate_up))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's numpy: exp(1e4)
def test_silu_and_mul_extremes_and_strided_rows():
    gate = torch.tensor([-1e4, -100.0, -20.0, 0.0, 20.0, 100.0, 1e4, 1.5], device=DEVICE)
    up = torch.linspace(-2, 2, 8, device=DEVICE)
    wide = torch.zeros(3, 20, device=DEVICE)
    wide[:, :16] = torch.cat((gate, up))
    out = fused_act.silu_and_mul(wide[:, :16])
    assert torch.isfinite(out).all()
    assert_close(out, reference.silu_and_mul(wide[:, :16]), F32)
    with pytest.raises(ValueError, match="even"):
        fused_act.silu_and_mul(randn(2, 7))


# ---------------------------------------------------------------------------- float8 rows
# (width, group): per row, a power of two of it, groups with a short last one, groups
# wider than a norm's slice; on a GPU also the 8B shape's rows, whose activation is one
# program (per row) or 14 (in groups).
FP8_ROWS = [(96, 10_000), (96, 32), (200, 64), (2500, 128), (2500, 2500), (2500, 2048)] + \
    ([(4096, 4096), (4096, 128), (14336, 14336), (14336, 128)] if CUDA else [])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def rounds_alike(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    """A norm's float8 rows against the quantizer's rounding of the norm's output: bit for
    bit under the interpreter. A GPU compiles the two norms apart and may sum a row's
    squares in another order (seen in fp32 at widths of 4,096 and 14,336 on an H100), so
    there the scales agree to fp32 rounding, and a value that lay at a midpoint may take
    the neighbouring float8 value (at most 1 % of them)."""
    (q, scales), (want_q, want_scales) = got, want
    if not CUDA:
        assert same_bits(q, want_q) and same_bits(scales, want_scales)
        return
    torch.testing.assert_close(scales, want_scales, rtol=2**-20, atol=0)
    q, want_q = q.float(), want_q.float()
    step = 2**-3 * torch.maximum(q.abs(), want_q.abs()) + 2**-9  # float8's spacing there, or below
    assert ((q - want_q).abs() <= step).all() and (q != want_q).float().mean() <= 0.01


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's numpy
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("width, group", FP8_ROWS)
def test_norms_and_activations_hand_float8_rows_as_the_quantizer_rounds_them(width, group, dtype, monkeypatch):
    """A norm's or activation's output handed on as float8 rows (``fp8_group``) is what
    the float8 layer's own quantizer makes of the output it would have written
    (``quant_matmul.quantize_rows``): values and scales, whatever the group; bit for bit
    for the activations (per row in both forms: a row over its blocks in two launches,
    and one program a row), and for the norms up to the order of their sums on a GPU
    (``rounds_alike``)."""
    from specserve.kernels import quant_matmul

    x = randn(5, width, dtype=dtype, seed=8) * torch.logspace(-3, 1, width, device=DEVICE).to(dtype)
    residual, weight = randn(5, width, dtype=dtype, seed=9), randn(width, dtype=dtype, seed=10).abs() + 0.5
    for norm, add in ((fused_norm.rms_norm, fused_norm.add_rms_norm),
                      (fused_norm.gemma_rms_norm, fused_norm.gemma_add_rms_norm)):
        rounds_alike(norm(x, weight, 1e-6, fp8_group=group), quant_matmul.quantize_rows(norm(x, weight, 1e-6), group))
        handed, summed = add(x, residual, weight, 1e-6, fp8_group=group)
        out, want_summed = add(x, residual, weight, 1e-6)
        assert same_bits(summed, want_summed)
        rounds_alike(handed, quant_matmul.quantize_rows(out, group))
    gate_up = randn(3, 2 * width, dtype=dtype, seed=11, scale=3.0)
    for split_most in (fused_act.ROW_SPLIT_MOST, 0):  # (3 rows: the two-launch form where it applies, then not)
        monkeypatch.setattr(fused_act, "ROW_SPLIT_MOST", split_most)
        for act in (fused_act.silu_and_mul, fused_act.gelu_tanh_and_mul):
            q, scales = act(gate_up, fp8_group=group)
            assert scales.shape == (3, -(-width // min(group, width)))
            assert all(same_bits(a, b) for a, b in zip((q, scales), quant_matmul.quantize_rows(act(gate_up), group)))
    with pytest.raises(ValueError, match="groups of a power of two"):
        fused_act.silu_and_mul(gate_up, fp8_group=48)


# ---------------------------------------------------------------------------- rotary
def rotary_config(variant: str):
    from transformers import LlamaConfig

    rope = dict(VARIANTS["llama3_rope"][2]) if variant == "llama3" else dict(rope_theta=10000.0)
    return LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                       max_position_embeddings=2048, **rope)


@pytest.mark.parametrize("rope", ["default", "llama3"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cached_rotary_reference_equals_the_torch_path(rope, dtype):
    """The cos/sin cache + ``reference.rotary_embedding`` give what the model's CPU path
    (per-step cos/sin, ``apply_rotary``) gives: the same in fp32, within its bf16/fp16
    roundings otherwise (it rounds cos, sin and each product; the reference rounds once)."""
    rotary = Rotary(rotary_config(rope), max_positions=2048).to(DEVICE)
    positions = torch.tensor([0, 1, 17, 511, 2047, 1000, 3], device=DEVICE)
    qk = randn(7, 12, 64, dtype=dtype, seed=7)
    want = apply_rotary(qk, *rotary(positions, dtype))
    q, k = reference.rotary_embedding(qk[:, :9], qk[:, 9:], positions, rotary.cos_sin_cache)
    got = torch.cat((q, k), dim=1)
    if dtype == F32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    else:
        torch.testing.assert_close(got.float(), want.float(), atol=2 * ATOL[dtype], rtol=2 * RTOL[dtype])


def rotary_inputs(num_tokens, heads, dtype, max_positions=4096, seed=8):
    num_heads, num_kv_heads, head_dim = heads
    qkv = randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype, seed=seed)
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    positions = torch.randint(0, max_positions, (num_tokens,), generator=g, device=DEVICE)
    positions[0] = max_positions - 1
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, device=DEVICE).float() / head_dim)
    cache = reference.rotary_cos_sin_cache(inv_freq, 1.0, max_positions)
    return qkv, positions, cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "h{}-kv{}-d{}".format(*h))
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_rotary_in_place_on_merged_qkv(num_tokens, heads, dtype):
    num_heads, num_kv_heads, _ = heads
    qkv, positions, cache = rotary_inputs(num_tokens, heads, dtype)
    before = qkv.clone()
    q, k = qkv[:, :num_heads], qkv[:, num_heads:num_heads + num_kv_heads]
    want_q, want_k = reference.rotary_embedding(q.float(), k.float(), positions, cache)
    fused_rotary.rotary_(q, k, positions, cache)
    assert_close(q, want_q, dtype)
    assert_close(k, want_k, dtype)
    assert torch.equal(qkv[:, num_heads + num_kv_heads:], before[:, num_heads + num_kv_heads:])  # v


def test_rotary_clamps_positions_past_the_cache():
    """Only CUDA-graph padding rows run past the cache; they must read inside it."""
    qkv, positions, cache = rotary_inputs(4, (4, 2, 16), F32, max_positions=32)
    positions = torch.tensor([0, 31, 32, 500], device=DEVICE)
    q, k = qkv[:, :4], qkv[:, 4:6]
    want_q, want_k = reference.rotary_embedding(q, k, positions.clamp(max=31), cache)
    fused_rotary.rotary_(q, k, positions, cache)
    assert_close(q, want_q, F32)
    assert_close(k, want_k, F32)


def scattered_slots(num_tokens: int, num_slots: int, seed: int) -> torch.Tensor:
    """Distinct random cache slots, a quarter of them -1 (padding rows)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    slots = torch.randperm(num_slots, generator=g, device=DEVICE)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=g, device=DEVICE)[: num_tokens // 4]] = -1
    return slots


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "h{}-kv{}-d{}".format(*h))
def test_rotary_store_kv_matches_reference_and_skips_padding(heads, dtype):
    """q rotated in place; rotated k and v at their slots, -1 rows and every other slot
    untouched (the caches start as NaN); k itself left as it was."""
    num_heads, num_kv_heads, head_dim = heads
    num_tokens, block_size, num_blocks = (1000, 16, 4096) if CUDA else (40, 16, 64)
    qkv, positions, cache = rotary_inputs(num_tokens, heads, dtype, seed=9)
    q = qkv[:, :num_heads]
    k, v = qkv[:, num_heads:num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads:]
    slots = scattered_slots(num_tokens, num_blocks * block_size, seed=10)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    want_k_cache, want_v_cache = k_cache.float(), v_cache.float()
    want_q = reference.rotary_store_kv(q.float(), k.float(), v.float(), positions, cache,
                                       want_k_cache, want_v_cache, slots)
    k_before = k.clone()
    assert fused_rotary.rotary_store_kv(q, k, v, positions, cache, k_cache, v_cache, slots) is q
    assert_close(q, want_q, dtype)
    assert torch.equal(k, k_before)
    stored = slots[slots >= 0]
    k_rows, v_rows = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    assert_close(k_rows[stored], want_k_cache.view(-1, num_kv_heads, head_dim)[stored], dtype)
    assert torch.equal(v_rows[stored], v[slots >= 0])
    untouched = torch.ones(k_rows.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[stored] = False
    assert k_rows[untouched].isnan().all() and v_rows[untouched].isnan().all()


FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("heads", HEADS[:2], ids=lambda h: "h{}-kv{}-d{}".format(*h))
def test_rotary_store_kv_into_a_float8_cache(heads):
    """``--kv-cache-dtype fp8``: the rotated key, rounded once from fp32, and the value go
    to their slots over the layer's scales, saturated at ±448 and rounded to nearest, as
    torch's division and cast do: the
    reference's values (on a GPU a fused multiply-add may move a rare key by one step, and
    +0 may stand for −0)."""
    num_heads, num_kv_heads, head_dim = heads
    num_tokens, block_size, num_blocks = (1000, 16, 4096) if CUDA else (40, 16, 64)
    qkv, positions, cache = rotary_inputs(num_tokens, heads, F32, seed=11)
    qkv *= torch.logspace(-3, 3, qkv.shape[-1], device=DEVICE)  # from subnormals to past 448
    q = qkv[:, :num_heads]
    k, v = qkv[:, num_heads:num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads:]
    slots = scattered_slots(num_tokens, num_blocks * block_size, seed=12)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (torch.full(shape, float("nan"), device=DEVICE).to(FP8) for _ in range(2))
    want_k, want_v = k_cache.clone(), v_cache.clone()
    k_scale, v_scale = 0.5, 2.0  # (the layer's)
    want_q = reference.rotary_store_kv(q.clone(), k.clone(), v, positions, cache, want_k, want_v, slots,
                                       k_scale, v_scale)
    fused_rotary.rotary_store_kv(q, k, v, positions, cache, k_cache, v_cache, slots, k_scale, v_scale)
    assert_close(q, want_q, F32)
    got_v, want_v = v_cache.float(), want_v.float()
    assert torch.equal(got_v.isnan(), want_v.isnan()) and torch.equal(got_v.nan_to_num(), want_v.nan_to_num())
    assert got_v.nan_to_num().abs().max() == 448  # saturated, not NaN
    assert torch.equal(k_cache.float().isnan(), want_k.float().isnan())  # the same slots written
    got_k, want_k = k_cache.float().nan_to_num(), want_k.float().nan_to_num()
    differ = got_k != want_k
    if CUDA:
        assert differ.float().mean() < 1e-3
        step = torch.maximum(want_k.abs() / 8, torch.full_like(want_k, 2.0 ** -9))  # one e4m3 step
        assert ((got_k - want_k).abs()[differ] <= step[differ]).all()
    else:
        assert not differ.any()


def test_model_logits_through_a_float8_kv_cache(tiny_model_dir):
    """The fused path storing float8 K/V over calibrated per-layer scales gives the torch
    reference path's logits on the same float8 cache (within 1e-4 in fp32). They differ
    from the fp32 cache's by the float8 rounding of K and V only: less than with scales
    of 1, since the model's K and V are made small here (the same model, most of
    its K and V below e4m3's normal range, 2⁻⁶, as in the default model's first layer)."""
    files = ModelFiles("tiny", tiny_model_dir("llama"))
    config = load_hf_config(files)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (23, 1, 9, 14)]
    calibration = torch.randint(3, 512, (40,), generator=g).tolist()
    logits = {}
    for name, backend in (("torch", TorchAttentionBackend(cpu_kernels=False)), ("triton", get_backend("triton", DEVICE))):
        model = build_model(files, config, torch.float32, DEVICE, backend)
        with torch.no_grad():  # the same model, exactly, with K and V 64 times smaller
            for layer in model.model.layers:
                attn = layer.self_attn
                attn.qkv_proj.weight[:attn.q_size] *= 64
                attn.qkv_proj.weight[attn.q_size:] /= 64
                attn.o_proj.weight *= 64
        logits[name] = chunked_prefill_logits(model, prompts, 5, DEVICE, FP8, calibrate=calibration)
        scales = [layer.self_attn.kv_scales for layer in model.model.layers]
        assert all(0 < s < 0.01 for pair in scales for s in pair), scales  # K/V well below 448 here
    unscaled = chunked_prefill_logits(model, prompts, 5, DEVICE, FP8)
    full = chunked_prefill_logits(model, prompts, 5, DEVICE)
    assert (logits["triton"] - logits["torch"]).abs().max().item() < 1e-4
    drift = (logits["triton"] - full).abs().mean().item()
    assert 1e-5 < drift < 0.75 * (unscaled - full).abs().mean().item(), drift  # (about half, measured)


def test_rotary_rejects_bad_shapes():
    qkv, positions, cache = rotary_inputs(3, (4, 2, 16), F32)
    with pytest.raises(ValueError, match="do not match"):
        fused_rotary.rotary_(qkv[:, :4], qkv[:, 4:6, :8], positions, cache)
    with pytest.raises(ValueError, match="do not match"):
        fused_rotary.rotary_(qkv[:, :4], qkv[:, 4:6], positions, cache[:, :8])
    with pytest.raises(ValueError, match="contiguous"):
        fused_rotary.rotary_(randn(3, 16, 4).transpose(1, 2), qkv[:, 4:6], positions, cache)


# ---------------------------------------------------------------------------- CUDA graphs
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_kernels_replay_in_a_cuda_graph():
    """Captured once, replayed on new inputs written into the same buffers."""
    x, residual, weight = randn(8, 576, dtype=BF16), randn(8, 576, dtype=BF16, seed=1), randn(576, dtype=BF16)
    qkv, positions, cache = rotary_inputs(8, (9, 3, 64), BF16)
    k_cache = torch.zeros(16, 16, 3, 64, dtype=BF16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(8, device=DEVICE) * 3

    def step():
        normed, new_residual = fused_norm.add_rms_norm(x, residual, weight, 1e-5)
        act = fused_act.silu_and_mul(torch.cat((normed, new_residual), dim=-1))
        q = fused_rotary.rotary_store_kv(qkv[:, :9], qkv[:, 9:12], qkv[:, 12:], positions, cache,
                                         k_cache, v_cache, slots)
        return act, q

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        act, q = step()
    x.copy_(randn(8, 576, dtype=BF16, seed=11))
    fresh = randn(8, 15, 64, dtype=BF16, seed=12)
    qkv.copy_(fresh)
    positions.copy_(torch.arange(8, device=DEVICE) + 100)
    graph.replay()
    normed, new_residual = reference.add_rms_norm(x, residual, weight, 1e-5)
    assert_close(act, reference.silu_and_mul(torch.cat((normed, new_residual), dim=-1).float()), BF16)
    want_q, want_k = reference.rotary_embedding(fresh[:, :9].float(), fresh[:, 9:12].float(), positions, cache)
    assert_close(q, want_q, BF16)
    assert_close(k_cache.view(-1, 3, 64)[slots], want_k, BF16)


# Compiles (does not run) each kernel for Hopper in a fresh process without the
# interpreter, as test_triton_kernels.py does for the attention kernels.
COMPILE_FOR_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from specserve.kernels import fused_act, fused_norm, fused_rotary

def compile(fn, pointers, constants, num_warps, i64=()):
    signature = {name: "constexpr" if name in constants else pointers.get(name, "i64" if name in i64 else "i32")
                 for name in fn.arg_names}
    constexprs = {(fn.arg_names.index(name),): value for name, value in constants.items()}
    triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                   target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))

for dtype in ("bf16", "fp16", "fp32"):
    for hidden, add in ((576, True), (4096, False), (64, True)):
        block = triton.next_power_of_2(hidden)
        for fp8_group in (0, block, 128):  # as it is; to float8 per row, in groups
            out = "*fp8e4nv" if fp8_group else "*" + dtype
            compile(fused_norm._rms_norm_kernel, dict(out_ptr=out, new_residual_ptr="*" + dtype,
                    x_ptr="*" + dtype, residual_ptr="*" + dtype, weight_ptr="*" + dtype, eps="fp32",
                    scales_ptr="*fp32" if fp8_group else out),
                    dict(HIDDEN=hidden, BLOCK=block, ADD_RESIDUAL=add, FP8_GROUP=min(fp8_group, block),
                         SLICE=min(block, 1024) if fp8_group else block),
                    num_warps=min(max(block // 256, 1), 8))
    for block, fp8_group, warps in ((1024, 0, 4), (1024, 128, 4), (16384, 16384, 16)):
        out = "*fp8e4nv" if fp8_group else "*" + dtype
        compile(fused_act._silu_and_mul_kernel, dict(out_ptr=out, gate_up_ptr="*" + dtype,
                scales_ptr="*fp32" if fp8_group else out), dict(BLOCK=block, FP8_GROUP=fp8_group, ROW_PARTS=False),
                num_warps=warps)
    # float8 per row over a row's blocks: the values and their maxima, then the rounding
    compile(fused_act._silu_and_mul_kernel, dict(out_ptr="*" + dtype, gate_up_ptr="*" + dtype, scales_ptr="*fp32"),
            dict(BLOCK=1024, FP8_GROUP=0, ROW_PARTS=True), num_warps=4)
    compile(fused_act._round_row_parts_kernel, dict(out_ptr="*fp8e4nv", scales_ptr="*fp32", values_ptr="*" + dtype,
            parts_ptr="*fp32"), dict(BLOCK=1024, PARTS=16), num_warps=4)
    for heads, kv_heads, half, store, fp8 in ((9, 3, 32, True, False), (32, 8, 64, False, False),
                                              (5, 1, 40, True, False), (32, 8, 64, True, True)):
        block_half = triton.next_power_of_2(half)
        cache = "*fp8e4nv" if fp8 else "*" + dtype
        compile(fused_rotary._rotary_kernel, dict(
                q_ptr="*" + dtype, k_ptr="*" + dtype, v_ptr="*" + dtype, positions_ptr="*i64",
                cos_sin_ptr="*fp32", k_cache_ptr=cache, v_cache_ptr=cache, slot_mapping_ptr="*i64",
                k_scale="fp32", v_scale="fp32"),
                dict(NUM_HEADS=heads, NUM_KV_HEADS=kv_heads, HALF=half,
                     BLOCK_H=triton.next_power_of_2(heads), BLOCK_KV=triton.next_power_of_2(kv_heads),
                     BLOCK_HALF=block_half, BLOCK_SIZE=16, STORE_KV=store, KV_FP8=fp8),
                num_warps=4, i64=("stride_kcb", "stride_vcb"))
print("compiled")
"""


@pytest.mark.skipif(CUDA, reason="with a GPU every test above compiles the kernels for real")
def test_kernels_compile_for_hopper():
    compiles_for_sm90(COMPILE_FOR_SM90)


# ---------------------------------------------------------------------------- the model
def test_layer_ops_follow_the_backend(tiny_model_dir):
    path = tiny_model_dir("llama")
    files = ModelFiles("tiny", path)
    config = load_hf_config(files)
    on_cpu_kernels = DEVICE.type == "cpu" and cpu_ops.available()  # the torch backend's glue in C++
    for name, ops_type in (("torch", CpuLayerOps if on_cpu_kernels else TorchLayerOps), ("triton", TritonLayerOps)):
        model = build_model(files, config, torch.float32, DEVICE, get_backend(name, DEVICE))
        layer = model.model.layers[0]
        assert type(model.model.ops) is ops_type
        assert layer.mlp.ops is layer.input_layernorm.ops is layer.self_attn.ops is model.model.ops
        cache = model.model.rotary.cos_sin_cache
        assert (cache is not None and cache.shape == (512, 16)) == (name == "triton")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_model_logits_triton_equal_torch(tiny_model_dir, variant):
    """Every architecture variant (qk-norm, llama3 rope scaling, bias, window, tied GQA)
    through the fused path: the torch path's logits within 1e-4 in fp32."""
    files = ModelFiles("tiny", tiny_model_dir(variant))
    config = load_hf_config(files)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (23, 1, 9, 14)]
    logits = {}
    for name in ("torch", "triton"):
        model = build_model(files, config, torch.float32, DEVICE, get_backend(name, DEVICE))
        logits[name] = chunked_prefill_logits(model, prompts, chunk=5, device=DEVICE)
    assert (logits["triton"] - logits["torch"]).abs().max().item() < 1e-4, variant


GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
ENGINE = dict(max_num_batched_tokens=24, max_num_seqs=4, block_size=16, num_kv_blocks=32,
              speculative_method="ngram", num_speculative_tokens=3)


@pytest.mark.parametrize("variant", ["smollm2_tied_gqa3", "qwen3_qknorm", "llama3_rope"])
def test_engine_greedy_tokens_equal_torch_backend(tiny_model_dir, variant):
    """Prefill chunks, decode and verify steps through the fused kernels: the same greedy
    tokens as the torch backend in fp32."""
    prompts = [[5, 9, 11, 5, 9, 11, 5, 9], list(range(3, 40)), [7]]
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM32(str(tiny_model_dir(variant)), attention_backend=backend, **ENGINE)
        outputs[backend] = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert outputs["triton"] == outputs["torch"]


def test_padded_graph_path_with_fused_kernels(tiny_model_dir):
    """The CUDA-graph path's padding (run eagerly, so also on CPU) through the fused
    rotary + KV store: padding rows (slot -1, positions past their request's) change
    nothing, the tokens are the torch backend's. Unwritten cache slots hold a large stale
    value (not NaN: the attention kernel's p·V would turn a masked NaN into NaN)."""
    kwargs = dict(block_size=4, num_kv_blocks=64, max_num_seqs=4, speculative_method="ngram",
                  num_speculative_tokens=3, speculative_adaptive=False)  # drafts every step
    prompts = ["a b a b a b a b", "x = 1\ny = 2\nx = 1\n", "hello"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM32(str(tiny_model_dir("llama")), attention_backend="triton", enforce_eager=True, **kwargs)
    runner = llm.engine.runner
    runner.enable_graphs(4, llm.engine.max_model_len, capture=False)
    calls = []
    run = runner.graphs.run
    runner.graphs.run = lambda *a: calls.append(len(a[0].scheduled)) or run(*a)
    for k, v in runner.kv_caches:
        k.fill_(1e4)
        v.fill_(1e4)
    got = llm.generate(prompts, params, use_tqdm=False)
    want = LLM32(str(tiny_model_dir("llama")), attention_backend="torch", **kwargs).generate(
        prompts, params, use_tqdm=False)
    assert calls and llm.engine.spec_stats.num_drafts > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_draft_model_on_the_padded_graph_path_with_fused_kernels(tiny_model_dir):
    """The GPU path of a draft model (fused kernels; catch-up and draft steps through the
    padded graph inputs, proposals scattered in on the device) gives the torch
    backend's greedy tokens."""
    target = str(tiny_model_dir("llama"))
    kwargs = dict(block_size=4, num_kv_blocks=64, max_num_seqs=4, speculative_method="draft_model",
                  draft_model=target, num_speculative_tokens=3)
    prompts = ["a b a b a b a b", "x = 1\ny = 2\nx = 1\n", "hello"]
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, num_speculative_tokens=k)
              for k in (3, 1, 3)]
    llm = LLM32(target, attention_backend="triton", enforce_eager=True, **kwargs)
    llm.engine.enable_graphs(capture=False)
    calls = []
    run = llm.engine.speculator.drafter.runner.graphs.run
    llm.engine.speculator.drafter.runner.graphs.run = lambda *a: calls.append(len(a[0].scheduled)) or run(*a)
    got = llm.generate(prompts, params, use_tqdm=False)
    want = LLM32(target, attention_backend="torch", **kwargs).generate(prompts, params, use_tqdm=False)
    assert calls and llm.engine.spec_stats.acceptance_rate == 1.0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


# ---------------------------------------------------------------------- mixture of experts
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_grouped_moe_gemms_equal_the_experts_one_by_one(dtype):
    """The two grouped launches (pairs sorted by expert, padded blocks) against each
    token's k experts computed one by one in fp32, weighted and summed; every pair is in
    exactly one padded row, and every block holds one expert's pairs."""
    from specserve.kernels import fused_moe

    tokens, num_experts, top_k, hidden, inter = (37, 64, 8, 256, 128) if CUDA else (9, 6, 2, 32, 48)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g).to(DEVICE, dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden ** -0.5).to(DEVICE, dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=g) * inter ** -0.5).to(DEVICE, dtype)
    probs = torch.randn(tokens, num_experts, generator=g).softmax(-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    weights, experts = weights.to(DEVICE, dtype), experts.to(DEVICE)
    rows, block_expert = fused_moe.align(experts, num_experts)
    used = rows[rows < tokens * top_k]
    assert sorted(used.tolist()) == list(range(tokens * top_k))
    flat = experts.flatten().cpu()
    for b, e in enumerate(block_expert.tolist()):
        block = [r for r in rows[b * fused_moe.BLOCK_M:(b + 1) * fused_moe.BLOCK_M].tolist() if r < tokens * top_k]
        assert all(flat[r] == e for r in block) and (e < num_experts or not block)
    got = fused_moe.moe_forward(x, w13, w2, weights, experts, fused_act.silu_and_mul).float()
    want = torch.zeros(tokens, hidden)
    for t in range(tokens):
        for j in range(top_k):
            e = int(experts[t, j])
            gate, up = (x[t].float().cpu() @ w13[e].float().cpu().T).chunk(2)
            want[t] += float(weights[t, j]) * ((torch.nn.functional.silu(gate) * up) @ w2[e].float().cpu().T)
    tol = 1e-4 if dtype == F32 else 3e-2
    assert (got.cpu() - want).abs().max().item() < tol * max(1.0, want.abs().max().item())
