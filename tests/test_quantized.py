"""GGUF weights kept quantized (models/quantized.py, gguf_weights.py, kernels/cpu_quant.cpp):
every block format decodes to exactly the values ggml dequantises to, the C++ kernel
computes what its torch reference does, a whole GGUF model loads with llama.cpp's q/k
permutation undone and agrees with transformers on the dequantised weights, and the
default model runs from its own Q4_1 file."""
from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize
from test_model import ragged_logits
from tiny_models import make_hf_model, make_tokenizer, random_gguf_weight, write_tiny_gguf

from specserve import LLM, EngineConfig, SamplingParams
from specserve.attention import TorchAttentionBackend
from specserve.errors import ModelLoadError
from specserve.gguf_weights import GGUFCheckpoint, open_gguf
from specserve.kernels import cpu_ops
from specserve.loader import ModelFiles, build_model, load_hf_config, quantized_gguf
from specserve.models.quantized import (
    DEQUANT_ROWS,
    FORMATS,
    Decoded,
    QuantLinear,
    decode,
    default_dequant_rows,
    pack,
    quantize_activations,
)

needs_cpu_kernels = pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU kernels did not build")
CPU = torch.device("cpu")
# Input widths per format: block multiples with an odd number of 64-input chunks, a tail
# that needs padding (Q4_0 at 96), tail blocks of 8, 4, 2 and 1 chunks, and full blocks.
WIDTHS = {"Q4_0": (32, 96, 576, 1536), "Q4_1": (64, 576, 864, 1536), "Q8_0": (32, 448, 576),
          "Q4_K": (256, 768, 1792), "Q6_K": (256, 512, 1792), "Q5_0": (32, 96, 576), "Q5_1": (64, 576, 1536),
          "Q5_K": (256, 768, 1792), "Q3_K": (256, 768), "Q2_K": (256, 1792), "IQ4_NL": (32, 576),
          "IQ4_XS": (256, 768)}


random_weight = random_gguf_weight  # random blocks of a format, finite fp16 scales


def reference(x: torch.Tensor, dense: np.ndarray) -> torch.Tensor:
    """What the kernel computes, in float64: activations quantized as it does, times the
    dequantised weight."""
    a, d = quantize_activations(x)
    k = dense.shape[1]
    return (a[..., :k].double() * d[..., :k].double()) @ torch.from_numpy(dense).double().T


@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_every_format_decodes_to_what_ggml_dequantises(kind):
    for k in WIDTHS[kind]:
        weight = random_weight(kind, 24, k, seed=k)
        want = dequantize(weight.raw, gguf.GGMLQuantizationType[kind]).reshape(24, k)
        assert np.array_equal(decode(weight).dequantize(), want), (kind, k)


# The kernel's form each format runs in: (bits of q, inputs per scale and min).
KERNEL_FORMS = {"Q4_0": (4, 32), "Q4_1": (4, 32), "Q4_K": (4, 32), "Q3_K": (4, 16), "Q2_K": (4, 16),
                "Q5_0": (5, 32), "Q5_1": (5, 32), "Q5_K": (5, 32), "Q8_0": (8, 32), "IQ4_NL": (cpu_ops.IQ4, 32),
                "IQ4_XS": (cpu_ops.IQ4, 32), "Q6_K": (6, 16)}


def test_every_format_runs_in_its_narrowest_form_and_q_fits_it():
    """Each format's q in the fewest bits that hold it (Q3_K and Q2_K in 4, over groups of
    16; the Q5 formats in 5, Q6_K in 6; the IQ4 formats as 4-bit indices), every q within them; a q
    wider than its form is refused, never packed cut."""
    assert set(KERNEL_FORMS) == set(FORMATS)
    for kind, form in KERNEL_FORMS.items():
        decoded = decode(random_weight(kind, 16, WIDTHS[kind][-1]))
        assert (decoded.bits, decoded.group) == form, kind
        assert int(decoded.q.max()) < 1 << decoded.stored_bits, kind
    decoded = decode(random_weight("Q3_K", 4, 256))
    decoded.q[0, 0] = 16
    with pytest.raises(ValueError, match="wider than its 4 bits"):
        pack(decoded)


@needs_cpu_kernels
@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_the_kernel_computes_its_reference(kind):
    for k in WIDTHS[kind]:
        weight = random_weight(kind, 40, k, seed=k)
        dense = decode(weight).dequantize()
        bias = torch.randn(40)
        layer = QuantLinear([(0, weight)], k, 40, bias)
        layer.dequant_rows = 0  # the integer kernel at every row count
        for rows in (1, 2, 3, 4, 5, 9):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            want = reference(x, dense) + bias.double()
            got = layer(x)
            assert got.dtype == torch.float32 and got.shape == (rows, 40)
            assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max(), (kind, k, rows)
            got16 = layer(x.bfloat16())  # bf16 activations: quantized from their bf16 values
            want16 = reference(x.bfloat16().float(), dense) + bias.double()
            assert got16.dtype == torch.bfloat16
            assert (got16.double() - want16).abs().max() <= 1e-2 * want16.abs().max(), (kind, k, rows)


@needs_cpu_kernels
@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_many_rows_unpack_the_weight_exactly_for_a_library_gemm(kind):
    """From ``dequant_rows`` rows on, the weight is unpacked to natural order for ATen's
    GEMM: fed the identity, the layer gives back every weight, bit for bit (float32), or
    rounded once to bfloat16; on random rows it computes the dequantised product."""
    for k in WIDTHS[kind]:
        weight = random_weight(kind, 40, k, seed=k)
        dense = torch.from_numpy(decode(weight).dequantize())
        layer = QuantLinear([(0, weight)], k, 40, None)
        assert layer.dequant_rows > 1
        layer.dequant_rows = 1
        assert torch.equal(layer(torch.eye(k)), dense.T), (kind, k)
        assert torch.equal(layer(torch.eye(k).bfloat16()), dense.bfloat16().T), (kind, k)
        bias = torch.randn(40)
        layer = QuantLinear([(0, weight)], k, 40, bias)
        x = torch.randn(DEQUANT_ROWS + 3, k, generator=torch.Generator().manual_seed(k))
        want = x.double() @ dense.double().T + bias.double()
        assert (layer(x).double() - want).abs().max() <= 1e-5 * want.abs().max(), (kind, k)
        want16 = x.bfloat16().double() @ dense.bfloat16().double().T + bias.double()
        assert (layer(x.bfloat16()).double() - want16).abs().max() <= 1e-2 * want16.abs().max(), (kind, k)


