"""Quantized checkpoints (FP8, AWQ, GPTQ) run as stored: each layout, written as its
library writes it (``tiny_models.write_quantized_checkpoint``), loads to exactly its
dequantised values; its layers compute what dequantise-then-matmul does (with the
scheme's activation quantization); the engine decodes with it; what cannot run is
refused by name. The Triton GEMMs run under the interpreter on a CPU and compiled on
CUDA, where every layout also runs through the engine.
"""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from specserve import LLM, SamplingParams
from specserve.attention import TorchAttentionBackend
from specserve.errors import ModelLoadError
from specserve.kernels import cpu_ops, fused_act, quant_matmul
from specserve.loader import ModelFiles, _iter_checkpoint, build_model, load_hf_config, quant_scheme
from specserve.models.checkpoint_quant import (FP8, Fp8Linear, Fp8Weight, Int4Linear, Int4Weight, parse_scheme,
                                               quantize_fp8, quantize_int4)
from specserve.models.layer_ops import TritonLayerOps
from specserve.models.llama import RMSNorm
from specserve.models.quantized import QuantLinear
from test_model import ragged_logits
from tiny_models import QUANT_LAYOUTS, QUANTIZED_PROJECTIONS, write_quantized_checkpoint

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
CPU = torch.device("cpu")
INT4 = ("awq", "gptq", "gptq_v2_asym", "gptq_act_order")
# What runs on a CPU: FP8 with a scale per row (torch._scaled_mm), 4-bit through the GGUF kernels.
ON_CPU = ("fp8_tensor_static", "fbgemm_fp8", "ct_fp8_dynamic", "ct_fp8_static", "awq", "gptq", "gptq_v2_asym")
needs_cpu_kernels = pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU kernels did not build")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_model_dir):
    """layout -> (model dir, transformers model on the dequantised weights), made once."""
    made = {}

    def get(layout: str):
        if layout not in made:
            path = tmp_path_factory.mktemp(layout)
            made[layout] = (path, write_quantized_checkpoint(tiny_model_dir("llama"), path, layout))
        return made[layout]

    return get


def gathered(path) -> dict:
    files = ModelFiles("q", path)
    return dict(_iter_checkpoint(files, scheme=quant_scheme(load_hf_config(files), "q")))


# ---------------------------------------------------------------------------- layouts
@pytest.mark.parametrize("layout", sorted(QUANT_LAYOUTS))
def test_every_layout_loads_to_exactly_its_dequantised_values(layout, checkpoints):
    """Each quantized projection comes out as one weight whose values are exactly the
    writer's (q − z) · s or float8 · scale: AWQ's interleaved nibbles, GPTQ's z − 1 and
    act-order groups, per-tensor, per-row and block scales all read as written."""
    path, reference = checkpoints(layout)
    weights = gathered(path)
    quantized = {name: w for name, w in weights.items() if isinstance(w, (Fp8Weight, Int4Weight))}
    assert len(quantized) == 7 * reference.config.num_hidden_layers
    for name, weight in quantized.items():
        assert torch.equal(weight.dequantize(), reference.get_parameter(name).detach()), name
    assert {type(w) for w in quantized.values()} == {Int4Weight if layout in INT4 else Fp8Weight}
    assert torch.equal(weights["model.norm.weight"], reference.model.norm.weight.detach())


