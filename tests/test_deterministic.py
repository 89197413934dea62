"""The deterministic mode (``deterministic=True``): in bf16, a request's tokens and
log-probabilities are bitwise the same alone, inside a batch, split by chunked prefill,
with any drafter at any draft length, and from run to run.

The tiny target here has a wide MLP (K = 2048 in its down projection): at that width
oneDNN's bf16 GEMM sums a row differently when it is alone than beside others, and without
the mode speculative greedy decoding of these prompts drifts from plain greedy decoding.
"""
from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.config import EngineConfig
from specserve.errors import SpecserveError
from specserve.kernels import cpu_ops
from tiny_models import make_eagle_head, make_hf_model, save_perturbed

ON_GPU = torch.cuda.is_available()  # there the engine tests run on CUDA: Triton kernels, CUDA graphs
needs_cpu_kernels = pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU kernels did not build")
pytestmark = pytest.mark.skipif(not ON_GPU and not cpu_ops.available(), reason="the C++ CPU kernels did not build")

BF16 = dict(dtype="bfloat16", deterministic=True, block_size=4, num_kv_blocks=800, max_num_seqs=16)


def params(max_tokens: int = 32, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3, **kwargs)


def prompts(count: int = 16) -> list[list[int]]:
    """Mixed lengths (1 to 60 tokens), each ending with a repeat of its start for n-gram matches."""
    g = torch.Generator().manual_seed(11)
    out = []
    for i in range(count):
        base = torch.randint(3, 500, (1 + (i * 37) % 40,), generator=g).tolist()
        out.append(base + base[: len(base) // 2])
    return out


def results(outputs) -> list[tuple]:
    """What must be bitwise equal: tokens, and every logprob with its top alternatives."""
    return [(o.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs]) for o in outputs]


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory, tiny_tokenizer):
    path = tmp_path_factory.mktemp("tiny-wide")
    make_hf_model("llama", intermediate_size=2048).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def baseline(wide_dir):
    """Speculation off, each prompt alone, its whole prompt in one prefill chunk."""
    llm = LLM(wide_dir, max_num_batched_tokens=512, **BF16)
    return [results(llm.generate([p], params(), use_tqdm=False))[0] for p in prompts()]