@needs_cpu_kernels
def test_a_large_weight_is_unpacked_in_slices_exactly():
    """A weight larger than the kernel's unpacking slice (4 MiB: 1,792 rows of 576 inputs in
    float32, 3,584 in bfloat16; an LM head is 49,152) goes through the GEMM slice by slice:
    every slice's weights, scales, mins and bias are its own rows', bit for bit."""
    weight = random_weight("Q4_1", 4000, 576, seed=3)
    dense = torch.from_numpy(decode(weight).dequantize())
    layer = QuantLinear([(0, weight)], 576, 4000, None)
    layer.dequant_rows = 1
    assert torch.equal(layer(torch.eye(576)), dense.T)
    assert torch.equal(layer(torch.eye(576).bfloat16()), dense.bfloat16().T)
    bias = torch.randn(4000)
    layer = QuantLinear([(0, weight)], 576, 4000, bias)
    layer.dequant_rows = 1
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(0))
    want = x.double() @ dense.double().T + bias.double()
    assert (layer(x).double() - want).abs().max() <= 1e-5 * want.abs().max()
    # Two-level scales (K-quants): each slice's rows of integers and factors (1,365 rows of
    # 768 inputs a float32 slice).
    weight = random_weight("Q4_K", 3000, 768, seed=4)
    layer = QuantLinear([(0, weight)], 768, 3000, None)
    layer.dequant_rows = 1
    assert torch.equal(layer(torch.eye(768)), torch.from_numpy(decode(weight).dequantize()).T)


needs_amx = pytest.mark.skipif(not (cpu_ops.available() and cpu_ops.amx_tiles()), reason="no AMX tiles here")


@needs_amx
@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_amx_tiles_multiply_the_unpacked_weights(kind):
    """On AMX, from ``dequant_rows`` rows on (bf16 activations): fed the identity, the layer
    gives back every weight rounded once to bf16, bit for bit; on random rows, with a bias,
    the bf16 weights times the bf16 inputs summed in fp32 and rounded once. Output rows
    filling part of a 16-row tile and of a thread's 64, rows of x across 16-row blocks (one,
    a pair, a lone last one), widths with an odd last chunk and with groups of 16."""
    for k in WIDTHS[kind]:
        for n in (40, 64, 100):
            weight = random_weight(kind, n, k, seed=k + n)
            dense = torch.from_numpy(decode(weight).dequantize()).bfloat16().double()
            layer = QuantLinear([(0, weight)], k, n, None)
            layer.dequant_rows = 1
            assert torch.equal(layer(torch.eye(k).bfloat16()).double(), dense.T), (kind, k, n)
            bias = torch.randn(n)
            layer = QuantLinear([(0, weight)], k, n, bias)
            layer.dequant_rows = 1
            for rows in (1, 7, 16, 17, 33, 50):
                x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16().double()
                want = x @ dense.T + bias.double()
                got = layer(x.bfloat16())
                assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
                # fp32 sums (a few ulps of the magnitudes summed), then one rounding to bf16
                bound = 1e-5 * (x.abs() @ dense.abs().T + bias.double().abs()) + 2.0 ** -8 * want.abs()
                assert ((got.double() - want).abs() <= bound).all(), (kind, k, n, rows)


@needs_amx
def test_amx_tiles_give_a_row_the_same_bits_in_any_batch():
    """Each output is summed over its inputs in one order whatever the number of rows: a
    row's result on the tiles does not depend on the rows beside it."""
    for kind, k in (("Q4_1", 576), ("Q6_K", 768), ("Q8_0", 1536), ("Q3_K", 768), ("Q5_0", 576), ("Q5_K", 768)):
        layer = QuantLinear([(0, random_weight(kind, 70, k))], k, 70, torch.randn(70))
        layer.dequant_rows = 1
        x = torch.randn(37, k).bfloat16()
        alone = torch.cat([layer(x[i:i + 1]) for i in range(37)])
        for rows in (2, 16, 17, 37):
            batched = torch.cat([layer(x[i:i + rows]) for i in range(0, 37, rows)])
            assert torch.equal(batched, alone), (kind, rows)


@needs_cpu_kernels
def test_a_row_does_not_depend_on_its_batch():
    """With ``dequant_rows`` 0 (the deterministic mode's), each output is summed in one
    order whatever the number of rows: the layer is batch-invariant."""
    for kind, k in (("Q4_1", 576), ("Q6_K", 768), ("Q8_0", 1536), ("Q3_K", 768), ("Q5_0", 576), ("Q5_K", 768)):
        layer = QuantLinear([(0, random_weight(kind, 70, k))], k, 70, None)
        layer.dequant_rows = 0
        x = torch.randn(37, k).bfloat16()
        alone = torch.cat([layer(x[i:i + 1]) for i in range(37)])
        for rows in (2, 3, 5, 8, 37):
            batched = torch.cat([layer(x[i:i + rows]) for i in range(0, 37, rows)])
            assert torch.equal(batched, alone), (kind, rows)


@dataclass
class _Given:
    """A weight given in the kernel's form (as ``QuantLinear`` takes any with ``decoded()``)."""

    form: Decoded
    qtype: str = "given"

    @property
    def in_features(self) -> int:
        return self.form.q.shape[1]

    def decoded(self) -> Decoded:
        return self.form