def test_the_schemes_read_what_each_config_says():
    block = parse_scheme(QUANT_LAYOUTS["fp8_block"], "m")
    assert (block.kind, block.block, block.activations) == ("fp8", (32, 32), "group")
    assert parse_scheme(QUANT_LAYOUTS["ct_fp8_dynamic"], "m").activations == "token"
    assert parse_scheme(QUANT_LAYOUTS["ct_fp8_static"], "m").activations == "static"
    assert parse_scheme(QUANT_LAYOUTS["ct_fp8_w8a16"], "m").activations is None
    assert parse_scheme(QUANT_LAYOUTS["gptq"], "m").gptq_v1 and not parse_scheme(QUANT_LAYOUTS["gptq_v2_asym"], "m").gptq_v1
    assert parse_scheme({**QUANT_LAYOUTS["gptq"], "group_size": -1}, "m").group == 0  # one group: all of K
    assert parse_scheme(None, "m") is None
    for extra, why in (({"kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "a quantized KV cache"),
                       ({"sparsity_config": {"format": "sparse-24"}}, "sparse weights")):
        with pytest.raises(ModelLoadError, match=f"does not run \\({why}"):
            parse_scheme({**QUANT_LAYOUTS["ct_fp8_dynamic"], **extra}, "m")
    scheme = parse_scheme(QUANT_LAYOUTS["awq"], "m")
    assert "tensor parallelism" in scheme.refusal(CPU, 2, False)
    assert scheme.refusal(CPU, 1, False) is None
    assert "CUDA" in parse_scheme(QUANT_LAYOUTS["fp8_block"], "m").refusal(CPU, 1, False)
    assert "deterministic" in parse_scheme(QUANT_LAYOUTS["ct_fp8_dynamic"], "m").refusal(CPU, 1, True)


def edit(path, change) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"))


@pytest.mark.parametrize("layout, change, message", [
    ("ct_fp8_dynamic", lambda t: t.pop("model.layers.0.self_attn.q_proj.weight_scale"),
     "'model.layers.0.self_attn.q_proj.weight' is float8_e4m3fn, outside the scheme's layers"),
    ("ct_fp8_dynamic", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
     "'model.layers.1.mlp.up_proj.weight_scale' comes without 'model.layers.1.mlp.up_proj.weight'"),
    ("ct_fp8_dynamic", lambda t: t.update({"model.layers.0.mlp.down_proj.weight_scale": torch.ones(3, 1)}),
     "'model.layers.0.mlp.down_proj.weight_scale' of shape \\(3, 1\\) does not scale"),
    ("ct_fp8_dynamic", lambda t: t.update({"model.layers.0.mlp.down_proj.input_scale": torch.ones(1)}),
     "unexpected tensor 'model.layers.0.mlp.down_proj.input_scale'"),
    ("fp8_tensor_static", lambda t: t.pop("model.layers.0.self_attn.o_proj.input_scale"),
     "without one 'model.layers.0.self_attn.o_proj.input_scale'"),
    ("fp8_block", lambda t: t.update({"model.layers.0.self_attn.o_proj.weight_scale_inv": torch.ones(2, 1)}),
     "weight_scale_inv' of shape \\(2, 1\\) does not scale \\(64, 64\\) by blocks of \\(32, 32\\)"),
    ("awq", lambda t: t.pop("model.layers.0.mlp.gate_proj.qzeros"),
     "'model.layers.0.mlp.gate_proj.qweight' comes without 'model.layers.0.mlp.gate_proj.qzeros'"),
    ("awq", lambda t: t.pop("model.layers.0.mlp.gate_proj.qweight"),
     "'model.layers.0.mlp.gate_proj.qzeros' comes without 'model.layers.0.mlp.gate_proj.qweight'"),
    ("awq", lambda t: t.update({"model.layers.0.mlp.gate_proj.scales": torch.ones(3, 128)}),
     "scales \\(3, 128\\) / qzeros \\(2, 16\\) do not fit 2 groups of 32 inputs"),
    ("gptq_act_order", lambda t: t.update({"model.layers.0.mlp.up_proj.g_idx": torch.zeros(64, dtype=torch.int32)}),
     "'model.layers.0.mlp.up_proj.g_idx': groups of other than 32 inputs"),
    ("gptq", lambda t: t.update({"model.layers.0.mlp.up_proj.qweight": torch.zeros(8, 128, dtype=torch.int64)}),
     "tensor 'model.layers.0.mlp.up_proj.qweight' is int64"),
    ("gptq", lambda t: t.update({"model.extra": torch.zeros(8, dtype=torch.int32)}),
     "tensor 'model.extra' is int32, outside the scheme's layers"),
])
def test_a_broken_layout_is_refused_by_name(layout, change, message, checkpoints, tmp_path):
    import shutil

    path = tmp_path / "broken"
    shutil.copytree(checkpoints(layout)[0], path)
    edit(path, change)
    with pytest.raises(ModelLoadError, match=message):
        gathered(path)


def test_parts_of_one_projection_in_different_orders_are_refused(checkpoints, tmp_path):
    """GPTQ's act-order quantizes q, k and v (which share an input) in one input order; a
    checkpoint whose parts differ cannot run as one merged projection, and says so."""
    import shutil

    path = tmp_path / "orders"
    shutil.copytree(checkpoints("gptq")[0], path)
    name = "model.layers.0.self_attn.k_proj.g_idx"  # k alone in another (valid) order
    edit(path, lambda t: t.update({name: t[name].flip(0).contiguous()}))
    with pytest.raises(ModelLoadError, match="parts of one projection quantized in different group orders"):
        load(path, CPU, torch.float32)


def test_a_quantized_projection_stored_merged_is_refused(tiny_model_dir, tmp_path, monkeypatch):
    """Phi-3's q/k/v stored as one tensor, in 4-bit: refused in one line, not loaded."""
    import tiny_models

    monkeypatch.setattr(tiny_models, "QUANTIZED_PROJECTIONS", ("qkv_proj",))
    write_quantized_checkpoint(tiny_model_dir("phi3_longrope"), tmp_path / "phi3", "awq")
    with pytest.raises(ModelLoadError, match="'model.layers.0.self_attn.qkv_proj.weight': a projection stored "
                                             "merged runs from float weights only"):
        load(tmp_path / "phi3", CPU, torch.float32)


@pytest.mark.parametrize("layout, message", [
    ("fp8_block", "block-wise and weight-only FP8 run on CUDA GPUs"),
    ("ct_fp8_w8a16", "block-wise and weight-only FP8 run on CUDA GPUs"),
    ("gptq_act_order", "act-order GPTQ weights run on CUDA GPUs, not the CPU"),
])
def test_what_does_not_run_on_a_cpu_is_refused(layout, message, checkpoints):
    path, _ = checkpoints(layout)
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(path), device="cpu", dtype="float32")


# ---------------------------------------------------------------------------- layers
def unpack_int4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """int32 ``[N, 16 · ⌈K / 128⌉]`` -> 0…15 ``[N, K]``: input 128t + 16j + c from nibble j
    of word 16t + c."""
    n = packed.shape[0]
    nibbles = (packed.cpu().view(n, -1, 16, 1) >> torch.arange(0, 32, 4, dtype=torch.int32)) & 0xF  # [n, t, c, j]
    return nibbles.transpose(2, 3).reshape(n, -1)[:, :k]


def fp8_round(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x quantized to float8 with ``scale`` (fp32 arithmetic, saturating), as a value."""
    return (x.float() / scale).clamp(-448, 448).to(FP8).double() * scale.double()


def fp8_round_rows(x: torch.Tensor, group: int) -> torch.Tensor:
    """x quantized to float8 per row and group of ``group`` inputs (``group`` ≥ K: per row),
    each scaled so its largest magnitude is 448, as values."""
    return torch.cat([fp8_round(p, (p.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12))
                      for p in x.split(group, dim=-1)], dim=-1)


def reference_linear(layer, x: torch.Tensor) -> torch.Tensor:
    """Dequantise-then-matmul in fp64, with the scheme's activation quantization written
    out: per token (and per group of the block's width), or with each part's static scale."""
    x = x.float().cpu()
    if isinstance(layer, Fp8Linear):
        w = Fp8Weight(layer.weight.cpu(), layer.weight_scale.cpu(), layer.block).dequantize().double()
        mode, k = layer.activations, layer.in_features
        if mode == "static":
            outs, row = [], 0
            for rows, s in layer.segments:
                outs.append(fp8_round(x, torch.tensor(s)) @ w[row:row + rows].T)
                row += rows
            y = torch.cat(outs, dim=1)
        elif mode is None:
            y = x.double() @ w.T
        else:
            y = fp8_round_rows(x, k if mode == "token" else layer.block[1]) @ w.T
    else:
        w = Int4Weight(unpack_int4(layer.packed, layer.in_features), layer.scales.cpu(), layer.zeros.cpu(), layer.group).dequantize()
        if layer.perm is not None:
            x = x[:, layer.perm.cpu()]
        y = x.double() @ w.double().T
    return y if layer.bias is None else y + layer.bias.cpu().double()


def load(path, device: torch.device, dtype: torch.dtype):
    files = ModelFiles("q", path)
    return build_model(files, load_hf_config(files), dtype, device, TorchAttentionBackend(cpu_kernels=True)
                       if device.type == "cpu" else _gpu_backend(device))


def _gpu_backend(device):
    from specserve.attention import get_backend

    return get_backend("triton", device)


RUNS = sorted(QUANT_LAYOUTS) if CUDA else [layout for layout in ON_CPU]


@pytest.mark.parametrize("layout", RUNS)
def test_each_layer_computes_dequantise_then_matmul(layout, checkpoints):
    """Every quantized layer of the loaded model (q/k/v and gate/up merged from their
    parts) against its fp64 reference, for 1, 5 and 17 rows: FP8 within fp32 summation
    (its activation rounding is the reference's own); 4-bit on the CPU within the GGUF
    kernels' int16 activations; the same in bf16 (CPU: FP8 held widened, exactly, for
    oneDNN's bf16 GEMM)."""
    path, reference = checkpoints(layout)
    for dtype in (torch.float32, torch.bfloat16):  # (CPU bf16: FP8 through oneDNN's bf16 GEMM)
        model = load(path, DEVICE, dtype)
        layers = {name: m for name, m in model.named_modules() if isinstance(m, (Fp8Linear, Int4Linear, QuantLinear))}
        assert len(layers) == 4 * model.config.num_hidden_layers
        expected = QuantLinear if layout in INT4 and not CUDA else Int4Linear if layout in INT4 else Fp8Linear
        assert all(isinstance(layer, expected) for layer in layers.values())
        # float8 tensor-core products on CUDA (prefill-sized row counts) add up in fewer
        # than fp32's bits; CPU's int16 activations for 4-bit.
        tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-3 if expected is QuantLinear or CUDA else 1e-5
        g = torch.Generator().manual_seed(0)
        for name, layer in layers.items():
            for rows in (1, 5, 17):
                x = torch.randn(rows, layer.in_features, generator=g)
                got = layer(x.to(DEVICE, dtype)).double().cpu()
                if expected is QuantLinear:  # the GGUF kernels' own layout: against the writer's weights
                    want = x.to(dtype).double() @ reference_weight(reference, name).T
                else:
                    want = reference_linear(layer, x.to(dtype))
                err = (got - want).abs().max().item() / want.abs().max().item()
                assert err <= tolerance, (name, rows, err)


MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def reference_weight(reference, name: str) -> torch.Tensor:
    """Our layer ``name``'s weight in the transformers model on the dequantised weights
    (a merged projection: its parts stacked)."""
    prefix, last = name.rsplit(".", 1)
    return torch.cat([reference.get_parameter(f"{prefix}.{part}.weight").detach()
                      for part in MERGED.get(last, (last,))]).double()


# bf16 outputs (and the W4A16 tile) round once on CUDA; the interpreter's bf16 casts may
# truncate instead, up to an ulp more.
BF16_TOLERANCE = 1e-2 if CUDA else 3e-2
SHAPES = [(4096, 4096), (6144, 4096), (4096, 14336), (200, 1000 + 24)] if CUDA else [(40, 192), (64, 96), (24, 256)]
FP8_CASES = [  # (weight block, activations)
    ((32, 64), "group"), ((128, 128), "group"), ((1, None), "token"), ((1, None), None), ((64, 64), None)]


class Launches:
    """Counts a Triton kernel's launches (``kernel[grid](...)``)."""

    def __init__(self, kernel):
        self.kernel, self.count = kernel, 0

    def __getitem__(self, grid):
        self.count += 1
        return self.kernel[grid]


def split_tiles(block_k: int, sum_in_launch: bool = False):
    """Tiles that split K among 2 to 3 programs at the tests' shapes (CPU and CUDA), their
    partial sums added by a second launch or in the launch."""
    from specserve.kernels.quant_matmul import Tiles

    return Tiles(block_m=16, block_n=32, block_k=block_k, split=3, num_warps=4, num_stages=2,
                 sum_in_launch=sum_in_launch)


@pytest.mark.parametrize("block, activations", FP8_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", [False, True], ids=["planned", "split"])
def test_the_fp8_gemm_computes_its_reference(block, activations, dtype, split, monkeypatch):
    """The Triton FP8 GEMM (interpreted on a CPU) against dequantise-then-matmul in fp64:
    block or per-row weight scales, float8 inputs per token or per token and group, or
    inputs as they are; tails in N and K, 1 to 33 rows, with and without a bias; with the
    tiles planned for the shape and rows, and with K split among programs whose partial
    sums are added after. One row of W8A16 goes through the one-row kernel (no tensor cores),
    up to 16 rows of W8A8 through the kernel with the weights on the left. W8A8 inputs
    given in their float dtype (``quantize``; here with a leading dimension and strided
    rows) give the same outputs bit for bit, rounded to float8 by a launch of their own
    (``quantize_rows``)."""
    one_row = Launches(quant_matmul._fp8_row_kernel)
    left = Launches(quant_matmul._fp8_left_kernel)
    quantizer = Launches(quant_matmul._quantize_kernel)
    monkeypatch.setattr(quant_matmul, "_fp8_row_kernel", one_row)
    monkeypatch.setattr(quant_matmul, "_fp8_left_kernel", left)
    monkeypatch.setattr(quant_matmul, "_quantize_kernel", quantizer)
    g = torch.Generator().manual_seed(2)
    for n, k in SHAPES:
        if activations == "group" and k % block[1]:
            continue
        bk = block[1] or k
        weight = quantize_fp8(torch.randn(n, k, generator=g) * 0.05, (block[0], bk))
        for rows, bias in ((1, torch.randn(n, generator=g)), (5, torch.randn(n, generator=g)), (33, None)):
            x = torch.randn(rows, k, generator=g).to(dtype)
            if activations is None:
                xq, xs, act_group = x, None, k
            else:
                act_group = k if activations == "token" else bk
                xq, xs = _quantize_groups(x.float(), act_group)
            # split: K tiles of one input group each (32 for per-token inputs and W8A16)
            tiles = split_tiles(act_group if activations == "group" else 32) if split else None
            got = quant_matmul.fp8_linear(xq.to(DEVICE), None if xs is None else xs.to(DEVICE), act_group,
                                          weight.values.to(DEVICE), weight.scale.to(DEVICE), (block[0], bk),
                                          None if bias is None else bias.to(DEVICE, dtype), dtype, tiles=tiles)
            xd = x.double() if xs is None else (xq.double().view(rows, -1, act_group) * xs.double()[..., None]).view(rows, k)
            want = xd @ weight.dequantize().double().T + (0 if bias is None else bias.to(dtype).double())
            err = (got.double().cpu() - want).abs().max().item() / want.abs().max().item()
            fp32_tolerance = 1e-3 if CUDA and activations else 1e-5  # float8 tensor-core sums
            assert got.dtype == dtype and err <= (BF16_TOLERANCE if dtype == torch.bfloat16 else fp32_tolerance), \
                (n, k, rows, err)
            assert one_row.count == (rows == 1 and activations is None), rows  # W8A16 only
            assert left.count == (rows <= quant_matmul.FEW_ROWS and activations is not None), rows  # W8A8 only
            if activations is not None:
                left.count = 0
                given = x.to(DEVICE).t().contiguous().t()[None]  # [1, rows, K], its rows' inputs strided
                quantized = quant_matmul.fp8_linear(given, None, act_group, weight.values.to(DEVICE),
                                                    weight.scale.to(DEVICE), (block[0], bk),
                                                    None if bias is None else bias.to(DEVICE, dtype), dtype,
                                                    tiles=tiles, quantize=True)
                assert quantized.shape == (1, rows, n) and torch.equal(quantized[0], got), (n, k, rows)
                assert quantizer.count == 1 and left.count == (rows <= quant_matmul.FEW_ROWS), rows
            one_row.count = left.count = quantizer.count = 0


def _quantize_groups(x: torch.Tensor, group: int):
    rows, k = x.shape
    parts = x.view(rows, k // group, group)
    scale = (parts.abs().amax(-1) / 448).clamp(min=1e-12)
    return (parts / scale[..., None]).clamp(-448, 448).to(FP8).view(rows, k), scale


@pytest.mark.parametrize("group", [32, 128, 0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", [False, True], ids=["planned", "split"])
def test_the_int4_gemm_computes_its_reference(group, dtype, split, monkeypatch):
    """The Triton W4A16 GEMM against (q − z) · s rounded to the activations' dtype, then
    matmul in fp64; groups of 32, 128 or all of K (K tiles over several groups, or within
    one); tails in N; with the planned tiles and with K split among programs, the partial
    sums added in the launch on the layer's counters (where there are enough for the
    tiles). One row goes through the one-row kernel (no tensor cores), more through the
    tiled one."""
    one_row = Launches(quant_matmul._int4_row_kernel)
    monkeypatch.setattr(quant_matmul, "_int4_row_kernel", one_row)
    g = torch.Generator().manual_seed(3)
    for n, k in SHAPES:
        size = group or k
        if k % size:
            continue
        weight = quantize_int4(torch.randn(n, k, generator=g) * 0.05, size)
        packed = Int4Linear(weight, None).packed
        for rows, bias in ((1, torch.randn(n, generator=g)), (7, None), (33, None)):
            x = torch.randn(rows, k, generator=g).to(dtype)
            got = quant_matmul.int4_linear(x.to(DEVICE), packed.to(DEVICE), weight.scale.to(DEVICE),
                                           weight.zero.to(DEVICE), size,
                                           None if bias is None else bias.to(DEVICE, dtype),
                                           tiles=split_tiles(128, sum_in_launch=True) if split else None,
                                           counters=quant_matmul.tile_counters(n, DEVICE))
            want = x.double() @ weight.dequantize().to(dtype).double().T
            want = want + (0 if bias is None else bias.to(dtype).double())
            err = (got.double().cpu() - want).abs().max().item() / want.abs().max().item()
            assert got.dtype == dtype and err <= (BF16_TOLERANCE if dtype == torch.bfloat16 else 1e-5), (n, k, rows, err)
            assert one_row.count == (rows == 1), rows
            one_row.count = 0


def test_split_k_sums_are_the_same_in_one_launch_as_in_two(monkeypatch):
    """With K split among programs and the layer's tile counters given, the last of a
    tile's programs to finish adds the partial sums (``_finish``), in the order the second
    launch (``_sum_splits``) adds them: the same outputs bit for bit (in fp32, where a
    different order would show), through every kernel, with and without a bias, at one row
    and at a verify step's five; every counter is back at 0 after each launch."""
    g = torch.Generator().manual_seed(4)
    n, k = SHAPES[-1]
    fp8 = quantize_fp8(torch.randn(n, k, generator=g) * 0.05, (1, k))
    int4 = quantize_int4(torch.randn(n, k, generator=g) * 0.05, 32)
    packed = Int4Linear(int4, None).packed.to(DEVICE)
    counters = quant_matmul.tile_counters(n, DEVICE)
    sums = Launches(quant_matmul._sum_splits)
    monkeypatch.setattr(quant_matmul, "_sum_splits", sums)

    def outputs(in_launch: bool):
        g.manual_seed(5)
        got = []
        for rows, bias in ((1, torch.randn(n, generator=g)), (5, None), (5, torch.randn(n, generator=g))):
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(rows, k, generator=g).to(DEVICE, dtype)
                b = None if bias is None else bias.to(DEVICE, dtype)
                for quantize in (False, True):  # W8A16 (the row kernel at one row), W8A8 (the weights on the left)
                    got.append(quant_matmul.fp8_linear(x, None, k, fp8.values.to(DEVICE), fp8.scale.to(DEVICE),
                                                       (1, k), b, dtype, tiles=split_tiles(32, in_launch),
                                                       quantize=quantize, counters=counters))
                got.append(quant_matmul.int4_linear(x, packed, int4.scale.to(DEVICE), int4.zero.to(DEVICE), 32, b,
                                                    tiles=split_tiles(128, in_launch), counters=counters))
                assert not counters.any()
        return got

    one_launch = outputs(True)
    assert sums.count == 0
    two_launches = outputs(False)
    assert sums.count == len(two_launches)
    for a, b in zip(one_launch, two_launches, strict=True):
        assert torch.equal(a, b)
    # Without counters (or too few for the tiles) the splits go to a second launch.
    x = torch.randn(1, k, generator=g).to(DEVICE)
    quant_matmul.int4_linear(x, packed, int4.scale.to(DEVICE), int4.zero.to(DEVICE), 32, None,
                             tiles=split_tiles(128, True), counters=counters[:0])
    assert sums.count == len(two_launches) + 1
    # The plan sums in the launch where it measured faster on a GPU: 4-bit weights' K splits.
    cpu = torch.device("cpu")
    assert [quant_matmul.plan(True, kind, 128, 4096, 128, cpu)[3:7] for kind in ("w4a16_row", "w4a16", "w8a8")] == [
        (16, 4, 3, True), (8, 4, 2, True), (4, 4, 4, False)]
    # And where each launches with PDL, prefetching its first K tiles of weights (kernels/pdl.py).
    assert [quant_matmul.plan(few, kind, 128, 4096, 128, cpu)[7:] for few, kind in (
        (True, "w8a8"), (True, "w8a16"), (True, "w8a16_row"), (True, "w4a16_row"), (False, "w8a16"))] == [
        (True, 2), (False, 0), (True, 0), (True, 0), (True, 0)]
    assert not quant_matmul.plan(True, "w4a16_row", 128, 256, 128, cpu).sum_in_launch  # (K whole)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs and streams")
def test_split_k_sums_in_the_launch_in_graphs_and_beside_another_stream():
    """A 4-bit layer's graph, captured after its counters were made (at load), replays to
    its eager outputs time after time, leaving the counters at 0; and two layers running at
    once on two streams (a draft model's pass beside the target's) each sum their own
    tiles, since each holds its own counters."""
    g = torch.Generator().manual_seed(7)
    n, k = 4096, 4096
    layers = [Int4Linear(_to_device(quantize_int4(torch.randn(n, k, generator=g) * 0.05, 128)), None)
              for _ in range(2)]
    xs = [torch.randn(1, k, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2)]
    want = [layer(x) for layer, x in zip(layers, xs, strict=True)]
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        captured = layers[0](xs[0])
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(20):
        graph.replay()
        assert torch.equal(captured, want[0])
    assert not layers[0].tile_counters.any()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    for _ in range(50):
        with torch.cuda.stream(side):
            beside = [layers[1](xs[1]) for _ in range(4)]
        main = [layers[0](xs[0]) for _ in range(4)]
        torch.cuda.current_stream().wait_stream(side)
        assert all(torch.equal(out, want[0]) for out in main) and all(torch.equal(out, want[1]) for out in beside)
    assert not layers[0].tile_counters.any() and not layers[1].tile_counters.any()


@pytest.mark.parametrize("group, static, width", [(48, None, 192), (64, None, 192), (10_000, None, 192),
                                                  (10_000, 0.004, 192), (10_000, None, 2500), (10_000, 0.004, 2500)])
def test_the_activation_quantizer_rounds_as_torch_does(group, static, width, monkeypatch):
    """The one-launch float8 quantizer of the inputs (CUDA's path; the interpreter here)
    gives torch's values: the scales bit for bit, and every rounding, ties to even,
    subnormals and the clamp at 448 included (inputs over 4 decades of magnitude); a
    group read once (up to ``ONE_PASS_MAX`` inputs) or in steps."""
    monkeypatch.setattr(quant_matmul, "ONE_PASS_MAX", 2048)  # 2,500 inputs: three steps of 1,024
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, width, generator=g) * torch.logspace(-3, 1, width) * (50 if static else 1)
    x[0, :3] = torch.tensor([448 * 0.004 * 1.5, 2.0 ** -9 * 0.004 * 2.5, 0.0])  # clamp, a subnormal tie
    q, scales = quant_matmul.quantize_rows(x.to(DEVICE), group, static)
    if static is not None:
        want_q = (x / torch.tensor(static)).clamp(-448, 448).to(FP8)
        assert scales.cpu().item() == torch.tensor(static).item()
    else:
        want_q, want_s = [], []
        for start in range(0, width, min(group, width)):
            part = x[:, start:start + group]
            s = (part.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12)
            want_q.append((part / s).clamp(-448, 448).to(FP8))
            want_s.append(s)
        want_q = torch.cat(want_q, 1)
        assert torch.equal(scales.cpu(), torch.cat(want_s, 1))
    assert torch.equal(q.cpu().float(), want_q.float())  # (a GPU may give +0 for torch's −0: the same value)


def test_a_row_does_not_depend_on_its_batch():
    """The Triton GEMMs' tiles never depend on the rows: a row's output alone equals its
    output in any batch, bit for bit on a GPU (``--deterministic`` relies on it). Under
    the Triton interpreter (CPU) a tile's product is numpy's, whose BLAS may round a
    tile's rows differently with the rows beside them (seen with OpenBLAS's Haswell
    kernels on an AVX2 machine): there the rows agree to float32 rounding."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 256, generator=g) * 0.1
    fp8, int4 = quantize_fp8(w, (32, 64)), quantize_int4(w, 64)
    x = torch.randn(19, 256, generator=g).to(DEVICE)
    fp8_layer = Fp8Linear(_to_device(fp8), None, "group", None, deterministic=True)
    int4_layer = Int4Linear(_to_device(int4), None, deterministic=True)
    for layer in (fp8_layer, int4_layer):
        whole = layer(x)
        for rows in (slice(0, 1), slice(3, 8), slice(18, 19)):
            if CUDA:
                assert torch.equal(layer(x[rows]), whole[rows])
            else:
                torch.testing.assert_close(layer(x[rows]), whole[rows], rtol=1e-6, atol=1e-6)


COMPILE_FOR_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from specserve.kernels import quant_matmul as qm

def compile(fn, pointers, constants, num_warps=4, num_stages=3):
    constants = dict(constants, **{p.name: p.default for p in fn.params  # (constexprs left at their defaults)
                                   if p.is_constexpr and p.has_default and p.name not in constants})
    signature = {name: "constexpr" if name in constants else pointers.get(name, "i32") for name in fn.arg_names}
    constexprs = {(fn.arg_names.index(name),): value for name, value in constants.items()}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))

tiles = dict(HAS_BIAS=False, SPLIT_SUM=2, BLOCK_M=16, BLOCK_K=128, UPCAST=False, IEEE=False)
split = dict(part_ptr="*fp32", count_ptr="*i32")  # K split, summed by the last program (atomics)
fp8 = dict(split, xs_ptr="*fp32", w_ptr="*fp8e4nv", ws_ptr="*fp32", bias_ptr="*bf16", out_ptr="*bf16")
# W8A8's few rows: the weights on the left, as wgmma
ptx = compile(qm._fp8_left_kernel, dict(fp8, x_ptr="*fp8e4nv"), dict(tiles, BLOCK_N=64), num_stages=4).asm["ptx"]
assert "wgmma.mma_async" in ptx
for x, a_fp8 in (("fp8e4nv", True), ("bf16", False)):
    compile(qm._fp8_kernel, dict(fp8, x_ptr="*" + x), dict(tiles, BLOCK_N=128, A_FP8=a_fp8))
compile(qm._fp8_row_kernel, dict(fp8, x_ptr="*bf16"), dict(tiles, BLOCK_N=64))
int4 = dict(split, x_ptr="*bf16", w_ptr="*i32", s_ptr="*bf16", z_ptr="*u8", bias_ptr="*bf16", out_ptr="*bf16")
for kernel in (qm._int4_kernel, qm._int4_row_kernel):  # nibbles through _NIBBLE_BITS, none converted
    ptx = compile(kernel, int4, dict(tiles, BLOCK_N=128, TILE_IN_GROUP=True), num_stages=2).asm["ptx"]
    converts = ptx.count("cvt.rn.f32.u32") + ptx.count("cvt.rn.f32.s32")  # (the zero points' remain)
    assert "lop3.b32" in ptx and converts <= 8, (kernel, converts)
compile(qm._int4_kernel, int4, dict(tiles, SPLIT_SUM=0, BLOCK_M=64, BLOCK_N=128, TILE_IN_GROUP=True), num_stages=4)
compile(qm._quantize_kernel, dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32", x_static="fp32"),
        dict(STATIC=False, BLOCK=128))
compile(qm._sum_splits, dict(part_ptr="*fp32", bias_ptr="*bf16", out_ptr="*bf16"),
        dict(SPLIT=4, HAS_BIAS=True, BLOCK=1024))
print("compiled")
"""


@pytest.mark.skipif(CUDA, reason="with a GPU the tests above compile the kernels for real")
def test_the_quantized_gemms_compile_for_hopper():
    """Every Triton kernel of ``quant_matmul`` compiles for sm_90 (what the interpreter
    cannot tell), W8A8's few-row kernel multiplies with wgmma (the point of putting the
    weights on the left), and the 4-bit kernels take their nibbles through
    ``_NIBBLE_BITS`` (no int-to-float conversions)."""
    from sm90_compile import compiles_for_sm90

    compiles_for_sm90(COMPILE_FOR_SM90)


@triton.jit
def _nibbles_kernel(w_ptr, z_ptr, out_ptr, q_ptr, scale_ptr, N: tl.constexpr):
    """``_nibble_bits`` without PTX, and ``_nibble`` with zero points, for N words."""
    offs = tl.arange(0, N)
    bits = quant_matmul._nibble_bits(tl.load(w_ptr + offs), False)
    z = tl.load(z_ptr + offs)
    for j in tl.static_range(8):
        tl.store(out_ptr + j * N + offs, bits[j])
        q, scale = quant_matmul._nibble(bits, j, z)
        tl.store(q_ptr + j * N + offs, q)
        tl.store(scale_ptr + j + 0 * offs, scale + 0.0 * q, mask=offs == 0)


def _emulated_ptx(words: torch.Tensor) -> list[torch.Tensor]:
    """``_NIBBLE_BITS`` carried out as its text says (masks, sources, the register m), on
    int64 words holding int32 bit patterns: eight int32 tensors."""
    import re

    text = quant_matmul._NIBBLE_BITS.value
    m = int(re.search(r"mov\.b32 m, (0x[0-9A-F]+);", text).group(1), 16)
    shift = int(re.search(r"shr\.u32 h, \$8, (\d+);", text).group(1))
    lines = re.findall(r"lop3\.b32 \$(\d), (\$8|h), (0x[0-9A-F]+), m, 0xEA;", text)  # (a & b) | c
    assert [int(out) for out, _, _ in lines] == list(range(8))
    unsigned = words & 0xFFFFFFFF
    sources = {"$8": unsigned, "h": unsigned >> shift}
    return [((sources[src] & int(mask, 16)) | m).to(torch.int32) for _, src, mask in lines]


def test_nibbles_from_ptx_give_the_bits_of_shift_mask_and_convert():
    """``_NIBBLE_BITS`` (inline PTX, which only a GPU runs) carried out as written gives
    the bits that ``_nibble_bits`` computes without it (the interpreter's path, which the
    GEMM tests above run on a CPU), and with ``_nibble``'s powers those bits give what shift,
    mask and int-to-float gave, bit for bit: the one-row kernel's products with an input
    (q · 2^p − 2^23 times x · 2^-p) and their sum, and the tiled kernel's weights
    ((q − z) · 2^p times s · 2^-p, z up to 16: GPTQ's v1 zero points plus one)."""
    g = torch.Generator().manual_seed(11)
    n = 4096
    words = torch.randint(-2**31, 2**31, (n,), dtype=torch.int64, generator=g)
    z = torch.randint(0, 17, (n,), generator=g).to(torch.float32)
    emulated = _emulated_ptx(words)
    bits, q_got, scales = (torch.empty(8, n, dtype=torch.int32, device=DEVICE), torch.empty(8, n, device=DEVICE),
                           torch.empty(8, device=DEVICE))
    _nibbles_kernel[(1,)](words.to(DEVICE, torch.int32), z.to(DEVICE), bits, q_got, scales, N=n)
    bits, q_got, scales = bits.cpu(), q_got.cpu(), scales.cpu()
    x = torch.randn(8, n, generator=g) * torch.logspace(-30, 30, n)
    s = (torch.randn(n, generator=g) * torch.logspace(-20, 20, n)).to(torch.bfloat16).float()
    product = want = None
    for j in range(8):
        assert torch.equal(bits[j], emulated[j]), j
        q = ((words >> (4 * j)) & 0xF).to(torch.float32)
        read = bits[j].view(torch.float32)
        one_row = (read - 8388608.0) * (x[j] * scales[j])
        assert torch.equal(one_row, q * x[j]), j
        assert torch.equal(q_got[j] * (s * scales[j]), (q - z) * s), j  # the tiled kernel's weights
        product = one_row if product is None else product + one_row
        want = q * x[j] if want is None else want + q * x[j]
    assert torch.equal(product, want)


def _to_device(weight):
    return type(weight)(**{k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in vars(weight).items()})


# ---------------------------------------------------------------------------- engine
@pytest.mark.parametrize("layout", RUNS)
def test_the_engine_decodes_a_quantized_checkpoint(layout, checkpoints):
    """Greedy decoding of the quantized checkpoint: with n-gram drafts it equals without
    (lossless), every KV block comes back, and teacher-forced logits equal transformers'
    on the dequantised weights, each projection's input rounded as the scheme says, up to
    summation order (4-bit on the CPU: up to the GGUF kernels' int16 activations).

    Where inputs are rounded to float8 at run time, transformers takes the engine's own
    inputs, rounded by the reference, once it has checked that its own agree with them:
    a small difference upstream flips a value lying at a rounding midpoint, a step of
    float8 (1/16 to 1/8 of the value) that the next layers carry to the logits (0.09–0.14
    on an H100). On CUDA the float8 tensor cores sum their products with fewer bits than
    fp32 (``W8A8_MMA``)."""
    path, reference = checkpoints(layout)
    scheme = parse_scheme(QUANT_LAYOUTS[layout], "q")
    common = dict(device=DEVICE.type, dtype="float32", block_size=4, num_kv_blocks=128)
    prompts = [[(5 * i + j) % 500 + 3 for i in range(12)] for j in range(3)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = LLM(str(path), **common)
    want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    spec = LLM(str(path), **common, speculative_method="ngram", num_speculative_tokens=3,
               speculative_adaptive=False)
    assert [o.token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == want
    assert spec.engine.num_free_blocks == spec.engine.kv.num_blocks
    model = plain.engine.runner.model
    for prompt in prompts[:2]:
        with recorded_fp8_inputs(model) as inputs:
            got = ragged_logits(model, [prompt], chunk=5, device=DEVICE)[0].cpu()
        hooks = follow_engine_roundings(reference, path, scheme, inputs)
        try:
            with torch.no_grad():
                hf = reference(torch.tensor([prompt])).logits[0]
        finally:  # (the module's reference model serves other tests)
            for hook in hooks:
                hook.remove()
        err = (got - hf).abs().max().item()
        assert err < (W8A8_MMA if hooks and CUDA else 1e-4 if CUDA or layout not in INT4 else 2e-3), err
        assert torch.equal(got.argmax(-1), hf.argmax(-1))


@pytest.mark.parametrize("layout, variant", [("ct_fp8_dynamic", "llama"), ("fbgemm_fp8", "llama"),
                                             ("ct_fp8_dynamic", "gemma3")]
                         + ([("fp8_block", "llama")] if CUDA else []))
def test_norms_and_the_activation_hand_float8_layers_their_inputs_rounded(layout, variant, checkpoints,
                                                                          tiny_model_dir, tmp_path, monkeypatch):
    """With the Triton ops (interpreted on a CPU), a layer's norms and its activation hand
    the float8 projections that they alone feed (q/k/v, gate/up, down) their inputs
    rounded, so that only the attention's output projection rounds its own: the logits
    are those of the same model with every projection rounding its own, bit for bit
    under the interpreter (on a GPU the two norms are compiled apart and may sum a row
    in another order: there to float8 tensor-core rounding, the same tokens). Gemma 3's
    MLP is handed its rows by its pre-feedforward norm, its GeGLU's by the activation."""
    if variant == "llama":
        path, _ = checkpoints(layout)
    else:
        path = tmp_path / variant
        write_quantized_checkpoint(tiny_model_dir(variant), path, layout)
    files = ModelFiles("q", path)
    model = build_model(files, load_hf_config(files), torch.float32, DEVICE, _gpu_backend(DEVICE))
    handing = [m for m in model.modules() if getattr(m, "fp8_group", 0)]
    layers = model.config.num_hidden_layers
    assert len(handing) == 3 * layers  # two norms and the MLP a layer
    rounding = []
    matmul = Fp8Linear._matmul

    def counted(self, xq, x_scale, dtype, start, stop, quantize=False):
        rounding.append(quantize)
        return matmul(self, xq, x_scale, dtype, start, stop, quantize)

    monkeypatch.setattr(Fp8Linear, "_matmul", counted)
    prompt = [(7 * i) % 500 + 3 for i in range(9)]
    fused = ragged_logits(model, [prompt], chunk=5, device=DEVICE)[0]
    assert sum(rounding) == 2 * layers and len(rounding) == 4 * 2 * layers  # two passes (chunks of 5)
    for module in handing:
        module.fp8_group = 0
    rounding.clear()
    own = ragged_logits(model, [prompt], chunk=5, device=DEVICE)[0]
    assert sum(rounding) == 4 * 2 * layers
    if CUDA:
        assert (fused - own).abs().max() <= W8A8_MMA * own.abs().max() and torch.equal(fused.argmax(-1),
                                                                                      own.argmax(-1))
    else:
        assert torch.equal(fused, own)


def test_a_norm_hands_float8_only_to_a_layer_that_reads_just_its_output():
    """A float8 layer reading the norm's output beside another (EAGLE-3's first layer: the
    embeddings' norm and the features, 2 x hidden) is not handed float8 rows; one reading
    it alone is; nor does an activation hand a row wider than one program rounds."""
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(64, 1e-6, TritonLayerOps())
    for width, handed in ((128, 0), (64, 64)):
        norm.hand_fp8(Fp8Linear(quantize_fp8(torch.randn(32, width, generator=g)), None, "token", None, False))
        assert norm.fp8_group == handed
    assert fused_act.fp8_fusable(16384, 16384) and fused_act.fp8_fusable(20480, 128)
    assert not fused_act.fp8_fusable(20480, 20480)


def test_quantized_moe_experts_run_as_stored(tiny_model_dir, tmp_path, monkeypatch):
    """Mixtral's experts in 4-bit (AWQ), with the attention: every expert is a quantized
    layer, and teacher-forced logits equal the engine's on the dequantised float
    checkpoint (up to the CPU's int16 activations)."""
    import tiny_models

    monkeypatch.setattr(tiny_models, "QUANTIZED_PROJECTIONS", QUANTIZED_PROJECTIONS + ("w1", "w2", "w3"))
    write_quantized_checkpoint(tiny_model_dir("mixtral_moe"), tmp_path / "q", "awq",
                               dequantised_dir=tmp_path / "deq")
    common = dict(device=DEVICE.type, dtype="float32", block_size=4, num_kv_blocks=64)
    quant, deq = LLM(str(tmp_path / "q"), **common), LLM(str(tmp_path / "deq"), **common)
    moe = quant.engine.runner.model.model.layers[0].mlp
    layers = (QuantLinear, Int4Linear)
    assert all(isinstance(e.gate_up_proj, layers) and isinstance(e.down_proj, layers) for e in moe.experts)
    assert moe.w13 is None  # (no grouped GEMM over stacks of the float placeholders)
    prompt = [(7 * i) % 500 + 3 for i in range(14)]
    got = ragged_logits(quant.engine.runner.model, [prompt], chunk=5, device=DEVICE)[0].cpu()
    want = ragged_logits(deq.engine.runner.model, [prompt], chunk=5, device=DEVICE)[0].cpu()
    assert (got - want).abs().max().item() < (1e-4 if CUDA else 2e-3)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_moe_keeps_its_stacked_experts_until_they_are_replaced(tiny_model_dir):
    """The grouped GEMMs read stacks of the experts' float weights: another linear replaced
    keeps them; an expert's replaced (quantized, batch-invariant) drops them, so that the
    experts' own layers run."""
    from specserve.models.packed_linear import linears_replaced

    model = load(tiny_model_dir("mixtral_moe"), CPU, torch.float32)
    moe = model.model.layers[0].mlp
    moe.w13 = moe.w2 = torch.zeros(1)  # as stack_experts leaves them on a GPU
    model.model.layers[0].self_attn.o_proj = torch.nn.Identity()
    linears_replaced(model)
    assert moe.w13 is not None
    moe.experts[1].down_proj = torch.nn.Identity()
    linears_replaced(model)
    assert moe.w13 is None and moe.w2 is None


# Hopper's float8 tensor cores sum a product's terms with fewer bits than fp32: a W8A8
# layer's output differs from the exact sum of its (exact) float8 products by up to 4e-4
# of its largest, measured on an H100 at the tiny model's K of 64 and 128 (one tile), and
# so do the next layers' inputs and the logits (1e-4 to 4e-4): a bound with margin.
W8A8_MMA = 2e-3
ENGINE_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class recorded_fp8_inputs:
    """While open: each float8 layer's inputs that it rounds at run time, by transformers'
    projection name (a merged layer's under each of its parts), rows in call order. The
    norms and activations hand on their outputs as they are meanwhile (not rounded:
    ``hand_fp8``), which gives the same logits (the test above)."""

    def __init__(self, model) -> None:
        self.inputs: dict[str, list[torch.Tensor]] = {}
        self.hooks = []
        self.handing = {module: module.fp8_group for module in model.modules() if getattr(module, "fp8_group", 0)}
        for module in self.handing:
            module.fp8_group = 0
        for name, module in model.named_modules():
            if isinstance(module, Fp8Linear) and module.activations is not None:
                parent, leaf = name.rsplit(".", 1)
                names = [f"{parent}.{part}" for part in ENGINE_PROJECTIONS.get(leaf, (leaf,))]
                self.hooks.append(module.register_forward_hook(self._hook(names)))

    def _hook(self, names):
        def hook(module, args, out):
            for name in names:
                x = args[0].detach().reshape(-1, module.in_features)
                self.inputs.setdefault(name, []).append(x.to("cpu", torch.float32, copy=True))
        return hook

    def __enter__(self) -> dict[str, list[torch.Tensor]]:
        return self.inputs

    def __exit__(self, *exc) -> None:
        for hook in self.hooks:
            hook.remove()
        for module, group in self.handing.items():
            module.fp8_group = group


def follow_engine_roundings(reference, path, scheme, inputs: dict[str, list[torch.Tensor]]) -> list:
    """Hooks that make each of transformers' projections take, as the scheme says (per
    token, per token and group, or with the projection's own static scale from the
    checkpoint), the rounding of the engine's input to it, ``inputs`` — after checking
    that its own input agrees with the engine's: to float32 summation order on a CPU, to
    the float8 tensor cores' sums on CUDA (``W8A8_MMA``). So it computes the checkpoint's
    model on the engine's roundings, which such a difference upstream may move by a step
    at a midpoint."""
    from safetensors import safe_open

    if scheme.kind != "fp8" or scheme.activations is None:
        return []
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        statics = {name[:-len(".input_scale")]: f.get_tensor(name) for name in f.keys() if name.endswith("input_scale")}
    assert inputs and set(inputs) <= {name for name, _ in reference.named_modules()}, sorted(inputs)[:3]

    def hook_for(name):
        def hook(module, args):
            x = args[0]
            engine = torch.cat(inputs[name]).reshape(x.shape)
            bound = (W8A8_MMA if CUDA else 1e-5) * x.abs().max()  # (the engine on CUDA)
            assert (engine - x).abs().max() <= bound, (name, (engine - x).abs().max().item())
            if scheme.activations == "static":
                return (fp8_round(engine, statics[name].reshape(())).float(),)
            return (fp8_round_rows(engine, x.shape[-1] if scheme.activations == "token" else scheme.block[1]).float(),)
        return hook

    return [module.register_forward_pre_hook(hook_for(name)) for name, module in reference.named_modules()
            if name.split(".")[-1] in QUANTIZED_PROJECTIONS]