# ------------------------------------------------------------------ kernels
@needs_cpu_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(576, 1536), (100, 64), (40, 2048)])
def test_cpu_linear_rows_do_not_depend_on_the_batch(dtype, shape):
    from specserve.models.invariant import InvariantLinear

    n, k = shape
    torch.manual_seed(0)
    linear = torch.nn.Linear(k, n, bias=True).to(dtype)
    layer = InvariantLinear(linear)
    x = torch.randn(37, k).to(dtype)
    full = layer(x)
    want = torch.nn.functional.linear(x.double(), linear.weight.double(), linear.bias.double())
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(full.double(), want, rtol=tol, atol=tol * want.abs().max().item())
    for m in (1, 2, 3, 5, 8, 17, 36):  # every row-tile tail, alone and in blocks
        assert torch.equal(layer(x[:m]), full[:m]), m
        assert torch.equal(layer(x[m:m + 1]), full[m:m + 1]), m
    assert layer(x[:0]).shape == (0, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matmul_rows_do_not_depend_on_the_batch(dtype):
    """Compiled on a GPU; under the Triton interpreter on a CPU."""
    pytest.importorskip("triton")
    from specserve.kernels import matmul

    device = torch.device("cuda" if ON_GPU else "cpu")
    g = torch.Generator(device=device).manual_seed(0)
    n, k = (4096, 1536) if ON_GPU else (40, 96)
    w = torch.randn(n, k, device=device, generator=g).to(dtype)
    b = torch.randn(n, device=device, generator=g).to(dtype)
    x = torch.randn(70, k, device=device, generator=g).to(dtype)
    full = matmul.linear(x, w, b)
    want = torch.nn.functional.linear(x.double(), w.double(), b.double())
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert torch.allclose(full.double(), want, rtol=tol, atol=tol * want.abs().max().item())
    for m in (1, 3, 64, 65):
        assert torch.equal(matmul.linear(x[:m], w, b), full[:m])
        assert torch.equal(matmul.linear(x[m:m + 1], w, b), full[m:m + 1])


# ------------------------------------------------------------------ engine
def test_a_request_gives_the_same_logprobs_alone_in_a_batch_and_chunked(wide_dir, baseline):
    batch = prompts()
    together = LLM(wide_dir, max_num_batched_tokens=512, enable_prefix_caching=False, **BF16)
    assert results(together.generate(batch, params(), use_tqdm=False)) == baseline
    chunked = LLM(wide_dir, max_num_batched_tokens=16, **BF16)  # prompts prefill in chunks beside decodes
    assert results(chunked.generate(batch, params(), use_tqdm=False)) == baseline
    if ON_GPU:  # the baseline replayed CUDA graphs (padded batches); eager steps give the same
        eager = LLM(wide_dir, max_num_batched_tokens=16, enforce_eager=True, **BF16)
        assert results(eager.generate(batch, params(), use_tqdm=False)) == baseline
    # Prompt logprobs too: a prompt prefilled whole, or in chunks of 16 with others.
    want = LLM(wide_dir, max_num_batched_tokens=512, **BF16).generate(
        [batch[9]], params(4, prompt_logprobs=2), use_tqdm=False)[0].prompt_logprobs
    got = [o.prompt_logprobs for o in chunked.generate(batch[8:12], params(4, prompt_logprobs=2), use_tqdm=False)]
    assert len(want) == len(batch[9]) - 1 and got[1] == want


@pytest.fixture(scope="module")
def drafters(wide_dir, tmp_path_factory):
    near = save_perturbed(wide_dir, tmp_path_factory.mktemp("wide-near"), 0.004)
    head, _ = make_eagle_head(wide_dir, [1], tmp_path_factory.mktemp("wide-eagle"))
    return {"ngram": dict(speculative_method="ngram"),
            "layerskip": dict(speculative_method="layerskip", layerskip_layers=1),
            "draft_model": dict(speculative_method="draft_model", draft_model=near),
            "eagle": dict(speculative_method="draft_model", draft_model=head)}


@pytest.mark.parametrize("adaptive", [False, True], ids=["k4", "adaptive"])
@pytest.mark.parametrize("drafter", ["ngram", "layerskip", "draft_model", "eagle"])
def test_greedy_with_every_drafter_equals_speculation_off_bitwise(drafter, adaptive, drafters, wide_dir, baseline):
    llm = LLM(wide_dir, max_num_batched_tokens=32, num_speculative_tokens=4, speculative_adaptive=adaptive,
              **drafters[drafter], **BF16)
    assert results(llm.generate(prompts(), params(), use_tqdm=False)) == baseline
    engine = llm.engine
    if not adaptive:  # adaptive: whatever k the controller picks from measured timings, even none
        assert engine.spec_stats.num_accepted_tokens > 0
    assert engine.num_free_blocks == engine.kv.num_blocks


def test_twenty_repeats_on_one_engine_give_one_text(wide_dir, baseline):
    llm = LLM(wide_dir, max_num_batched_tokens=32, speculative_method="ngram", **BF16)
    prompt = prompts()[5]
    runs = {repr(results(llm.generate([prompt], params(), use_tqdm=False))) for _ in range(20)}
    assert runs == {repr([baseline[5]])}


@pytest.mark.parametrize("variant", ["mistral_window", "gemma2", "phi4_mini_partial", "qwen2_moe_shared"])
def test_families_stay_invariant(variant, tiny_model_dir):
    """Sliding windows, soft-capping, partial rotary and routed experts: speculation in
    small chunks beside other requests equals each prompt alone."""
    path = str(tiny_model_dir(variant))
    batch = [p[:30] for p in prompts(6)]
    alone = LLM(path, max_num_batched_tokens=512, **BF16)
    want = [results(alone.generate([p], params(20), use_tqdm=False))[0] for p in batch]
    spec = LLM(path, max_num_batched_tokens=16, speculative_method="ngram", speculative_adaptive=False, **BF16)
    assert results(spec.generate(batch, params(20), use_tqdm=False)) == want


def test_the_default_model_with_the_built_in_draft_and_ngram(default_model_path):  # (converted once)
    texts = ["Explain how a hash table works, step by step.", "Write a Python function that reverses a list.",
             "What is the capital of France?"]
    common = dict(deterministic=True, dtype="bfloat16", max_num_batched_tokens=64)
    alone = LLM(**common)
    want = [results(alone.generate([t], params(40), use_tqdm=False))[0] for t in texts]
    for spec in (dict(speculative_method="draft_model"), dict(speculative_method="ngram")):
        llm = LLM(**spec, **common)
        assert results(llm.generate(texts, params(40), use_tqdm=False)) == want


# ------------------------------------------------------------------ refusals
@needs_cpu_kernels
def test_what_the_mode_cannot_promise_is_refused(monkeypatch):
    with pytest.raises(SpecserveError, match="tensor_parallel_size 1 or 2"):
        EngineConfig(deterministic=True, tensor_parallel_size=4, device="cpu")
    with pytest.raises(SpecserveError, match="not float16"):
        EngineConfig(deterministic=True, dtype="float16", device="cpu")
    with pytest.raises(SpecserveError, match="true or false"):
        EngineConfig(deterministic="yes")
    from specserve.attention import TorchAttentionBackend

    with pytest.raises(SpecserveError, match="needs the C\\+\\+ CPU kernels"):
        TorchAttentionBackend(cpu_kernels=False, deterministic=True)