def _random_decoded(rows: int, k: int, bits: int, group: int, seed: int) -> Decoded:
    """Random q within ``bits``, float16-exact scales and per-group mins (groups of 32 then
    hold float16)."""
    rng = np.random.default_rng(seed)
    scale = (rng.standard_normal((rows, k // group)) * 0.01).astype(np.float16).astype(np.float32)
    mins = (rng.standard_normal((rows, k // group)) * 0.1).astype(np.float16).astype(np.float32)
    return Decoded(rng.integers(0, 1 << bits, (rows, k), dtype=np.uint8), scale, mins, bits, group)


@needs_cpu_kernels
@pytest.mark.parametrize("form", [5, 6, cpu_ops.IQ4])
def test_nibble_forms_give_the_bits_of_their_eight_bit_form(monkeypatch, form):
    """On a build for AVX-512 a Q5 or Q6_K weight is held in 5 or 6 bits (its low four as
    4-bit q, then planes of the higher bits) and an IQ4 weight as its 4-bit indices into
    the IQ4 table; elsewhere as 8-bit q. The forms give the same outputs, bit for bit, through the
    integer kernel and the unpacked weight alike (AMX tiles where the CPU has them), at odd
    and even chunk counts; beside a part of another form the layer is held in the wider."""
    if form not in cpu_ops.weight_forms():
        pytest.skip("the kernels here are not built for AVX-512 VNNI: Q5, Q6_K and IQ4 weights run as 8 bits")
    # No GGUF 6-bit weight has an odd chunk count or groups of 32: given ones cover those paths.
    given = [[(0, _Given(_random_decoded(24, k, 6, group, seed)))] for seed, (k, group) in
             enumerate(((576, 32), (640, 32), (576, 16), (832, 16)))]
    cases = {5: [[(0, random_weight("Q5_0", 24, 576, 1))], [(0, random_weight("Q5_1", 24, 1536, 2))],
                 [(0, random_weight("Q5_K", 24, 768, 3))],
                 [(0, random_weight("Q5_K", 16, 512, 4)), (16, random_weight("Q3_K", 8, 512, 5))]],
             6: [[(0, random_weight("Q6_K", 24, 768, 1))], [(0, random_weight("Q6_K", 24, 1536, 2))],
                 [(0, random_weight("Q6_K", 16, 512, 4)), (16, random_weight("Q5_0", 8, 512, 5))], *given],
             cpu_ops.IQ4: [[(0, random_weight("IQ4_NL", 24, 576, 1))], [(0, random_weight("IQ4_NL", 24, 1536, 2))],
                           [(0, random_weight("IQ4_XS", 24, 768, 3))],
                           [(0, random_weight("IQ4_XS", 16, 512, 4)), (16, random_weight("IQ4_NL", 8, 512, 5))]]}
    for parts in cases[form]:
        k = parts[0][1].in_features
        narrow = QuantLinear(parts, k, 24, torch.randn(24))
        assert narrow.bits == form and narrow.packed.shape[1] == (4 if form == cpu_ops.IQ4 else form) * (-(-k // 64) * 64) // 8
        with monkeypatch.context() as patch:  # a build without AVX-512 VNNI: neither nibble forms nor two-level scales
            patch.setattr(cpu_ops, "weight_forms", lambda: frozenset({4, 8}))
            patch.setattr(cpu_ops, "two_level_scales", lambda: False)
            eight = QuantLinear(parts, k, 24, narrow.bias)
        assert eight.bits == 8
        for rows, dequant_rows in ((1, 0), (3, 0), (9, 0), (5, 1), (40, 16)):
            for x in (torch.randn(rows, k), torch.randn(rows, k).bfloat16()):
                narrow.dequant_rows = eight.dequant_rows = dequant_rows
                assert torch.equal(narrow(x), eight(x)), (parts[0][1].qtype, k, rows, dequant_rows, x.dtype)
    mixed = QuantLinear([(0, random_weight("IQ4_NL", 8, 512, 6)), (8, random_weight("Q4_0", 8, 512, 7))], 512, 16, None)
    assert mixed.bits == 8


@needs_cpu_kernels
def test_scales_and_mins_are_held_in_the_fewest_bytes_that_keep_them():
    """Q4_0, Q4_1, Q8_0, Q5_0, Q5_1 and IQ4_NL hold float16 scales (fewer bytes per step).
    K-quants' and IQ4_XS's scales are products of a factor per 256 inputs and a small
    integer per group: on a build for AVX-512 VNNI they are held so (two-level, uint8 rows:
    an int8 a group, then a float32 factor a super-block; Q4_K's scales and mins then take
    1.5 bytes a group each where float32 took 4), elsewhere as float32 products. Where every
    min is one factor times its scale (Q4_0, Q5_0, Q8_0, the IQ4 formats, Q6_K, Q3_K) only
    the factor is kept. Either way the layer computes the same bits as with float32 scales
    and a float32 min per group, through the integer kernel and the unpacked weight alike."""
    products = torch.uint8 if cpu_ops.two_level_scales() else torch.float32
    want = {"Q4_0": (torch.float16, -8), "Q4_1": (torch.float16, None), "Q8_0": (torch.float16, -128),
            "Q5_0": (torch.float16, -16), "Q5_1": (torch.float16, None), "IQ4_NL": (torch.float16, -128),
            "Q4_K": (products, None), "Q6_K": (products, -32), "Q5_K": (products, None),
            "Q3_K": (products, -4), "Q2_K": (products, None), "IQ4_XS": (products, -128)}
    assert set(want) == set(FORMATS)
    for kind, (dtype, factor) in want.items():
        for k in WIDTHS[kind]:
            weight = random_weight(kind, 40, k, seed=k)
            layer = QuantLinear([(0, weight)], k, 40, torch.randn(40))
            assert layer.scales.dtype == dtype, (kind, k)
            if dtype == torch.uint8:  # per row: the groups' int8s, then the super-blocks' float32 factors
                assert layer.scales.shape == (40, k // layer.group + 4 * k // 256), (kind, k)
            if factor is None:
                assert layer.mins.dtype == dtype and layer.mins.shape == layer.scales.shape, (kind, k)
            else:
                assert layer.mins.dim() == 0 and layer.mins.item() == factor, (kind, k)
            # the reference: the decoded per-group scales and mins themselves as float32
            # (padding groups weigh 0)
            decoded = decode(weight)
            padding = ((0, 0), (0, -(-k // 64) * 64 // layer.group - decoded.scale.shape[1]))
            scales, mins = (torch.from_numpy(np.ascontiguousarray(np.pad(v, padding))) for v in (decoded.scale, decoded.min))
            for rows, dequant_rows in ((1, 0), (5, 0), (9, 4), (40, 16)):
                x = torch.randn(rows, k).bfloat16()
                args = (layer.packed, layer.scales, layer.mins, layer.bits, layer.group, layer.bias, dequant_rows)
                wide = (layer.packed, scales, mins, *args[3:])
                assert torch.equal(cpu_ops.quant_linear(x, *args), cpu_ops.quant_linear(x, *wide)), (kind, k, rows)
            head = layer.select_rows(torch.tensor([3, 0, 17]))
            x = torch.randn(2, k).bfloat16()
            assert torch.equal(head(x), layer(x)[:, [3, 0, 17]]), (kind, k)
    layer = QuantLinear([(0, random_weight("Q4_1", 8, 64))], 64, 8, None)
    with pytest.raises(RuntimeError, match="both float32 or both float16"):
        cpu_ops.quant_linear(torch.randn(1, 64), layer.packed, layer.scales, layer.mins.float(), 4, 32, None, 0)
    with pytest.raises(RuntimeError, match="0-dim float32"):
        cpu_ops.quant_linear(torch.randn(1, 64), layer.packed, layer.scales, torch.tensor(-8.0).half(), 4, 32, None, 0)
    decoded = decode(random_weight("Q4_1", 8, 64))
    decoded.scale[0, 0] = 1e-9  # not a float16: the layer keeps float32
    assert pack(decoded)[1].dtype == torch.float32
    decoded = decode(random_weight("Q4_K", 8, 512))
    decoded.scale[2, 9] = np.nextafter(decoded.scale[2, 9], np.float32(1))  # not its factor times an integer
    assert pack(decoded)[1].dtype == torch.float32
    decoded = decode(random_weight("Q4_K", 8, 512))
    decoded.min[5, 0] = np.nextafter(decoded.min[5, 0], np.float32(1))  # a min off its factor: float32 for both
    assert pack(decoded)[1].dtype == torch.float32 and pack(decoded)[2].dtype == torch.float32
    weight = random_weight("Q6_K", 8, 512)
    weight.raw[3, 208:210] = np.array([np.inf], np.float16).view(np.uint8)  # a super-block's d not finite
    assert pack(decode(weight))[1].dtype == torch.float32
    decoded = decode(random_weight("Q4_0", 8, 64))
    decoded.min[3, 1] += 1e-3  # one min off the factor: every min is kept
    assert pack(decoded)[2].shape == (8, 2)
    weight = random_weight("Q4_0", 8, 64)
    weight.raw[0, 0:2] = np.array([8192.0], np.float16).view(np.uint8)  # its min, -8 d, is past float16's range
    packed, scales, factor = pack(decode(weight))
    assert scales.dtype == torch.float16 and factor.item() == -8.0  # the min made in float32 by the kernels
    x = torch.randn(3, 64)
    want = cpu_ops.quant_linear(x, packed, scales.float(), scales.float() * -8.0, 4, 32, None, 0)
    assert torch.equal(cpu_ops.quant_linear(x, packed, scales, factor, 4, 32, None, 0), want)


@needs_cpu_kernels
def test_parts_of_different_formats_make_one_layer():
    """q, k and v of one projection in Q4_K, Q6_K and Q8_0 (as Q4_K_M files mix them):
    one layer whose rows are each part's, exactly."""
    parts = [random_weight("Q4_K", 32, 512, 1), random_weight("Q6_K", 16, 512, 2), random_weight("Q8_0", 16, 512, 3)]
    layer = QuantLinear([(48, parts[2]), (0, parts[0]), (32, parts[1])], 512, 64, None)  # in any order
    assert (layer.bits, layer.group) == (8, 16)
    x = torch.randn(3, 512)
    dense = np.concatenate([decode(p).dequantize() for p in parts])
    want = reference(x, dense)
    assert (layer(x).double() - want).abs().max() <= 1e-5 * want.abs().max()
    rows = torch.tensor([5, 40, 63, 0])
    assert torch.equal(layer.select_rows(rows)(x), layer(x)[:, rows])
    with pytest.raises(ValueError, match="quantized parts make"):
        QuantLinear([(0, parts[0])], 512, 64, None)
    # Q3_K q and k beside a Q4_K v (a Q3_K_M file's): 4-bit q over groups of 16.
    parts = [random_weight("Q3_K", 32, 512, 4), random_weight("Q3_K", 16, 512, 5), random_weight("Q4_K", 16, 512, 6)]
    layer = QuantLinear([(0, parts[0]), (32, parts[1]), (48, parts[2])], 512, 64, None)
    assert (layer.bits, layer.group) == (4, 16)
    want = reference(x, np.concatenate([decode(p).dequantize() for p in parts]))
    assert (layer(x).double() - want).abs().max() <= 1e-5 * want.abs().max()


@needs_cpu_kernels
@pytest.mark.parametrize("kinds, form", [(("Q4_K", "Q6_K"), (6, 16)), (("Q3_K", "Q3_K", "Q4_K"), (4, 16)),
                                         (("IQ4_XS", "Q6_K"), (8, 16)), (("Q5_K", "Q2_K"), (5, 16)),
                                         (("Q4_K", "Q5_K"), (5, 32))])
def test_merged_k_quants_keep_two_level_scales(monkeypatch, kinds, form):
    """Parts of K-quants and IQ4_XS merged into one layer (a Q4_K_M file's Q4_K q and k
    beside a Q6_K v) keep their scales and mins two-level where the build takes them:
    each part's factors per 256 inputs, its groups' integers repeated where its groups are
    split; a min that is a power of two times its scale (Q6_K's −32) made a factor of its
    own. The layer gives the bits it gives with float32 scales and mins, through the
    integer kernel and the unpacked weight alike."""
    if not cpu_ops.two_level_scales():
        pytest.skip("the kernels here are not built for AVX-512 VNNI: K-quant scales are float32 products")
    parts = [(16 * i, random_weight(kind, 16, 768, i)) for i, kind in enumerate(kinds)]
    rows = 16 * len(kinds)
    layer = QuantLinear(parts, 768, rows, torch.randn(rows))
    assert (layer.bits, layer.group) == form
    assert layer.scales.dtype == layer.mins.dtype == torch.uint8
    with monkeypatch.context() as patch:
        patch.setattr(cpu_ops, "two_level_scales", lambda: False)
        products = QuantLinear(parts, 768, rows, layer.bias)
    assert products.scales.dtype == torch.float32
    for m, dequant_rows in ((1, 0), (4, 0), (7, 0), (40, 16)):
        for x in (torch.randn(m, 768), torch.randn(m, 768).bfloat16()):
            layer.dequant_rows = products.dequant_rows = dequant_rows
            assert torch.equal(layer(x), products(x)), (kinds, m, x.dtype)


def tiny_gguf(tmp_path, **types):
    path, hf = write_tiny_gguf(tmp_path, types=types or None)
    return ModelFiles("tiny-gguf", path.parent, path), hf


# What Q5_K_M, Q3_K_M, Q2_K and IQ4_XS files hold beside their main formats: Q5_0, Q5_1
# and IQ4_NL where llama.cpp falls back from Q4_K, Q5_K and IQ4_XS (rows not a multiple of
# 256 inputs; Q2_K and Q3_K fall back to Q4_0).
K_MIXES = {"Q4_K_M-like": ({}, ["Q4_K", "Q6_K", "Q8_0"]),
           "Q5_K_M/Q3_K_M/IQ4_XS-like": ({"attn_q": "Q5_K", "attn_k": "Q5_0", "attn_v": "Q3_K", "attn_output": "Q2_K",
                                          "ffn_gate": "IQ4_XS", "ffn_up": "Q5_1", "ffn_down": "Q6_K",
                                          "token_embd": "IQ4_NL"}, ["Q3_K", "Q5_0", "Q5_K"])}


@needs_cpu_kernels
@pytest.mark.parametrize("mix", sorted(K_MIXES))
def test_a_gguf_model_runs_quantized_and_agrees_with_transformers(tmp_path, mix):
    """Every weight kept in its blocks (formats mixed inside qkv), q and k rows unpermuted,
    the tied head run from the embedding's blocks: logits close to transformers' on the
    dequantised weights (int16 activations are the only difference; a wrong q/k order
    moves them by ~1.6 and changes 3 argmaxes in 4)."""
    types, qkv_formats = K_MIXES[mix]
    files, hf = tiny_gguf(tmp_path, **types)
    model = build_model(files, load_hf_config(files), torch.float32, CPU,
                        TorchAttentionBackend(cpu_kernels=True), quantized=True)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert not linears and isinstance(model.lm_head, QuantLinear)
    assert model.model.layers[0].self_attn.qkv_proj.formats == qkv_formats
    prompts = [torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (23, 9)]
    for prompt, got in zip(prompts, ragged_logits(model, prompts, chunk=5)):
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0]
        assert (got - want).abs().max().item() < 0.1
        assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.8


def test_the_gguf_reader_steps_over_long_metadata_arrays_and_reads_the_rest_as_gguf_does(tmp_path):
    """The loader's reader leaves out the tokenizer's long arrays (naming them, with their
    lengths, so a lookup finds nothing rather than an empty list) and gives every other
    field, the short array included, and every tensor exactly as the stock reader does."""
    path, _ = write_tiny_gguf(tmp_path)
    stock, ours = gguf.GGUFReader(str(path)), open_gguf(path)
    assert ours.skipped == {"tokenizer.ggml.tokens": 512, "tokenizer.ggml.token_type": 512,
                            "tokenizer.ggml.merges": 300}
    assert all(len(stock.get_field(name).contents()) == n for name, n in ours.skipped.items())
    assert ours.get_field("tokenizer.ggml.tokens") is None
    assert list(ours.fields) == [name for name in stock.fields if name not in ours.skipped]
    for name, field in ours.fields.items():
        assert field.types == stock.fields[name].types and field.contents() == stock.fields[name].contents(), name
    assert ours.get_field("general.tags").contents() == ["tiny", "test"]
    assert [t.name for t in ours.tensors] == [t.name for t in stock.tensors]
    for mine, theirs in zip(ours.tensors, stock.tensors):
        assert mine.tensor_type == theirs.tensor_type and list(mine.shape) == list(theirs.shape)
        assert np.array_equal(np.asarray(mine.data).view(np.uint8), np.asarray(theirs.data).view(np.uint8))


@needs_cpu_kernels
def test_float_tensors_in_a_gguf_load_beside_the_blocks(tmp_path):
    """BF16 norms and an F16 output projection (files mix float and block tensors): loaded
    as their exact values, the F16 projection a float layer beside the quantized ones, the
    step layer by layer (the fused layers need every projection quantized)."""
    files, hf = tiny_gguf(tmp_path, norm="BF16", attn_output="F16")
    model = build_model(files, load_hf_config(files), torch.float32, CPU,
                        TorchAttentionBackend(cpu_kernels=True), quantized=True)
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.o_proj, torch.nn.Linear) and isinstance(layer.self_attn.qkv_proj, QuantLinear)
    assert model.fused_cpu is None
    assert torch.equal(layer.input_layernorm.weight, hf.model.layers[0].input_layernorm.weight)
    assert torch.equal(layer.self_attn.o_proj.weight, hf.model.layers[0].self_attn.o_proj.weight)
    prompt = torch.randint(3, 512, (17,), generator=torch.Generator().manual_seed(3)).tolist()
    got = ragged_logits(model, [prompt], chunk=5)[0]
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    assert (got - want).abs().max().item() < 0.01


@needs_cpu_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_call_per_layer_gives_the_same_bits(tmp_path, tiny_model_dir, dtype):
    """Steps whose spans the C++ attention takes (decode rows, verify spans) run each layer
    as one C++ call: the same ops in the same order, so the same logits bit for bit as
    layer by layer (the default file's formats, and one of Q5 formats, 5-bit on AVX-512);
    longer prefill chunks run layer by layer."""
    prompts = [torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (23, 9, 4)]
    fives = {"attn_q": "Q5_0", "attn_v": "Q5_K", "ffn_up": "Q5_1", "ffn_down": "Q5_K"}
    for name, types in (("five", fives), ("default", {})):  # the default file's model goes on below
        files, _ = tiny_gguf(tmp_path / name, **types)
        model = build_model(files, load_hf_config(files), dtype, CPU, TorchAttentionBackend(cpu_kernels=True),
                            quantized=True)
        assert model.fused_cpu is not None
        for chunk in (1, 5):
            fused = ragged_logits(model, prompts, chunk=chunk, dtype=dtype)
            fused_cpu, model.fused_cpu = model.fused_cpu, None
            try:
                by_layer = ragged_logits(model, prompts, chunk=chunk, dtype=dtype)
            finally:
                model.fused_cpu = fused_cpu
            assert all(torch.equal(a, b) for a, b in zip(fused, by_layer)), (name, chunk)
    # The layers an EAGLE-3 head reads are tapped between the calls: the same rows either way.
    model.feature_layers, kept = (0, 1), []
    model.compute_logits = lambda hidden, logits=model.compute_logits: kept.append(model.features.clone()) or logits(hidden)
    fused = ragged_logits(model, prompts, chunk=1, dtype=dtype)
    model.fused_cpu, tapped_fused = None, kept[:]
    kept.clear()
    by_layer = ragged_logits(model, prompts, chunk=1, dtype=dtype)
    assert all(torch.equal(a, b) for a, b in zip(fused, by_layer))
    assert len(kept) == len(tapped_fused) > 0 and all(torch.equal(a, b) for a, b in zip(tapped_fused, kept))
    assert kept[0].shape[1] == 2 * model.config.hidden_size
    plain = ModelFiles("tiny", tiny_model_dir("llama"))
    float_model = build_model(plain, load_hf_config(plain), dtype, CPU, TorchAttentionBackend(cpu_kernels=True))
    assert float_model.fused_cpu is None  # float linears: layer by layer


@needs_cpu_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_step_of_few_rows_runs_its_layers_in_one_parallel_region(tmp_path, dtype):
    """A step of at most 16 rows runs all its layers in one C++ call and one parallel
    region (no per-piece op is dispatched): the same logits bit for bit as layer by layer,
    at any thread count, with a context long enough that one span's keys are split across
    threads; a step of more rows goes layer by layer inside the same call."""
    from torch.profiler import ProfilerActivity, profile

    files, _ = tiny_gguf(tmp_path)
    model = build_model(files, load_hf_config(files), dtype, CPU, TorchAttentionBackend(cpu_kernels=True),
                        quantized=True)
    prompts = [torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (150, 9, 4)]
    fused_cpu, model.fused_cpu = model.fused_cpu, None
    by_layer = ragged_logits(model, prompts, chunk=1, dtype=dtype)
    model.fused_cpu = fused_cpu
    threads = torch.get_num_threads()
    try:
        for count in (1, 3, 4):
            torch.set_num_threads(count)
            fused = ragged_logits(model, prompts, chunk=1, dtype=dtype)
            assert all(torch.equal(a, b) for a, b in zip(fused, by_layer)), count
    finally:
        torch.set_num_threads(threads)

    def ops(prompts: list[list[int]], chunk: int) -> set[str]:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            ragged_logits(model, prompts, chunk=chunk, dtype=dtype)
        return {event.key for event in prof.key_averages() if event.key.startswith("specserve_cpu::")}

    few = ops(prompts[1:], chunk=1)  # steps of 2 rows
    assert "specserve_cpu::quant_decoder_layers" in few and "specserve_cpu::quant_linear" in few  # (the LM head)
    assert "specserve_cpu::paged_attention_short" not in few and "specserve_cpu::rotary_store_kv" not in few
    many = ops(prompts[:2], chunk=9)  # a first step of 9 + 9 rows: layer by layer
    assert {"specserve_cpu::quant_decoder_layers", "specserve_cpu::paged_attention_short"} <= many

    # The region's clock (benchmarks/cpu_threads.py): 11 pieces, the layers run, then per
    # barrier (5 a layer) the arrivals' spread and the release; nothing while it is off.
    region_times = torch.ops.specserve_cpu.region_times
    region_times(True)
    ragged_logits(model, prompts[1:], chunk=1, dtype=dtype)
    timed = region_times(False)
    layers = len(model.fused_cpu.layers)
    assert len(timed) == 22 and min(timed) >= 0 and sum(timed[:11]) > 0
    assert timed[11] == 9 * layers  # 9 steps of at most 2 rows, each a region over every layer
    ragged_logits(model, prompts[1:], chunk=1, dtype=dtype)
    assert not any(region_times(False))


def runner_steps(model, dtype, prompts: list[list[int]], chunks: list[int]):
    """A paged runner over ``model`` and its batches: every prompt's first ``chunks[0]``
    tokens in one step, then ``chunks[1]`` at a time (all requests in each step), each
    step's logits rows the last of every request or, for spans of more than one token,
    all of them (a verify span's). Yields (runner, batch) with the batch's KV not yet written."""
    from specserve.config import EngineConfig
    from specserve.kv_cache import KVCacheManager
    from specserve.model_runner import ModelRunner
    from specserve.scheduler import ScheduledRequest, SchedulerOutput

    runner = ModelRunner(model, EngineConfig(block_size=4, num_kv_blocks=256), CPU, dtype)
    kv = KVCacheManager(runner.num_blocks, 4)
    done = [0] * len(prompts)
    while any(d < len(p) for d, p in zip(done, prompts)):
        planned = []
        for i, p in enumerate(prompts):
            if done[i] < len(p):
                n = min(chunks[0] if done[i] == 0 else chunks[1], len(p) - done[i])
                kv.allocate_slots(str(i), done[i] + n)
                verify = [] if done[i] == 0 or n == 1 else p[done[i] + 1:done[i] + n]  # as drafts: every row's logits
                planned.append(ScheduledRequest(str(i), p[done[i]:done[i] + n - len(verify)], done[i],
                                                kv.block_table(str(i)), SamplingParams(), draft_token_ids=verify))
        yield runner, runner.prepare(SchedulerOutput(planned, []))
        for step in planned:
            done[int(step.req_id)] += len(step.token_ids) + len(step.draft_token_ids)


@needs_cpu_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_steps_whole_pass_is_one_call_with_the_same_logits(tmp_path, dtype):
    """Where nothing but the LM head reads the layers' output, the runner's pass is one C++
    call from token ids to float32 logits (embedding, rotary tables, layers, final norm,
    head): the same logits bit for bit as the pass from Python, at 1 and 3 threads, for
    decode rows, verify spans, a step of more rows than one region takes (layer by layer
    inside the call), and a draft's restricted vocabulary; its own ops are all a few-row
    step dispatches."""
    from torch.profiler import ProfilerActivity, profile

    files, _ = tiny_gguf(tmp_path)
    model = build_model(files, load_hf_config(files), dtype, CPU, TorchAttentionBackend(cpu_kernels=True),
                        quantized=True)
    prompts = [torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (90, 12, 7)]
    threads = torch.get_num_threads()
    steps, taken, whole_pass = 0, [], model.fused_cpu.logits
    model.fused_cpu.logits = lambda *args: taken.append(whole_pass(*args)) or taken[-1]  # (an instance attribute)
    try:
        for count, chunks in ((1, [4, 1]), (3, [9, 3]), (3, [2, 7])):  # (2, 7): 21 rows, more than a region's 16
            torch.set_num_threads(count)
            for runner, batch in runner_steps(model, dtype, prompts, chunks):
                before = runner.kv_storage.clone()
                with torch.inference_mode():
                    one_call = runner.forward(batch)
                    written, runner.kv_storage[:] = runner.kv_storage.clone(), before
                    hidden = model(batch.input_ids, batch.positions, runner.kv_caches, batch)
                    by_python = model.compute_logits(hidden[batch.logits_indices]).float()
                assert torch.equal(runner.kv_storage, written)
                assert one_call.dtype == torch.float32 and torch.equal(one_call, by_python), (count, chunks, steps)
                steps += 1
    finally:
        torch.set_num_threads(threads)
        del model.fused_cpu.logits
    assert len(taken) == steps > 0 and all(logits is not None for logits in taken)  # every step in one call

    # A draft's vocabulary head: its logits in the full vocabulary's columns, -inf elsewhere
    # (in the region, and for a step of 18 rows layer by layer).
    model.restrict_vocab(torch.arange(300, 3, -1))
    for chunks in ([3, 1], [9, 9]):
        for runner, batch in runner_steps(model, dtype, prompts[1:], chunks):
            with torch.inference_mode():
                before = runner.kv_storage.clone()
                one_call = runner.forward(batch)
                runner.kv_storage[:] = before
                by_python = model.compute_logits(model(batch.input_ids, batch.positions, runner.kv_caches,
                                                       batch)[batch.logits_indices]).float()
            assert torch.equal(one_call, by_python) and one_call[:, 301:].isinf().all(), chunks
            assert one_call[:, :4].isinf().all() and one_call[:, 4:301].isfinite().all()

    def ops(chunks: list[int]) -> set[str]:
        steps = list(runner_steps(model, dtype, prompts[1:], chunks))
        with profile(activities=[ProfilerActivity.CPU]) as prof, torch.inference_mode():
            for runner, batch in steps[1:]:
                runner.forward(batch)
        return {event.key for event in prof.key_averages() if event.key.startswith(("specserve_cpu::", "aten::"))}

    few = ops([2, 1])  # decode rows of 2 requests
    assert {"specserve_cpu::quant_model_logits", "specserve_cpu::rotary_tables"} <= few
    assert not few & {"specserve_cpu::quant_linear", "specserve_cpu::add_rms_norm", "aten::embedding", "aten::cos"}

    # A model whose own pass differs (an EAGLE or MTP head's forward) keeps it.
    class OwnPass(type(model)):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    plain, model.__class__ = model.__class__, OwnPass
    try:
        runner, batch = next(runner_steps(model, dtype, prompts[1:], [1, 1]))
        assert model.fused_logits(runner.kv_caches, batch) is None
    finally:
        model.__class__ = plain
    assert model.fused_logits(runner.kv_caches, batch) is not None


@needs_cpu_kernels
def test_the_region_takes_layers_whose_down_projections_differ_in_form(tmp_path):
    """A file whose layers keep ffn_down in different forms, Q6_K (groups of 16) and Q4_K
    (32), as Q4_K_M files mix them: each layer's input is quantized by its own groups, and
    one region gives the logits of layer by layer."""
    files, _ = tiny_gguf(tmp_path, **{"blk.1.ffn_down": "Q4_K"})
    model = build_model(files, load_hf_config(files), torch.float32, CPU, TorchAttentionBackend(cpu_kernels=True),
                        quantized=True)
    assert [layer.mlp.down_proj.group for layer in model.model.layers] == [16, 32]
    prompts = [torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (70, 5)]
    fused_cpu, model.fused_cpu = model.fused_cpu, None
    by_layer = ragged_logits(model, prompts, chunk=1, dtype=torch.float32)
    model.fused_cpu = fused_cpu
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        fused = ragged_logits(model, prompts, chunk=1, dtype=torch.float32)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(fused, by_layer))


@needs_cpu_kernels
def test_the_deterministic_mode_keeps_the_integer_kernel_for_any_rows(tmp_path):
    """Deterministic: no layer switches to the library GEMM by its rows (the layer by
    layer path and the one-call layers alike), so a prefill chunk's rows round as a
    decode row does; otherwise the switch is on."""
    files, _ = tiny_gguf(tmp_path)
    for deterministic, want in ((True, 0), (False, default_dequant_rows())):
        backend = TorchAttentionBackend(cpu_kernels=True, deterministic=deterministic)
        model = build_model(files, load_hf_config(files), torch.bfloat16, CPU, backend, quantized=True)
        rows = {m.dequant_rows for m in model.modules() if isinstance(m, QuantLinear)}
        assert rows == {want} and {meta[-1] for _, meta, _, _ in model.fused_cpu.layers} == {want}


@needs_cpu_kernels
def test_speculation_over_a_quantized_target_is_lossless(tmp_path, monkeypatch):
    """The engine on a quantized GGUF target: greedy with n-gram and layer-skip drafts
    equals greedy without, and every KV block comes back."""
    import specserve.engine

    files, _ = tiny_gguf(tmp_path)
    monkeypatch.setattr(specserve.engine, "resolve_model", lambda model: files)
    common = dict(model="tiny.gguf", dtype="float32", block_size=4, num_kv_blocks=128)
    prompts = [[(5 * i + j) % 500 + 3 for i in range(12)] for j in range(3)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(**common)
    assert plain.engine.quantized_weights
    want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    for method in ("ngram", "layerskip"):
        llm = LLM(**common, speculative_method=method, num_speculative_tokens=3, speculative_adaptive=False)
        assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want, method
        assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks
    # A draft tree, one request at a time: its verify spans (tree masks) run in one parallel region.
    llm = LLM(**common, speculative_method="layerskip", num_speculative_tokens=3, speculative_adaptive=False,
              draft_tree_nodes=6)
    assert [llm.generate([p], params, use_tqdm=False)[0].token_ids for p in prompts] == want
    assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks


@needs_cpu_kernels
def test_the_quantized_self_draft_is_lossless(tmp_path, tiny_model_dir, monkeypatch):
    """``speculative_method='quantized'``: the target runs dequantised and drafts with its
    own blocks (a GGUF) or with its linears quantized to Q4_1 at load (a float checkpoint);
    greedy output equals the dequantised target's without speculation, drafts are accepted
    (nearly all from the file's own blocks), and every KV block comes back."""
    import specserve.drafts
    import specserve.engine

    files, _ = tiny_gguf(tmp_path)
    prompts = [[(5 * i + j) % 500 + 3 for i in range(12)] for j in range(3)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    spec = dict(speculative_method="quantized", num_speculative_tokens=3, speculative_adaptive=False)
    # The file's own blocks are the target's weights: nearly every draft is accepted. Q4_1 made
    # from a random 64-wide float model moves its logits much more (chance is about 0).
    cases = ((files, "Q4_K+Q4_0+Q4_1+Q6_K+Q8_0", 0.9), (ModelFiles("tiny", tiny_model_dir("llama")), "Q4_1", 0.25))
    for model, formats, accepted in cases:
        monkeypatch.setattr(specserve.engine, "resolve_model", lambda _: model)
        monkeypatch.setattr(specserve.drafts, "resolve_model", lambda _: model)
        common = dict(model="tiny", dtype="float32", block_size=4, num_kv_blocks=128)
        want = [o.token_ids for o in LLM(**common, gguf_weights="dequantized").generate(prompts, params, use_tqdm=False)]
        llm = LLM(**common, **spec)
        assert not llm.engine.quantized_weights  # the target runs dequantised
        draft = llm.engine.speculator.drafter.model
        assert sorted({f for m in draft.modules() for f in getattr(m, "formats", ())}) == sorted(formats.split("+"))
        assert draft.fused_cpu is not None
        assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
        stats = llm.engine.spec_stats
        assert stats.num_accepted_tokens >= accepted * stats.num_draft_tokens > 0, stats
        assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks
    with pytest.raises(ValueError, match="gguf_weights must not be 'quantized'"):
        EngineConfig(gguf_weights="quantized", **spec)


@needs_cpu_kernels
def test_a_draft_checkpoint_follows_its_quantized_target(tmp_path, monkeypatch):
    """``draft_quantization``: ``auto`` quantizes a float draft's linears to Q4_1 where the
    target runs from GGUF blocks (one C++ call per draft layer), not beside a float target;
    a kind named outright applies to either; greedy output equals speculation off's in every
    case, and every KV block comes back. Refused in one line where it cannot apply."""
    import specserve.drafts
    import specserve.engine

    files, _ = tiny_gguf(tmp_path)
    float_files = ModelFiles("tiny-float", files.path)  # the same model's dequantised weights, beside the file
    prompts = [[(5 * i + j) % 500 + 3 for i in range(12)] for j in range(3)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    spec = dict(speculative_method="draft_model", draft_model="draft", num_speculative_tokens=3,
                speculative_adaptive=False)
    monkeypatch.setattr(specserve.drafts, "resolve_model", lambda _: float_files)
    # (target's weights, draft_quantization, the draft layers' formats, least share of drafts
    # accepted: the draft is the target's own weights, which Q8_0 keeps, where 4 bits made
    # from a random model move its logits much more; chance is about 1 in 512)
    for gguf_weights, choice, want_formats, accepted in (
            ("auto", "auto", ["Q4_1"], 0.08), ("auto", "none", [], 0.8), ("auto", "Q8_0", ["Q8_0"], 0.8),
            ("dequantized", "auto", [], 0.8), ("dequantized", "Q4_0", ["Q4_0"], 0.08)):
        monkeypatch.setattr(specserve.engine, "resolve_model", lambda _: files)
        common = dict(model="tiny", dtype="float32", block_size=4, num_kv_blocks=128, gguf_weights=gguf_weights)
        want = [o.token_ids for o in LLM(**common).generate(prompts, params, use_tqdm=False)]
        llm = LLM(**common, **spec, draft_quantization=choice)
        draft = llm.engine.speculator.drafter.model
        formats = sorted({f for m in draft.model.layers.modules() for f in getattr(m, "formats", ())})
        assert formats == want_formats, (gguf_weights, choice)
        assert (draft.fused_cpu is not None) == bool(want_formats)
        assert ("layers in " in llm.engine.speculator.drafter.describe()) == bool(want_formats)
        assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want, (gguf_weights, choice)
        stats = llm.engine.spec_stats
        assert stats.num_accepted_tokens >= accepted * stats.num_draft_tokens > 0, (gguf_weights, choice, stats)
        assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks
    monkeypatch.setattr(specserve.engine, "resolve_model", lambda _: files)
    with pytest.raises(ValueError, match="draft_quantization must be one of"):
        EngineConfig(draft_quantization="Q5_K", speculative_method="draft_model")
    with pytest.raises(ValueError, match="needs speculative_method 'draft_model', not 'ngram'"):
        EngineConfig(draft_quantization="Q8_0", speculative_method="ngram")
    monkeypatch.setattr(specserve.drafts, "resolve_model", lambda _: files)  # a GGUF draft: its own blocks
    with pytest.raises(ValueError, match="is a GGUF file run from its own blocks"):
        LLM(model="tiny", dtype="float32", num_kv_blocks=128, **spec, draft_quantization="Q8_0")
    odd = tmp_path / "odd"  # inputs 48 wide
    make_hf_model("llama", hidden_size=48, num_attention_heads=3, num_key_value_heads=1).save_pretrained(odd)
    make_tokenizer(512).save_pretrained(odd)
    monkeypatch.setattr(specserve.drafts, "resolve_model", lambda _: ModelFiles("odd", odd))
    with pytest.raises(ValueError, match="input widths that are multiples of 32, got 48"):
        LLM(model="tiny", dtype="float32", num_kv_blocks=128, **spec, draft_quantization="Q8_0")
    llm = LLM(model="tiny", dtype="float32", num_kv_blocks=128, **spec)  # auto: runs it as it is
    assert not any(getattr(m, "formats", ()) for m in llm.engine.speculator.drafter.model.model.layers.modules())
    with monkeypatch.context() as patch:
        patch.setattr(specserve.drafts.cpu_ops, "available", lambda: False)
        with pytest.raises(ValueError, match="runs the draft on the C\\+\\+ CPU kernels"):
            LLM(model="tiny", dtype="float32", num_kv_blocks=128, **spec, draft_quantization="Q8_0")


@needs_cpu_kernels
def test_a_bf16_float_model_quantized_as_its_own_draft_runs_quantized(tmp_path, monkeypatch):
    """The quantized self-draft of a float checkpoint in bfloat16, where the CPU repacks
    bf16 linears for oneDNN: its layers are quantized before that repacking, so the draft
    runs Q4_1 (it once kept bf16 layers, having nothing left to quantize)."""
    import specserve.drafts
    import specserve.engine

    files, _ = tiny_gguf(tmp_path)
    model = ModelFiles("tiny-float", files.path)  # the dequantised weights beside the file
    monkeypatch.setattr(specserve.engine, "resolve_model", lambda _: model)
    monkeypatch.setattr(specserve.drafts, "resolve_model", lambda _: model)
    llm = LLM(model="tiny", dtype="bfloat16", num_kv_blocks=128, speculative_method="quantized")
    draft = llm.engine.speculator.drafter.model
    assert {f for m in draft.modules() for f in getattr(m, "formats", ())} == {"Q4_1"}
    assert draft.fused_cpu is not None


def test_what_cannot_run_quantized_is_refused_or_dequantized(tmp_path, tiny_model_dir, caplog, monkeypatch):
    """``quantized`` refuses in one line naming why; ``auto`` loads dequantised (exact
    too) and says why; ``dequantized`` never reads the blocks."""
    files, _ = tiny_gguf(tmp_path / "iq2", ffn_down="IQ2_XS")  # a format without a kernel (a grid codebook)
    with pytest.raises(ModelLoadError, match="IQ2_XS, which has no quantized CPU kernel"):
        quantized_gguf(files, "quantized", CPU)
    with caplog.at_level("INFO", logger="specserve"):
        assert not quantized_gguf(files, "auto", CPU)
    assert "IQ2_XS" in caplog.text
    plain = ModelFiles("tiny", tiny_model_dir("llama"))
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        quantized_gguf(plain, "quantized", CPU)
    assert not quantized_gguf(plain, "auto", CPU)
    ok, _ = tiny_gguf(tmp_path / "ok")
    import specserve.models.llama  # partial rotary: q/k rows would need reordering inside the blocks

    with monkeypatch.context() as patch:
        patch.setattr(specserve.models.llama, "rotary_order", lambda config: list(range(64)))
        with pytest.raises(ModelLoadError, match="partial rotary"):
            build_model(ok, load_hf_config(ok), torch.float32, CPU, TorchAttentionBackend(cpu_kernels=True),
                        quantized=True)
    assert not quantized_gguf(ok, "dequantized", CPU)
    swapped = GGUFCheckpoint(ok.gguf)
    swapped.reader.byte_order = "S"  # as the gguf reader marks a big-endian file here
    assert "big-endian" in swapped.refusal()
    with pytest.raises(ModelLoadError, match="run on the CPU, not cuda"):
        quantized_gguf(ok, "quantized", torch.device("cuda"))
    with pytest.raises(ModelLoadError, match="without tensor parallelism"):
        quantized_gguf(ok, "quantized", CPU, tp_size=2)
    with pytest.raises(ValueError, match="gguf_weights must be one of"):
        EngineConfig(gguf_weights="int4")


@needs_cpu_kernels
def test_the_default_model_runs_from_its_own_q4_1_file(default_model_path):
    """By default on a CPU: 210 Q4_1 linears and the Q8_0 tied head run quantized. Its
    next-token choices agree with transformers' on the dequantised weights (float32) at
    most positions of a chat answer, and the built-in draft still drafts for it."""
    from transformers import AutoModelForCausalLM

    llm = LLM(max_num_seqs=2, speculative_method="draft_model", num_speculative_tokens=4,
              speculative_adaptive=False)
    assert llm.engine.quantized_weights
    model = llm.engine.runner.model
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 121
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Explain the difference between a process and a thread."}],
        tokenize=False, add_generation_prompt=True)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), use_tqdm=False)[0]
    assert out.spec_stats.mean_acceptance_length >= 1.5
    hf = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    ids = out.prompt_token_ids + out.token_ids
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0, len(out.prompt_token_ids) - 1:-1].argmax(-1)
    agree = (want == torch.tensor(out.token_ids)).float().mean().item()
    assert agree >= 0.9, agree
