"""Host -> device moves: the packed pinned-buffer path that CUDA takes, run on the CPU with
an ordinary buffer standing in for the pinned one, gives what the direct path gives —
alone and under a whole engine (graphs' padded path, a draft model's device-resident
proposals, the sampler)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve import SamplingParams, transfer
from tiny_models import LLM32

CPU = torch.device("cpu")


@pytest.fixture
def packed(monkeypatch):
    """Take the CUDA path (one packed buffer, one copy) on the CPU."""
    monkeypatch.setattr(transfer, "_packs", lambda device: True)
    monkeypatch.setattr(transfer, "pinned", lambda size, dtype: torch.empty(size, dtype=dtype))


def arrays():
    return [[5, 6, 7], np.arange(6).reshape(2, 3), [], np.array([9], np.int32)]


@pytest.mark.parametrize("pack", [False, True])
def test_to_device_keeps_values_and_shapes(request, pack):
    if pack:
        request.getfixturevalue("packed")
    for dtype in (torch.int64, torch.int32, torch.float32):
        out = transfer.to_device(arrays(), dtype, CPU)
        assert [t.dtype for t in out] == [dtype] * 4
        assert [tuple(t.shape) for t in out] == [(3,), (2, 3), (0,), (1,)]
        assert out[0].tolist() == [5, 6, 7] and out[1].tolist() == [[0, 1, 2], [3, 4, 5]]
        assert out[3].tolist() == [9]


def test_each_packed_array_starts_16_byte_aligned(packed):
    """Triton compiles a kernel anew for each pattern of 16-byte-aligned pointers: however
    long the arrays before it, each packed array starts aligned (the buffer's start is)."""
    for dtype in (torch.int64, torch.int32, torch.float32, torch.bool):
        for lengths in ([1, 3, 2], [5, 1, 7, 9], [0, 1, 0, 3], [17, 33]):
            out = transfer.to_device([list(range(n)) for n in lengths], dtype, CPU)
            base = out[0].untyped_storage().data_ptr()
            assert base % transfer.ALIGN_BYTES == 0
            assert [(t.data_ptr() - base) % transfer.ALIGN_BYTES for t in out] == [0] * len(lengths)
            assert [t.tolist() for t in out] == [torch.arange(n).to(dtype).tolist() for n in lengths]


@pytest.mark.parametrize("pack", [False, True])
def test_copy_into_writes_the_arrays_back_to_back(request, pack):
    if pack:
        request.getfixturevalue("packed")
    static = torch.full((16,), -1, dtype=torch.int64)
    transfer.copy_into(static, arrays())
    assert static.tolist() == [5, 6, 7, 0, 1, 2, 3, 4, 5, 9] + [-1] * 6


def test_an_engine_on_the_packed_path_gives_the_direct_paths_tokens(tiny_model_dir, request):
    target = str(tiny_model_dir("llama"))
    engine = dict(block_size=4, num_kv_blocks=128, max_num_seqs=4, max_num_batched_tokens=32,
                  speculative_method="draft_model", draft_model=target, num_speculative_tokens=3)
    prompts = ["a b c a b c a b", "def f(x): return x", "hello"]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, num_speculative_tokens=k)
              for k in (3, 1, 3)]
    params += [SamplingParams(temperature=0.8, seed=i, max_tokens=12, ignore_eos=True) for i in range(3)]
    want = LLM32(target, **engine).generate(prompts * 2, params, use_tqdm=False)  # direct, eager
    request.getfixturevalue("packed")
    for graphs in (False, True):
        llm = LLM32(target, **engine)
        if graphs:
            llm.engine.enable_graphs(capture=False)
        got = llm.generate(prompts * 2, params, use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert llm.engine.spec_stats.acceptance_rate > 0.99
