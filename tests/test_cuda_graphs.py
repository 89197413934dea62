"""The CUDA-graph paths' padding, checked eagerly on CPU: decode/verify steps padded to a
batch bucket and to one query length per step, and steps with prefill chunks laid out
ragged up to a token bucket, must give exactly the unpadded results."""
from __future__ import annotations

import pytest

from specserve import SamplingParams
from specserve.cuda_graphs import MAX_RAGGED_TOKENS, batch_buckets, graph_logits_rows, token_buckets
from specserve.scheduler import ScheduledRequest
from tiny_models import LLM32

PROMPTS = ["a b c a b c a b c a b c", "def f(x): return x\ndef f(x):", "hello", "x = 1\ny = 2\nx = 1\n",
           "import os\nimport sys\nimport os\n"]


def test_batch_buckets_end_at_max_num_seqs():
    assert batch_buckets(1) == [1]
    assert batch_buckets(10) == [1, 2, 4, 8, 10]
    assert batch_buckets(64)[-1] == 64 and len(set(batch_buckets(64))) == len(batch_buckets(64))


def test_token_buckets_end_at_the_budget():
    assert token_buckets(0) == []
    assert token_buckets(20) == [16, 20]
    assert token_buckets(512) == [16, 32, 64, 128, 192, 256, 384, 512]
    assert token_buckets(100_000)[-1] == MAX_RAGGED_TOKENS


def test_graph_outputs_are_counted_row_by_row():
    """What the GPU memory budget reserves for the graphs' kept logits: every padded
    graph's bucket x q rows, and every ragged graph's sampled rows (one per request, and
    1 + k per request). The default model with k = 4 and a 512-token budget: 3,165 +
    1,648 rows, ~1.4 GB of fp32 + bf16."""
    assert graph_logits_rows(64, 5, 512) == sum(batch_buckets(64)) * 15 + \
        sum(min(t, 64 * 5) + (min(t, 64) if t > 64 else 0) for t in token_buckets(512)) == 3165 + 1648
    assert graph_logits_rows(4, 1, 0) == 1 + 2 + 4  # no ragged graphs


def test_each_owner_gets_a_stream_no_other_live_owner_holds(monkeypatch):
    """``stream_of_its_own`` over a pool that hands out ``POOL_STREAMS`` streams in turn,
    as torch's does (simulated): a second owner gets another stream than the first even
    where the pool's turn has come back to the first's; the whole pool serves as many
    owners, each stream once; past that an owner still gets one (no endless draw); an
    owner collected lets its stream go, for the next owner to get."""
    import gc
    import itertools

    import torch

    from specserve import cuda_graphs

    turn = itertools.count()

    class PoolStream:
        def __init__(self, device=None):
            self.cuda_stream = 1000 + next(turn) % cuda_graphs.POOL_STREAMS

    class Owner:
        pass

    monkeypatch.setattr(torch.cuda, "Stream", PoolStream)
    monkeypatch.setattr(cuda_graphs, "_HELD", {})
    first = Owner()
    a = cuda_graphs.stream_of_its_own("cuda", first).cuda_stream
    for _ in range(cuda_graphs.POOL_STREAMS - 1):
        PoolStream()  # other users of the pool: its next stream is the first owner's again
    owners = [Owner() for _ in range(cuda_graphs.POOL_STREAMS - 1)]
    held = [cuda_graphs.stream_of_its_own("cuda", owner).cuda_stream for owner in owners]
    assert held[0] != a and len(set(held) | {a}) == cuda_graphs.POOL_STREAMS
    extra = Owner()
    assert cuda_graphs.stream_of_its_own("cuda", extra).cuda_stream in set(held) | {a}
    del extra, first
    gc.collect()
    assert set(cuda_graphs._HELD) == set(held)  # the first's let go; the extra's sharer keeps its own
    assert cuda_graphs.stream_of_its_own("cuda", Owner()).cuda_stream == a


def test_the_gpu_memory_budget_reserves_the_graph_outputs():
    """On CUDA with graphs the KV budget leaves room for the graphs' kept logits (fp32,
    and the model dtype's before the cast); with --enforce-eager it does not."""
    from types import SimpleNamespace

    import torch

    from specserve.config import EngineConfig
    from specserve.model_runner import ModelRunner

    model = SimpleNamespace(config=SimpleNamespace(hidden_size=576, intermediate_size=1536, vocab_size=49152),
                            attention_backend=SimpleNamespace(name="triton"))

    def reserve(**kwargs):
        runner = SimpleNamespace(model=model, device=torch.device("cuda"), dtype=torch.bfloat16,
                                 config=EngineConfig(speculative_method="ngram", **kwargs))
        return ModelRunner._activation_reserve(runner)

    assert reserve() - reserve(enforce_eager=True) == graph_logits_rows(64, 5, 512) * 49152 * 6
    assert reserve(cuda_graph_max_tokens=0) - reserve(enforce_eager=True) == graph_logits_rows(64, 5, 0) * 49152 * 6


