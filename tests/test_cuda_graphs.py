"""The CUDA-graph path's padding, checked eagerly on CPU: decode/verify steps padded to a
batch bucket and to one query length per step must give exactly the unpadded results."""
from __future__ import annotations

import pytest

from specserve import SamplingParams
from specserve.cuda_graphs import batch_buckets
from tiny_models import LLM32

PROMPTS = ["a b c a b c a b c a b c", "def f(x): return x\ndef f(x):", "hello", "x = 1\ny = 2\nx = 1\n",
           "import os\nimport sys\nimport os\n"]


def test_batch_buckets_end_at_max_num_seqs():
    assert batch_buckets(1) == [1]
    assert batch_buckets(10) == [1, 2, 4, 8, 10]
    assert batch_buckets(64)[-1] == 64 and len(set(batch_buckets(64))) == len(batch_buckets(64))


@pytest.mark.parametrize("variant", ["llama", "mistral_window"])
@pytest.mark.parametrize("method", ["none", "ngram"])
def test_padded_graph_path_equals_eager(tiny_model_dir, variant, method):
    kwargs = dict(block_size=4, num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=64,
                  speculative_method=method, num_speculative_tokens=4,
                  speculative_adaptive=False)  # drafts every step: the padded verify shapes
    eager = LLM32(str(tiny_model_dir(variant)), **kwargs)
    padded = LLM32(str(tiny_model_dir(variant)), **kwargs)
    runner = padded.engine.runner
    runner.enable_graphs(5 if method == "ngram" else 1, padded.engine.max_model_len, capture=False)
    calls = []
    run = runner.graphs.run
    runner.graphs.run = lambda *a: calls.append(len(a[0].scheduled)) or run(*a)
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=3, max_tokens=30, ignore_eos=True)]
    for p in params:
        want = eager.generate(PROMPTS, p, use_tqdm=False)
        got = padded.generate(PROMPTS, p, use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert calls and 5 in calls and any(n not in batch_buckets(8) for n in calls)  # 5 -> bucket 8
    if method == "ngram":
        assert padded.engine.spec_stats.num_drafts > 0
    assert padded.engine.num_free_blocks == padded.engine.kv.num_blocks


def test_padding_rows_never_reach_the_cache(tiny_model_dir):
    llm = LLM32(str(tiny_model_dir("llama")), block_size=4, num_kv_blocks=64, max_num_seqs=4,
                speculative_method="ngram", num_speculative_tokens=3)
    runner = llm.engine.runner
    runner.enable_graphs(4, llm.engine.max_model_len, capture=False)
    for k, v in runner.kv_caches:
        k.fill_(float("nan"))
        v.fill_(float("nan"))
    # Every real slot is written before it is read; NaN anywhere else must not leak in.
    out = llm.generate(["a b a b a b a b"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0]
    ref = LLM32(str(tiny_model_dir("llama")), block_size=4, num_kv_blocks=64).generate(
        ["a b a b a b a b"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    assert out.token_ids == ref.token_ids
