"""The CPU bf16 fast path: prepacked oneDNN linears against plain bf16 linears."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from specserve.models.packed_linear import PackedLinear, bf16_packing_supported, pack_linears
from tiny_models import LLM32

needs_packing = pytest.mark.skipif(not bf16_packing_supported(),
                                   reason="this CPU has no native bf16 GEMM (AMX / AVX-512 BF16)")


@needs_packing
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_packed_linear_matches_linear(bias, rows):
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=bias).to(torch.bfloat16)
    x = torch.randn(rows, 96).to(torch.bfloat16)
    want = (x.float() @ linear.weight.float().T + (linear.bias.float() if bias else 0))
    got = PackedLinear(linear)(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 200)
    assert torch.allclose(got.float(), want, atol=0.05, rtol=0.02)


@needs_packing
def test_pack_linears_replaces_every_linear():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4))).to(torch.bfloat16)
    assert pack_linears(model) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())


@needs_packing
def test_bf16_engine_agrees_with_float32(tiny_model_dir):
    """The auto dtype on this CPU: bf16 logits follow fp32 closely enough that greedy
    outputs agree for most of a short continuation."""
    from specserve import LLM, SamplingParams

    path = str(tiny_model_dir("llama"))
    bf16 = LLM(path, num_kv_blocks=64, block_size=4, device="cpu")
    assert bf16.engine.dtype == torch.bfloat16
    assert any(isinstance(m, PackedLinear) for m in bf16.engine.runner.model.modules())
    fp32 = LLM32(path, num_kv_blocks=64, block_size=4, device="cpu")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [100, 200, 300]]
    a = [o.token_ids for o in bf16.generate(prompts, params, use_tqdm=False)]
    b = [o.token_ids for o in fp32.generate(prompts, params, use_tqdm=False)]
    assert all(x[:2] == y[:2] for x, y in zip(a, b))