@pytest.mark.parametrize("variant", ["llama", "mistral_window", "qwen2_moe_shared"])
@pytest.mark.parametrize("method", ["none", "ngram"])
def test_padded_graph_path_equals_eager(tiny_model_dir, variant, method):
    kwargs = dict(block_size=4, num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=64,
                  speculative_method=method, num_speculative_tokens=4, enforce_eager=True,  # (a GPU's too)
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
                speculative_method="ngram", num_speculative_tokens=3, enforce_eager=True)
    runner = llm.engine.runner
    runner.enable_graphs(4, llm.engine.max_model_len, capture=False)
    for k, v in runner.kv_caches:
        k.fill_(float("nan"))
        v.fill_(float("nan"))
    # Every real slot is written before it is read; NaN anywhere else must not leak in.
    out = llm.generate(["a b a b a b a b"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0]
    ref = LLM32(str(tiny_model_dir("llama")), block_size=4, num_kv_blocks=64, enforce_eager=True).generate(
        ["a b a b a b a b"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    assert out.token_ids == ref.token_ids


def mixes(planned) -> bool:
    """Whether a step has a prefill chunk beside decode or verify rows."""
    return any(len(p.token_ids) > 1 for p in planned) and any(len(p.token_ids) == 1 for p in planned)


@pytest.mark.parametrize("backend, method", [("torch", "none"), ("torch", "ngram"), ("triton", "ngram")])
def test_ragged_graph_path_equals_eager(tiny_model_dir, backend, method):
    """Steps with prefill chunks run the ragged graphs' layout: the requests' rows
    unpadded, a padding request up to the token bucket, requests without rows up to
    max_num_seqs + 1, logits of the sampled rows only. A budget this small makes chunks
    share steps with decode and verify rows; the tokens are the eager path's (greedy and
    seeded sampling) and every block comes back. Triton (interpreted) plans its launch
    for the worst case, as the captured graph does."""
    kwargs = dict(block_size=4, num_kv_blocks=256, max_num_seqs=4, max_num_batched_tokens=20,
                  speculative_method=method, num_speculative_tokens=3, attention_backend=backend,
                  enforce_eager=True,  # (a GPU's engines too: the graph paths below run eagerly)
                  speculative_adaptive=False)  # drafts every step: verify spans beside the chunks
    prompts = PROMPTS + ["one two three four five six seven eight nine ten " * 3]
    eager = LLM32(str(tiny_model_dir("llama")), **kwargs)
    llm = LLM32(str(tiny_model_dir("llama")), **kwargs)
    llm.engine.enable_graphs(capture=False)
    graphs = llm.engine.runner.graphs
    assert graphs.token_buckets == [16, 20]
    ragged = []
    run = graphs.run

    def record(output, *args):
        shape = graphs._shape(output.scheduled)
        if shape[0] == 0:
            tokens = sum(len(p.token_ids) + len(p.draft_token_ids) for p in output.scheduled)
            ragged.append((shape[1], tokens, mixes(output.scheduled)))
        return run(output, *args)

    graphs.run = record
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=3, max_tokens=20, ignore_eos=True)]
    if backend == "triton":  # interpreted: slow, and the sampler is the torch runs' business
        params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]
    for p in params:
        want = eager.generate(prompts, p, use_tqdm=False)
        got = llm.generate(prompts, p, use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert any(mixed for *_, mixed in ragged)                    # chunks beside decode rows
    assert any(tokens < bucket for bucket, tokens, _ in ragged)  # a padding request
    if method == "ngram":
        assert llm.engine.spec_stats.num_drafts > 0
    assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks


def test_steps_past_the_largest_token_bucket_run_eagerly(tiny_model_dir):
    llm = LLM32(str(tiny_model_dir("llama")), block_size=4, num_kv_blocks=64, max_num_seqs=4,
                max_num_batched_tokens=16)
    llm.engine.enable_graphs(capture=False)
    graphs = llm.engine.runner.graphs
    greedy = SamplingParams(temperature=0)

    def step(*lengths):
        return [ScheduledRequest(f"r{i}", [0] * n, 0, [0] * 8, greedy) for i, n in enumerate(lengths)]

    assert graphs._shape(step(1, 1, 1)) == (4, 1)    # padded: every request within one token
    assert graphs._shape(step(9, 1)) == (0, 16, 4)   # ragged: ten tokens in the 16-token bucket
    assert graphs._shape(step(16, 1)) is None        # 17 tokens: past the largest bucket


def test_ragged_graphs_compute_the_logits_rows_the_step_needs(tiny_model_dir):
    """A drafting engine's ragged graphs come in two row counts per token bucket: one row
    per request (a step without drafts computes no more logits than speculation off's)
    and 1 + k per request; a step takes the smaller that holds its sampled rows, and the
    captured set (every key built) holds both."""
    llm = LLM32(str(tiny_model_dir("llama")), block_size=4, num_kv_blocks=64, max_num_seqs=4,
                max_num_batched_tokens=32, speculative_method="ngram", num_speculative_tokens=3)
    llm.engine.enable_graphs(capture=False)
    graphs = llm.engine.runner.graphs
    greedy = SamplingParams(temperature=0)

    def req(i, n, drafts=0):
        return ScheduledRequest(f"r{i}", [0] * n, 0, [0] * 8, greedy, num_lookahead=drafts,
                                draft_token_ids=[0] * drafts)

    assert graphs._shape([req(0, 9), req(1, 1)]) == (0, 16, 4)            # 2 rows: one per request
    assert graphs._shape([req(0, 9), req(1, 1, 3)]) == (0, 16, 16)        # 5 rows: 1 + k per request
    assert graphs._shape([req(0, 20), req(1, 1), req(2, 1)]) == (0, 32, 4)
    assert graphs._shape([req(0, 20), req(1, 1, 3), req(2, 1, 3)]) == (0, 32, 16)
    graphs.capture_all([1, 2, 3, 4])
    ragged = sorted(key for key in graphs._graphs if key[0] == 0)
    assert ragged == [(0, 16, 4), (0, 16, 16), (0, 32, 4), (0, 32, 16)]
    assert graph_logits_rows(4, 4, 32) == sum(b * q for b in batch_buckets(4) for q in range(1, 5)) + 40
    assert graph_logits_rows(4, 1, 32) == sum(batch_buckets(4)) + 8  # speculation off: one row count


def test_the_graph_steps_benchmark_runs_and_times_both_kinds_of_step(tiny_model_dir, tmp_path, capsys):
    """benchmarks/graph_steps.py on a tiny model (CPU: no graphs, so both engines run the
    same eager steps): both settings run every round, steps with and without a prefill
    chunk are timed apart, and the table names both."""
    import importlib.util
    import json
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "graph_steps.py"
    spec = importlib.util.spec_from_file_location("graph_steps", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    workload = tmp_path / "set.jsonl"
    workload.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "steps.json"
    assert module.main(["--model", str(tiny_model_dir("llama")), "--dtype", "float32", "--workloads",
                        str(workload), "--num-prompts", "10", "--output-len", "8", "--rounds", "2",
                        "--max-num-seqs", "4", "--num-kv-blocks", "256", "--speculation", "ngram:3",
                        "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) == 4 and {r["setting"] for r in runs} == {"prefill steps eager", "ragged graphs"}
    for r in runs:  # ten requests through four seats: some steps admit one, most do not
        assert 0 < r["num_prefill_steps"] < r["num_steps"] and r["prefill_step_ms"] > 0
        assert r["decode_step_ms"] > 0 and r["output_throughput"] > 0
    printed = capsys.readouterr().out
    assert "| eager |" in printed and "| ragged graphs |" in printed


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="captures real CUDA graphs")
@pytest.mark.parametrize("method", ["none", "ngram"])
def test_captured_graphs_give_the_eager_tokens_on_cuda(tiny_model_dir, method):
    """On a GPU, with real captures (padded decode/verify graphs and ragged ones, the
    attention planned for the worst case): float32 greedy tokens equal the eager engine's,
    with a budget small enough that prefill chunks share steps with decode rows."""
    kwargs = dict(device="cuda", block_size=16, num_kv_blocks=256, max_num_seqs=4, max_num_batched_tokens=32,
                  speculative_method=method, num_speculative_tokens=3, speculative_adaptive=False)
    prompts = PROMPTS + ["one two three four five six seven eight nine ten " * 4]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = LLM32(str(tiny_model_dir("llama")), enforce_eager=True, **kwargs).generate(prompts, params, use_tqdm=False)
    llm = LLM32(str(tiny_model_dir("llama")), **kwargs)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.capture and any(key[0] == 0 for key in graphs._graphs)
    ragged = []
    run = graphs.run
    graphs.run = lambda output, *a: ragged.append(graphs._shape(output.scheduled)[0] == 0) or run(output, *a)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert any(ragged) and not all(ragged)
    assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks
