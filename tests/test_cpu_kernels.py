"""The C++ CPU kernels (``kernels/cpu_ops.cpp``) against their torch references, the model
and the engine with them against the torch path, and the fallback when they cannot load.

bf16: the norms, SiLU·mul and rotary round every intermediate where the references do, so
they match them bit for bit at decode sizes (a norm's fp32 sum order may flip a rare
rounding: within one bf16 step); attention sums in fp32 without rounding the softmax, so it
is within bf16 rounding of the reference. fp32: within 1e-5.
"""
from __future__ import annotations

import logging
import random

import pytest
import torch
from model_steps import chunked_prefill_logits
from paged_batches import make_batch
from specserve.kernels import cpu_ops, reference
from tiny_models import LLM32, VARIANTS

from specserve.attention import TorchAttentionBackend, get_backend
from specserve.loader import ModelFiles, build_model, load_hf_config
from specserve.models.layer_ops import CpuLayerOps, TorchLayerOps
from specserve.models.rotary import apply_rotary
from specserve.sampler import greedy_confidence, greedy_tokens
from specserve.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU kernels did not build here")

F32, BF16 = torch.float32, torch.bfloat16
BF16_STEP = 2 ** -7  # one bf16 rounding, relative


def randn(*shape, dtype=F32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(dtype)


def assert_matches(out, want, exact: bool):
    assert out.dtype == want.dtype and out.shape == want.shape
    if out.dtype == F32:
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    elif exact:
        assert torch.equal(out, want)
    else:
        torch.testing.assert_close(out.float(), want.float(), atol=1e-2, rtol=BF16_STEP)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_norms_match_reference(dtype, tokens):
    x, res = randn(tokens, 576, dtype=dtype, seed=1), randn(tokens, 576, dtype=dtype, seed=2)
    weight = (randn(576, seed=3).abs() + 0.5).to(dtype)
    exact = tokens < 100
    assert_matches(cpu_ops.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5), exact)
    normed, summed = cpu_ops.add_rms_norm(x, res, weight, 1e-5)
    want_normed, want_summed = reference.add_rms_norm(x, res, weight, 1e-5)
    assert torch.equal(summed, want_summed)  # the residual sum is rounded as the reference does
    assert_matches(normed, want_normed, exact)
    # A strided input (a row slice) reads the same values.
    wide = randn(tokens, 2 * 576, dtype=dtype, seed=4)
    assert_matches(cpu_ops.rms_norm(wide[:, :576], weight, 1e-5), reference.rms_norm(wide[:, :576], weight, 1e-5), exact)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_gemma_norms_match_reference(dtype, tokens):
    """Gemma's (1 + weight) norm, in fp32 and rounded once; weights near 0, as Gemma's are.
    Within one bf16 step: rounded once from fp32, a last-bit difference from torch's fp32
    rsqrt can round the other way."""
    x, res = randn(tokens, 640, dtype=dtype, seed=1), randn(tokens, 640, dtype=dtype, seed=2)
    weight = (randn(640, seed=3) * 0.1).to(dtype)
    exact = False
    assert_matches(cpu_ops.gemma_rms_norm(x, weight, 1e-6), reference.gemma_rms_norm(x, weight, 1e-6), exact)
    normed, summed = cpu_ops.gemma_add_rms_norm(x, res, weight, 1e-6)
    want_normed, want_summed = reference.gemma_add_rms_norm(x, res, weight, 1e-6)
    assert torch.equal(summed, want_summed)
    assert_matches(normed, want_normed, exact)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_act_and_mul_matches_reference(dtype, act):
    gate_up = randn(7, 2 * 1536, dtype=dtype, seed=5, scale=3.0)
    op, ref = getattr(cpu_ops, f"{act}_and_mul"), getattr(reference, f"{act}_and_mul")
    assert_matches(op(gate_up), ref(gate_up), exact=act == "silu")


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_silu_and_mul_equals_torch_for_every_16_bit_gate(dtype):
    """The kernel's own exp (vectorised) gives torch's SiLU bit for bit for every 16-bit
    value the gate can take, infinities and NaNs included, and the product with up as
    torch rounds it; split over threads at any size, as one row or many."""
    gate = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    for up_value in (1.0, -0.7, 3.0):
        for rows in (1, 64):
            g = gate.view(rows, -1)
            up = torch.full_like(g, up_value)
            got = cpu_ops.silu_and_mul(torch.cat([g, up], 1))
            want = torch.nn.functional.silu(g) * up
            same = (got.view(torch.int16) == want.view(torch.int16)) | (got.isnan() & want.isnan())
            assert same.all(), (dtype, up_value, rows, g[~same][:4])


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 2, 16), (5, 1, 80)])
def test_rotary_store_kv_matches_reference(dtype, heads):
    num_heads, num_kv, dim = heads
    tokens = 6
    qkv = randn(tokens, num_heads + 2 * num_kv, dim, dtype=dtype, seed=6)
    qk, value = qkv[:, :num_heads + num_kv], qkv[:, num_heads + num_kv:]  # strided, as in the model
    angles = randn(tokens, dim // 2, seed=7, scale=4.0)
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1)[:, None].to(dtype)
    sin = torch.stack((-angles.sin(), angles.sin()), dim=1)[:, None].to(dtype)
    slots = torch.tensor([17, -1, 3, 40, 41, 0])
    caches = [torch.zeros(8, 8, num_kv, dim, dtype=dtype) for _ in range(4)]
    q = cpu_ops.rotary_store_kv(qk, value, cos, sin, caches[0], caches[1], slots)
    rotated = apply_rotary(qk, cos, sin)
    reference.store_kv(rotated[:, num_heads:], value, caches[2], caches[3], slots)
    assert_matches(q, rotated[:, :num_heads].contiguous(), exact=True)
    assert_matches(caches[0], caches[2], exact=True)
    assert torch.equal(caches[1], caches[3])  # values are copied
    assert q.is_contiguous()


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("long_rope", [False, True])
def test_rotary_tables_are_the_torch_paths(dtype, long_rope):
    """The C++ op's cos / signed-sin tables are Rotary.forward's (shapes, the long
    frequencies from ``long_offset`` on under LongRoPE): bf16 bit for bit here, float32
    within a float's last bits (the C library's cos and sin against torch's vectorised
    ones). Long mode under the short frequencies would move them by up to 2.3."""
    from transformers import LlamaConfig, Phi3Config

    from specserve.models.rotary import Rotary

    if long_rope:
        half = 8
        config = Phi3Config(hidden_size=64, num_attention_heads=4, max_position_embeddings=64,
                            original_max_position_embeddings=16,
                            rope_scaling={"type": "longrope", "short_factor": [1.0 + i / 10 for i in range(half)],
                                          "long_factor": [2.0 + i for i in range(half)]})
    else:
        config = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=10000.0)
    rotary = Rotary(config)
    assert bool(rotary.long_offset) is long_rope
    positions = torch.tensor([0, 1, 7, 15, 31, 63])
    if long_rope:
        positions = torch.cat([positions, positions + rotary.long_offset])
    want_cos, want_sin = rotary(positions, dtype)
    cos, sin = cpu_ops.rotary_tables(rotary, positions, dtype)
    assert cos.shape == want_cos.shape and sin.shape == want_sin.shape and cos.dtype == sin.dtype == dtype
    assert_matches(cos, want_cos, exact=True)
    assert_matches(sin, want_sin, exact=True)
    if long_rope:  # the long rows differ from the short ones'
        short = len(positions) // 2
        assert not torch.equal(cos[short:], cos[:short])


def test_rotary_store_kv_refuses_a_slot_outside_the_cache():
    qk, value = randn(2, 3, 16), randn(2, 1, 16)
    cos, sin = torch.ones(2, 16), torch.zeros(2, 16)
    k_cache, v_cache = torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_ops.rotary_store_kv(qk, value, cos, sin, k_cache, v_cache, torch.tensor([0, 8]))
    assert not k_cache.any()  # checked before anything is written


def random_spans(seed: int) -> list[tuple[int, int]]:
    """(query len, kv len) per request: decode rows, verify spans and prefill spans (> 16)."""
    rng = random.Random(seed)
    query_lens = [rng.choice([1, 1, 2, 5, 16, 17, 40]) for _ in range(rng.randint(1, 6))]
    return [(q, q + rng.randint(0, 150)) for q in query_lens]


def paged_batch(spans, dtype, seed: int = 0):
    """SmolLM2's heads (9 query, 3 KV, 64 wide) over 16-token blocks; unowned slots NaN."""
    return make_batch(spans, 9, 3, 64, 16, dtype, torch.device("cpu"), num_blocks=128, seed=seed)


def attend_short(b, window=None, max_span=reference.SHORT_SPAN, softcap=None) -> torch.Tensor:
    out = torch.full_like(b.query, float("nan"))
    cpu_ops.paged_attention_short(b.query, b.k_cache, b.v_cache, b.block_tables, b.cu_query_lens,
                                  b.seq_lens, 0.125, window, max_span, out, softcap)
    return out


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("window, softcap", [(None, None), (7, None), (None, 0.5), (7, 0.5)])
@pytest.mark.parametrize("seed", range(4))
def test_paged_attention_short_matches_reference(dtype, window, softcap, seed):
    """Against the reference on random ragged batches; NaN in every slot a request does
    not own, so reading past a request's length or into another's block shows."""
    b = paged_batch(random_spans(seed), dtype, seed)
    want = reference.paged_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.query_lens_host,
                                     b.seq_lens_host, 0.125, window, softcap=softcap)
    out = attend_short(b, window, softcap=softcap)
    short = torch.cat([torch.full((n,), n <= reference.SHORT_SPAN) for n in b.query_lens_host])
    assert torch.isnan(out[~short]).all()  # long spans are left to the caller
    if dtype == F32:
        torch.testing.assert_close(out[short], want[short], atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(out[short].float(), want[short].float(), atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_a_rows_attention_is_the_same_alone_and_in_a_verify_span(dtype):
    """A decode row (3 query vectors per KV head: the narrow pack of 8 lanes), the rows of
    a 2-row span (6: narrow) and of a 5-row span (15: the pack of 16) compute each lane
    alike: every row of a span attends bitwise as it does alone at its position."""
    generator = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(12, 16, 3, 64, generator=generator).to(dtype) for _ in range(2))
    table = torch.randperm(12, generator=generator).to(torch.int32)[None]
    query = torch.randn(5, 9, 64, generator=generator).to(dtype)

    def attend(rows: torch.Tensor, seq_len: int) -> torch.Tensor:
        out = torch.full_like(rows, float("nan"))
        cpu_ops.paged_attention_short(rows, k_cache, v_cache, table, torch.tensor([0, len(rows)]),
                                      torch.tensor([seq_len]), 0.125, None, reference.SHORT_SPAN, out)
        return out

    for seq_len in (5, 70, 190):
        for q_len in (2, 5):
            span = attend(query[5 - q_len:], seq_len)
            for i in range(q_len):
                alone = attend(query[5 - q_len + i:6 - q_len + i], seq_len - q_len + 1 + i)
                assert torch.equal(span[i], alone[0]), (seq_len, q_len, i)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("window, softcap", [(None, None), (70, 0.5)])
def test_attention_is_the_same_on_one_thread_and_split_across_two(dtype, window, softcap):
    """Keys are taken 64 positions at a time. With few spans, two threads split them by
    chunk and the last to finish folds the chunks; one thread takes each span's chunks in
    turn. Both fold in position order, to the same bits, and match the reference: decode
    rows, verify spans and a prefill span over 1 to 5 chunks, one and two requests."""
    threads = torch.get_num_threads()
    try:
        # The last: a prefill span, as the deterministic mode sends any span here (rows
        # before a chunk skip it).
        for seed, spans in enumerate(([(1, 300)], [(1, 64)], [(2, 65)], [(5, 190)], [(1, 20), (3, 250)],
                                      [(100, 190)])):
            b = paged_batch(spans, dtype, seed)
            outs = []
            for n in (1, 2):
                torch.set_num_threads(n)
                outs.append(attend_short(b, window, max_span=1 << 30, softcap=softcap))
            assert torch.equal(outs[0], outs[1]), spans
            want = reference.paged_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.query_lens_host,
                                             b.seq_lens_host, 0.125, window, softcap=softcap)
            tol = 1e-5 if dtype == F32 else 1.6e-2
            torch.testing.assert_close(outs[1].float(), want.float(), atol=tol, rtol=tol)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("vocab", [49152, 1000])
def test_greedy_rows_are_torch_argmax_and_the_softmax_top(dtype, vocab):
    """Ties, a restricted vocabulary (-inf elsewhere), an all -inf row and NaNs give
    torch.argmax's index; the confidence is softmax's top probability, NaN where
    softmax's is."""
    logits = torch.randn(7, vocab, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[1, 100] = logits[1, vocab - 3] = logits[1].max() + 1  # a tie: the first
    logits[2] = float("-inf")
    logits[2, 700] = 0.5                                          # one token allowed
    logits[3] = float("-inf")                                     # none: index 0
    logits[4, 7] = logits[4, 9] = float("nan")                    # the first NaN
    logits[5, :100] = 1e4                                         # ties across blocks
    logits[6, vocab - 1] = 50.0                                   # in the last, partial block
    index, top = torch.ops.specserve_cpu.greedy_rows(logits, True)
    assert torch.equal(index, logits.argmax(dim=-1))
    want = torch.softmax(logits.float(), dim=-1).gather(1, index[:, None])[:, 0]
    assert torch.equal(torch.isnan(top), torch.isnan(want))
    torch.testing.assert_close(top[~torch.isnan(want)], want[~torch.isnan(want)], rtol=1e-5, atol=0)
    tokens, confidence = greedy_confidence(logits)
    assert torch.equal(tokens, index) and torch.equal(greedy_tokens(logits), index)
    torch.testing.assert_close(confidence, top, rtol=0, atol=0, equal_nan=True)


def test_paged_attention_short_refuses_a_block_outside_the_cache():
    b = paged_batch([(1, 20), (3, 40)], F32)
    b.block_tables[1, 0] = b.k_cache.shape[0]
    with pytest.raises(RuntimeError, match="outside the cache"):
        attend_short(b)


def test_backend_attends_mixed_batches_like_the_reference():
    """The torch backend with the kernels: short spans in C++, long ones by the plan."""
    from specserve.batch import ForwardBatch

    b = paged_batch([(1, 70), (40, 90), (5, 5), (17, 17), (2, 130)], F32)
    n = len(b.query)
    batch = ForwardBatch(input_ids=torch.zeros(n), positions=torch.zeros(n), slot_mapping=torch.zeros(n),
                         block_tables=b.block_tables, cu_query_lens=b.cu_query_lens, seq_lens=b.seq_lens,
                         logits_indices=torch.zeros(1), query_lens_host=b.query_lens_host,
                         seq_lens_host=b.seq_lens_host)
    got = TorchAttentionBackend(cpu_kernels=True).attend(b.query, b.k_cache, b.v_cache, batch, 0.125, None)
    want = reference.paged_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.query_lens_host,
                                     b.seq_lens_host, 0.125)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------- the model
def test_cpu_backend_chooses_the_kernels(tiny_model_dir, monkeypatch):
    files = ModelFiles("tiny", tiny_model_dir("llama"))
    config = load_hf_config(files)
    backend = get_backend("auto", torch.device("cpu"))
    assert backend.cpu_kernels
    # Each span attends its own rows: nothing is padded (the step-cost model counts padding).
    assert backend.padded_span == 0 and TorchAttentionBackend().padded_span == reference.SHORT_SPAN
    model = build_model(files, config, F32, torch.device("cpu"), backend)
    assert type(model.model.ops) is CpuLayerOps
    monkeypatch.setattr(cpu_ops, "available", lambda: False)
    model = build_model(files, config, F32, torch.device("cpu"), get_backend("torch", torch.device("cpu")))
    assert type(model.model.ops) is TorchLayerOps


@pytest.mark.parametrize("chunk", [5, 20])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_model_logits_with_kernels_equal_torch(tiny_model_dir, variant, chunk):
    """Every architecture variant (qk-norm, llama3 rope, bias, sliding window, tied GQA),
    prefill chunks (short spans of 5 in C++; spans of 20 by the plan) and decode rows in
    ragged steps: logits within 1e-4 of the torch ops."""
    files = ModelFiles("tiny", tiny_model_dir(variant))
    config = load_hf_config(files)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (23, 1, 9, 14, 30)]
    logits = {}
    for kernels in (False, True):
        model = build_model(files, config, F32, torch.device("cpu"), TorchAttentionBackend(cpu_kernels=kernels))
        logits[kernels] = chunked_prefill_logits(model, prompts, chunk=chunk, device=torch.device("cpu"))
    assert (logits[True] - logits[False]).abs().max().item() < 1e-4, variant


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ENGINE = dict(max_num_batched_tokens=24, max_num_seqs=4, block_size=16, num_kv_blocks=32,
              speculative_method="ngram", num_speculative_tokens=3)


@pytest.mark.parametrize("variant", ["smollm2_tied_gqa3", "qwen3_qknorm", "mistral_window"])
def test_engine_greedy_tokens_with_kernels_equal_torch_ops(tiny_model_dir, variant, monkeypatch):
    """Prefill chunks sharing steps with decode rows and verify spans: the same greedy
    tokens in fp32 with the kernels as with the torch ops, and no block left behind."""
    prompts = [[5, 9, 11, 5, 9, 11, 5, 9], list(range(3, 60)), [7], [4, 4, 4, 4]]
    outputs = {}
    for kernels in (True, False):
        monkeypatch.setattr(cpu_ops, "available", lambda kernels=kernels: kernels)
        llm = LLM32(str(tiny_model_dir(variant)), attention_backend="torch", **ENGINE)
        assert llm.engine.runner.model.attention_backend.cpu_kernels is kernels
        outputs[kernels] = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert llm.engine.num_free_blocks == llm.engine.runner.num_blocks
    assert outputs[True] == outputs[False]


# ---------------------------------------------------------------------------- fallback
def test_unavailable_when_switched_off_or_the_build_fails(monkeypatch, caplog):
    undecorated = cpu_ops.available.__wrapped__
    monkeypatch.setenv(cpu_ops.ENV_SWITCH, "0")
    assert undecorated() is False
    monkeypatch.delenv(cpu_ops.ENV_SWITCH)

    from torch.utils import cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    with caplog.at_level(logging.WARNING, logger="specserve"):
        assert undecorated() is False
    assert "CPU kernels unavailable" in caplog.text and "Ninja is required" in caplog.text


def test_a_build_lock_left_by_a_killed_build_is_removed_not_waited_on():
    """torch's loader marks a build with a ``lock`` file only the builder removes; one
    left by a build killed midway made every later process wait forever."""
    import subprocess
    import sys
    from pathlib import Path

    from torch.utils import cpp_extension

    name, _ = cpu_ops.build_name_and_flags()
    stale = Path(cpp_extension._get_build_directory(name, verbose=False)) / "lock"
    stale.touch()
    try:
        check = "from specserve.kernels import cpu_ops\nassert cpu_ops.available()"
        done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=600,
                              check=False)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "did not finish" in done.stderr and not stale.exists()
    finally:
        stale.unlink(missing_ok=True)


def test_a_first_build_says_why_the_start_waits(monkeypatch, caplog, tmp_path):
    """No built library in the build folder: one line before the compile; one there: none."""
    from torch.utils import cpp_extension

    name, _ = cpu_ops.build_name_and_flags()
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda *a, **kw: str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", lambda *a, **kw: None)  # the ops are loaded already
    for built in (False, True):
        if built:
            (tmp_path / f"{name}.so").touch()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="specserve"):
            assert cpu_ops.available.__wrapped__() is True
        assert ("compiling the C++ CPU kernels" in caplog.text) is not built
