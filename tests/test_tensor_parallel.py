"""Tensor parallelism: the sharding functions on their own, the rank-0 -> ranks messages
through a loopback, and a real 2-process gloo job on CPU whose logits and greedy
outputs must equal the unsharded model's (float32)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specserve import EngineConfig, SamplingParams
from specserve.distributed import MULTICAST_OFF, TPGroup
from specserve.models.parallel import ShardLayout, check_tensor_parallel
from specserve.scheduler import ScheduledRequest, SchedulerOutput
from test_model import load_ours, ragged_logits
from tiny_models import LLM32, make_hf_model, save_perturbed

TESTS = Path(__file__).resolve().parent


class _Cfg:
    def __init__(self, **kw):
        base = dict(num_attention_heads=8, num_key_value_heads=2, hidden_size=64,
                    intermediate_size=96, vocab_size=515)
        self.__dict__.update({**base, **kw})


# ---------------------------------------------------------------------- sharding functions
def _layouts(size: int, **kw) -> list[ShardLayout]:
    return [ShardLayout.of(_Cfg(**kw), TPGroup(rank=r, size=size)) for r in range(size)]


def test_column_parallel_qkv_and_gate_up_are_exact_row_slices():
    layouts = _layouts(2)  # 8 heads, 2 KV heads, head_dim 8
    q, k = torch.randn(64, 64), torch.randn(16, 64)
    assert [lay.local_heads for lay in layouts] == [4, 4] and layouts[0].local_kv_heads == 1
    parts = [lay.shard("model.layers.0.self_attn.qkv_proj.weight", 0, q) for lay in layouts]
    assert torch.equal(torch.cat(parts), q) and torch.equal(parts[1], q[32:])
    kparts = [lay.shard("model.layers.0.self_attn.qkv_proj.weight", 1, k) for lay in layouts]
    assert torch.equal(kparts[0], k[:8]) and torch.equal(kparts[1], k[8:])
    gate = torch.randn(96, 64)
    gparts = [lay.shard("model.layers.3.mlp.gate_up_proj.weight", 0, gate) for lay in layouts]
    assert torch.equal(torch.cat(gparts), gate) and gparts[0].shape == (48, 64)
    bias = torch.randn(16)  # qkv bias follows its rows
    assert torch.equal(layouts[1].shard("model.layers.0.self_attn.qkv_proj.bias", 2, bias), bias[8:])


def test_row_parallel_o_and_down_split_columns_and_add_bias_once():
    layouts = _layouts(2)
    o, down = torch.randn(64, 64), torch.randn(64, 96)
    oparts = [lay.shard("model.layers.0.self_attn.o_proj.weight", None, o) for lay in layouts]
    assert torch.equal(torch.cat(oparts, dim=1), o) and oparts[0].shape == (64, 32)
    dparts = [lay.shard("model.layers.0.mlp.down_proj.weight", None, down) for lay in layouts]
    assert torch.equal(dparts[1], down[:, 48:])
    bias = torch.randn(64)
    biases = [lay.shard("model.layers.0.mlp.down_proj.bias", None, bias) for lay in layouts]
    assert torch.equal(biases[0], bias) and not biases[1].any()  # summed by the all-reduce once


def test_kv_heads_replicated_when_fewer_than_ranks():
    k = torch.arange(2 * 8 * 3).float().view(16, 3)  # 2 KV heads of head_dim 8
    layouts = _layouts(4, num_key_value_heads=2)     # 8 query heads: 2 per rank
    got = [lay.shard("model.layers.0.self_attn.qkv_proj.weight", 1, k) for lay in layouts]
    assert [lay.local_kv_heads for lay in layouts] == [1] * 4
    # ranks 0, 1 hold query heads 0-3, which use KV head 0; ranks 2, 3 hold 4-7 -> KV head 1
    assert torch.equal(got[0], k[:8]) and torch.equal(got[1], k[:8])
    assert torch.equal(got[2], k[8:]) and torch.equal(got[3], k[8:])
    one = _layouts(2, num_key_value_heads=1)
    assert all(torch.equal(lay.shard("x.qkv_proj.weight", 2, k[:8]), k[:8]) for lay in one)


def test_vocab_rows_padded_on_the_last_rank_and_norms_replicated():
    layouts = _layouts(2)  # vocab 515 -> 258 rows per rank
    table = torch.randn(515, 4)
    rows = [lay.shard("model.embed_tokens.weight", None, table) for lay in layouts]
    assert [r.shape[0] for r in rows] == [258, 258] and layouts[1].vocab_start == 258
    assert torch.equal(torch.cat(rows)[:515], table) and not rows[1][-1].any()
    assert torch.equal(layouts[1].shard("lm_head.weight", None, table), rows[1])
    norm = torch.randn(64)
    assert layouts[1].shard("model.layers.0.input_layernorm.weight", None, norm) is norm


def test_check_tensor_parallel_refuses_uneven_splits():
    check_tensor_parallel(_Cfg(), 2)
    with pytest.raises(ValueError, match="must divide the model's 8 attention heads"):
        check_tensor_parallel(_Cfg(), 3)
    with pytest.raises(ValueError, match="6 KV heads can be neither split"):
        check_tensor_parallel(_Cfg(num_attention_heads=12, num_key_value_heads=6), 4)
    with pytest.raises(ValueError, match="intermediate size 90"):
        check_tensor_parallel(_Cfg(intermediate_size=90), 4)


def test_sharded_build_keeps_only_this_ranks_part(tmp_path, tiny_tokenizer):
    """build_model for rank 1 of 2 (loading needs no collective): every parameter has the
    rank's shape and holds exactly its slice of the checkpoint."""
    from specserve.attention import TorchAttentionBackend
    from specserve.loader import ModelFiles, build_model, load_hf_config

    hf = make_hf_model("qwen2_bias", num_key_value_heads=1, vocab_size=515)
    hf.save_pretrained(tmp_path)
    files = ModelFiles("tiny", tmp_path)
    ours = build_model(files, load_hf_config(files), torch.float32, torch.device("cpu"),
                       TorchAttentionBackend(), tp=TPGroup(rank=1, size=2))
    attn, hf_attn = ours.model.layers[1].self_attn, hf.model.layers[1].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
    q, k, v = attn.qkv_proj.weight.split([attn.q_size, attn.kv_size, attn.kv_size])
    assert torch.equal(q, hf_attn.q_proj.weight[32:]) and torch.equal(k, hf_attn.k_proj.weight)
    assert torch.equal(attn.qkv_proj.bias[attn.q_size:attn.q_size + attn.kv_size], hf_attn.k_proj.bias)
    assert torch.equal(attn.o_proj.weight, hf_attn.o_proj.weight[:, 32:])
    up = ours.model.layers[0].mlp.gate_up_proj.weight[64:]
    assert torch.equal(up, hf.model.layers[0].mlp.up_proj.weight[64:])
    assert ours.model.embed_tokens.weight.shape == (258, 64)
    assert torch.equal(ours.lm_head.weight[:257], hf.lm_head.weight[258:])
    assert ours.num_parameters < sum(p.numel() for p in hf.parameters()) * 0.6


def test_merged_projections_and_experts_are_sharded_part_by_part(tmp_path, tiny_tokenizer):
    """Phi-3 stores q/k/v and gate/up merged: rank 1 of 2 takes its q rows, its KV head's
    k and v rows, and its gate and up rows, each from its part of the merged tensor."""
    from specserve.attention import TorchAttentionBackend
    from specserve.errors import SpecserveError
    from specserve.loader import ModelFiles, build_model, load_hf_config

    hf = make_hf_model("phi3_longrope")
    hf.save_pretrained(tmp_path / "phi3")
    files = ModelFiles("tiny", tmp_path / "phi3")
    ours = build_model(files, load_hf_config(files), torch.float32, torch.device("cpu"),
                       TorchAttentionBackend(), tp=TPGroup(rank=1, size=2))
    qkv = hf.model.layers[1].self_attn.qkv_proj.weight  # q 64 rows, k 32, v 32; 2 KV heads of 16
    q, k, v = ours.model.layers[1].self_attn.qkv_proj.weight.split([32, 16, 16])
    assert torch.equal(q, qkv[32:64]) and torch.equal(k, qkv[64 + 16:96]) and torch.equal(v, qkv[96 + 16:])
    gate_up = hf.model.layers[0].mlp.gate_up_proj.weight  # gate 128 rows, up 128
    gate, up = ours.model.layers[0].mlp.gate_up_proj.weight.split([64, 64])
    assert torch.equal(gate, gate_up[64:128]) and torch.equal(up, gate_up[192:])
    # Experts: each rank holds every expert's share of its rows, the router whole.
    make_hf_model("qwen2_moe_shared").save_pretrained(tmp_path / "moe")
    files = ModelFiles("tiny", tmp_path / "moe")
    moe = build_model(files, load_hf_config(files), torch.float32, torch.device("cpu"),
                      TorchAttentionBackend(), tp=TPGroup(rank=1, size=2)).model.layers[0].mlp
    from safetensors.torch import load_file

    stored = {k.removeprefix("model.layers.0.mlp."): v for k, v in load_file(tmp_path / "moe" / "model.safetensors").items()
              if k.startswith("model.layers.0.mlp.")}
    gate, up = moe.experts[3].gate_up_proj.weight.split([16, 16])  # moe_intermediate 32, halved
    assert torch.equal(gate, stored["experts.3.gate_proj.weight"][16:])
    assert torch.equal(up, stored["experts.3.up_proj.weight"][16:])
    assert torch.equal(moe.experts[3].down_proj.weight, stored["experts.3.down_proj.weight"][:, 16:])
    assert torch.equal(moe.shared_expert.down_proj.weight, stored["shared_expert.down_proj.weight"][:, 32:])
    assert torch.equal(moe.gate.weight, stored["gate.weight"])
    assert torch.equal(moe.shared_expert_gate.weight, stored["shared_expert_gate.weight"])
    make_hf_model("qwen3_moe", moe_intermediate_size=34).save_pretrained(tmp_path / "moe34")
    files = ModelFiles("tiny", tmp_path / "moe34")
    with pytest.raises(SpecserveError, match="moe intermediate size 34"):
        build_model(files, load_hf_config(files), torch.float32, torch.device("cpu"),
                    TorchAttentionBackend(), tp=TPGroup(rank=0, size=4))


# ---------------------------------------------------------------------- the step messages
class _Loopback(TPGroup):
    """A 'group' whose broadcasts rank 0 sends into a queue the receiver reads from."""

    def __init__(self, queue: list, rank: int) -> None:
        super().__init__(rank=rank, size=2)
        object.__setattr__(self, "queue", queue)
        object.__setattr__(self, "barriers", 0)

    def barrier(self) -> None:  # each side's count is checked: both meet at the shutdown
        object.__setattr__(self, "barriers", self.barriers + 1)

    def broadcast(self, x):
        if self.rank == 0:
            self.queue.append(x.clone())
        else:
            x.copy_(self.queue.pop(0))
        return x


@pytest.mark.parametrize("num_reqs,context", [(3, 40), (40, 300)])  # the second needs 2 broadcasts
def test_step_messages_rebuild_the_schedule(num_reqs, context):
    from specserve.batch import DeviceTokenIds
    from specserve.step_channel import COPY, GRAPHS, SHUTDOWN, STEP, StepChannel

    queue: list = []
    send, receive = StepChannel(_Loopback(queue, 0)), StepChannel(_Loopback(queue, 1))
    params = SamplingParams()
    step = SchedulerOutput([ScheduledRequest(f"r{i}", list(range(i, i + 1 + i % 3)), context + i,
                                             list(range(7 * i, 7 * i + context // 16 + 1)), params,
                                             sample=i % 4 != 1, num_lookahead=i % 2,
                                             draft_token_ids=[9] * (i % 2), prompt_logits=i % 3 == 0,
                                             long_rope=i % 5 == 2)
                            for i in range(num_reqs)], [])
    # A model drafter's proposals still on rank 0's device follow the message, device to device.
    on_device = DeviceTokenIds(torch.arange(100, 100 + sum(i % 2 for i in range(num_reqs))),
                               [i % 2 for i in range(num_reqs)])
    send.send_step(step, None)
    send.send_step(step, 3)
    send.send_step(step, None, on_device)
    send.send_graphs(5, 4096, True)
    send.send_copies([(3, 17), (4, 18)])
    send.send_shutdown()
    for num_layers, device_ids in ((None, None), (3, None), (None, on_device)):
        got = receive.receive()
        assert got.kind == STEP and got.num_layers == num_layers
        fields = ("token_ids", "start_pos", "block_table", "sample", "draft_token_ids", "prompt_logits", "long_rope")
        assert [[getattr(p, f) for f in fields] for p in got.output.scheduled] == \
            [[getattr(p, f) for f in fields] for p in step.scheduled]
        if device_ids is None:
            assert got.device_ids is None
        else:
            assert got.device_ids.counts == device_ids.counts
            assert torch.equal(got.device_ids.ids, device_ids.ids)
    assert receive.receive().graphs == (5, 4096, True)
    copies = receive.receive()
    assert copies.kind == COPY and copies.block_copies == [(3, 17), (4, 18)]
    assert send.tp.barriers == 1 and receive.tp.barriers == 0  # only the shutdown meets
    assert receive.receive().kind == SHUTDOWN and not queue
    assert receive.tp.barriers == 1
    assert GRAPHS != STEP


def test_a_failed_pass_on_rank_0_ends_the_engine_and_sends_nothing_more(tiny_model_dir):
    """After the others were told to run a pass that then failed here, no message could be
    matched right (they may wait inside it), so the runner stops sending and the engine
    stops stepping instead of failing just that step's requests."""
    from specserve.errors import RanksOutOfStepError
    from specserve.model_runner import ModelRunner

    llm = LLM32(str(tiny_model_dir("llama")), num_kv_blocks=32, block_size=4)
    sent = []
    runner = ModelRunner(llm.engine.runner.model, llm.engine.config, torch.device("cpu"), torch.float32,
                         num_blocks=32, tp=TPGroup(rank=0, size=2))
    runner.channel = type("Recorder", (), {"send_step": lambda self, *a: sent.append("step"),
                                           "send_shutdown": lambda self: sent.append("stop")})()
    runner._forward = lambda *a: (_ for _ in ()).throw(RuntimeError("out of memory"))
    step = SchedulerOutput([ScheduledRequest("r", [5, 6], 0, [0], SamplingParams())], [])
    with pytest.raises(RanksOutOfStepError, match="out of memory"):
        runner.execute(step)
    runner.close()
    assert sent == ["step"] and runner.channel is None
    with pytest.raises(RuntimeError, match="closed"):
        runner.execute(step)
    llm.engine.runner.execute = lambda *a, **k: (_ for _ in ()).throw(RanksOutOfStepError("lost step"))
    llm.engine.add_request([5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(RanksOutOfStepError):
        llm.engine.step()


# ---------------------------------------------------------------------- configuration errors
@pytest.mark.parametrize("size", [0, -2, True, "2", 1.5])
def test_bad_tensor_parallel_size_is_a_value_error(size):
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineConfig(tensor_parallel_size=size)


def test_tensor_parallel_device_rules():
    with pytest.raises(ValueError, match="each rank uses cuda:LOCAL_RANK"):
        from specserve.distributed import check_tensor_parallel_size

        check_tensor_parallel_size(2, "cuda:1")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            EngineConfig(device="cuda", tensor_parallel_size=2)
    EngineConfig(device="cpu", tensor_parallel_size=4)  # gloo ranks: any number


EXIT_SCRIPT = """
import atexit, sys, threading
from specserve import distributed
distributed._JOINED_GLOO = {joined}
atexit.register(lambda: print("hook ran", file=sys.stderr, flush=True))
class Finalized:
    def __del__(self):
        print("finalized", file=sys.stderr, flush=True)
kept = Finalized()
if {joined}:  # a non-daemon thread that never ends: finalization would wait for it
    threading.Thread(target=threading.Event().wait).start()
sys.stdout.write("unflushed")  # left in the buffer for the exit to flush
def main():
    {body}
distributed.run_main(main)
"""


@pytest.mark.parametrize("joined", [True, False])
@pytest.mark.parametrize("body, code", [("return 3", 3), ("raise SystemExit(4)", 4),
                                        ("raise RuntimeError('the rank failed')", 1)])
def test_a_gloo_rank_ends_without_finalizing_after_its_hooks(joined, body, code):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout block-buffered
    done = subprocess.run([sys.executable, "-c", EXIT_SCRIPT.format(joined=joined, body=body)],
                          capture_output=True, text=True, timeout=120, env=env, check=False)
    assert done.returncode == code, done.stderr
    assert done.stdout == "unflushed" and "hook ran" in done.stderr
    assert ("RuntimeError: the rank failed" in done.stderr) is (code == 1)
    # Finalization (module globals' __del__) runs for any other process, not for a gloo rank's.
    assert ("finalized" in done.stderr) is not joined


def test_engine_outside_torchrun_says_how_to_start(monkeypatch, tiny_model_dir):
    from specserve import LLMEngine

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="torchrun --nproc-per-node 2"):
        LLMEngine(model=str(tiny_model_dir("llama")), device="cpu", tensor_parallel_size=2)


# ---------------------------------------------------------------------- 2 gloo ranks
PROMPTS = ["a b c a b c a b c a b c", "def f(x): return x\ndef f(x):", "hello",
           "import os\nimport sys\nimport os\nimport sys\nimport os\n", "x = 1\ny = 2\nx = 1\n"]
GREEDY = dict(temperature=0, max_tokens=20, ignore_eos=True)
ENGINE_RUNS = [
    # chunked prefill (16-token budget), n-gram speculation, one request without drafts,
    # then seeded sampling; the model splits its 2 KV heads over the ranks
    dict(name="ngram_chunked", variant="llama",
         engine=dict(block_size=4, num_kv_blocks=128, max_num_batched_tokens=16, max_num_seqs=8,
                     speculative_method="ngram", num_speculative_tokens=3, speculative_adaptive=False),
         params=[GREEDY, dict(GREEDY, num_speculative_tokens=0),
                 dict(temperature=0.8, seed=1, max_tokens=20, ignore_eos=True),
                 # the prompt's logits too (every rank computes the same rows), penalties
                 dict(GREEDY, prompt_logprobs=1, logprobs=2, repetition_penalty=1.3, frequency_penalty=0.4)]),
    # the CUDA-graph path's padding (buckets, one query length per step), eagerly; one KV
    # head replicated on both ranks, qkv bias
    dict(name="graphs_kv1", variant="kv1",
         engine=dict(block_size=4, num_kv_blocks=128, max_num_seqs=8,
                     speculative_method="ngram", num_speculative_tokens=4, speculative_adaptive=False),
         params=[GREEDY], graphs=True),
    # layer-skip drafts run the target's sharded first layer through the same broadcast
    dict(name="layerskip", variant="llama",
         engine=dict(block_size=4, num_kv_blocks=128, speculative_method="layerskip",
                     layerskip_layers=1, num_speculative_tokens=2, speculative_adaptive=False),
         params=[GREEDY]),
    # a draft checkpoint runs whole on rank 0 only, beside the sharded target
    dict(name="draft_model", variant="llama", draft="draft",
         engine=dict(block_size=4, num_kv_blocks=128, speculative_method="draft_model",
                     num_speculative_tokens=3, speculative_adaptive=False),
         params=[GREEDY, dict(temperature=0.8, seed=2, max_tokens=20, ignore_eos=True)]),
    # draft paths: every rank copies each path's first block in its own cache
    dict(name="draft_paths", variant="llama", draft="near",
         engine=dict(block_size=4, num_kv_blocks=128, speculative_method="draft_model",
                     num_speculative_tokens=3, speculative_adaptive=False, num_draft_paths=3),
         params=[GREEDY]),
]


# The deterministic mode in bf16 under TP 2 (the row-parallel partial sums of two ranks add
# the same either way round): speculation in small chunks gives speculation off's tokens.
DETERMINISTIC_RUNS = [
    dict(name=f"deterministic_{method}", variant="llama",
         engine=dict(block_size=4, num_kv_blocks=128, dtype="bfloat16", deterministic=True,
                     max_num_batched_tokens=8, speculative_method=method, num_speculative_tokens=3,
                     speculative_adaptive=False),  # adaptive k follows timings: it may draft nothing
         params=[GREEDY])
    for method in ("none", "ngram")]


@pytest.fixture(scope="module")
def tp_models(tmp_path_factory, tiny_tokenizer):
    """Tiny checkpoints: GQA split over the ranks (llama: 4 heads, 2 KV heads), one KV
    head replicated with qkv bias (kv1), and a vocabulary the ranks cannot split evenly
    (vocab515, logits only: the tokenizer has 512 tokens)."""
    made = {}
    for name, variant, overrides in (("llama", "llama", {}),
                                     ("kv1", "qwen2_bias", dict(num_key_value_heads=1)),
                                     ("vocab515", "qwen3_qknorm", dict(vocab_size=515)),
                                     # q/k/v, gate/up stored merged; partial rotary (reordered per shard)
                                     ("phi4mini", "phi4_mini_partial", {}),
                                     ("moe", "qwen2_moe_shared", {}),  # experts, a shared one, a dense layer
                                     ("draft", "llama", dict(seed=1, num_hidden_layers=1))):
        path = tmp_path_factory.mktemp(f"tp-{name}")
        make_hf_model(variant, **overrides).save_pretrained(path)
        tiny_tokenizer.save_pretrained(path)
        made[name] = path
    # the target perturbed: a draft whose runner-up guesses are often right
    made["near"] = save_perturbed(made["llama"], tmp_path_factory.mktemp("tp-near"), 0.01)
    return made


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in (23, 1, 9, 14)]


def run_tp_job(spec: dict, tmp: Path, nproc: int = 2) -> list[dict]:
    (tmp / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(TESTS)}
    for name in MULTICAST_OFF:
        env.pop(name, None)  # the ranks must set them themselves
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(TESTS / "tp_job.py"), str(tmp / "spec.json"), str(tmp)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(nproc)]


def _engine_kwargs(run: dict, tp_models) -> dict:
    if "draft" in run:
        return dict(run["engine"], draft_model=str(tp_models[run["draft"]]))
    return run["engine"]


@pytest.fixture(scope="module")
def tp_job(tp_models, tmp_path_factory):
    spec = {"models": {k: str(tp_models[k]) for k in ("llama", "kv1", "vocab515", "phi4mini", "moe")},
            "prompts": _prompts(),
            "engines": [dict(r, model=str(tp_models[r["variant"]]), prompts=PROMPTS,
                             engine=_engine_kwargs(r, tp_models)) for r in ENGINE_RUNS + DETERMINISTIC_RUNS]}
    return run_tp_job(spec, tmp_path_factory.mktemp("tp-job"))


@pytest.mark.parametrize("name", ["llama", "kv1", "vocab515", "phi4mini", "moe"])
def test_sharded_logits_equal_unsharded(tp_job, tp_models, name):
    want = ragged_logits(load_ours(tp_models[name]), _prompts(), chunk=5)
    for rank in tp_job:  # every rank ends with the whole (gathered) logits
        for got, ref in zip(rank["logits"][name], want):
            assert got.shape == ref.shape
            assert (got - ref).abs().max().item() < 1e-5, name


def test_each_rank_holds_its_shard_and_its_kv_heads(tp_job):
    r0, r1 = tp_job
    assert r0["shapes"]["vocab515"]["lm_head.weight"] == (258, 64)
    assert r1["shapes"]["llama"]["model.layers.0.self_attn.qkv_proj.weight"] == ((2 + 2 * 1) * 16, 64)
    # KV cache: [blocks, block_size, this rank's KV heads, head_dim]
    assert r0["shapes"]["ngram_chunked"] == (128, 4, 1, 16)
    assert r0["shapes"]["graphs_kv1"] == (128, 4, 1, 16)  # the one KV head, replicated
    assert 5 in r0["graph_steps"]  # 5 requests padded to the batch bucket of 8, on both ranks


@pytest.mark.parametrize("run", ENGINE_RUNS, ids=[r["name"] for r in ENGINE_RUNS])
def test_engine_output_equals_unsharded(tp_job, tp_models, run):
    llm = LLM32(str(tp_models[run["variant"]]), **_engine_kwargs(run, tp_models))
    want = [[o.token_ids for o in llm.generate(PROMPTS, SamplingParams(**p), use_tqdm=False)]
            for p in run["params"]]
    assert tp_job[0]["outputs"][run["name"]] == want
    free, total, drafts, path_wins = tp_job[0]["free_blocks"][run["name"]]
    assert free == total  # every block back in the pool
    assert drafts > 0
    # Kept tokens came from further paths, whose first blocks both ranks copied.
    assert (path_wins > 0) == (run["engine"].get("num_draft_paths", 1) > 1)


def test_a_draft_sharing_the_split_embeddings_is_refused(tmp_path, tiny_tokenizer):
    from types import SimpleNamespace

    from specserve.drafts import build_drafter

    draft = make_hf_model("llama", num_hidden_layers=1)
    draft.config.specserve_draft = {"shares_target_embeddings": True}
    draft.save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    target = SimpleNamespace(tp=TPGroup(rank=0, size=2))
    config = EngineConfig(speculative_method="draft_model", draft_model=str(tmp_path), device="cpu")
    with pytest.raises(ValueError, match="tensor parallelism splits"):
        build_drafter(config, target, SimpleNamespace(vocab_size=512, hidden_size=64), tiny_tokenizer,
                      torch.device("cpu"), torch.float32)


def test_ranks_turn_multicast_off(tp_job):
    assert all(rank["env"] == MULTICAST_OFF for rank in tp_job)


def test_ranks_wait_for_gloo_to_let_go_of_their_tensors(tp_job):
    """Each rank watched what it handed gloo, gloo let go of it all, and the same wait
    runs before the interpreter finalizes."""
    assert all(rank["gloo_held"] == (True, True, True) for rank in tp_job)


def test_gloo_held_tensors_are_waited_for_until_let_go():
    """settle() waits, the GIL released, until every handed tensor's references are back
    to what they were when it was handed over (an autograd graph that saved the tensor
    stands in for gloo's worker thread), and gives up after its timeout."""
    import threading
    import time

    from specserve.distributed import _GlooHeld

    held = _GlooHeld()
    x = torch.ones(3, requires_grad=True)
    held.add(x)
    graph = [x * x]  # saves x: references more than at the hand-over
    assert x._use_count() > 1
    assert held.settle(timeout_s=0.05) is False and held._held == []  # gave up, forgot it

    held.add(x)  # handed over while the graph holds it: that reference was there before
    assert held.settle(timeout_s=0.05) is True

    for _ in range(2 * held.PRUNE_AT):  # pruning let-go tensors keeps the one being handed over
        z = torch.ones(1)
        held.add(z)
        assert held._held[-1][0] is z

    y = torch.ones(3, requires_grad=True)
    held.add(y)
    graph.append(y * y)
    thread = threading.Thread(target=lambda: (time.sleep(0.1), graph.clear()))
    thread.start()
    assert held.settle(timeout_s=10) is True
    assert graph == [] and y._use_count() == 1  # it returned only once the thread let go
    thread.join()


# ---------------------------------------------------------------------- command line
TINY_CLI = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "64", "--block-size", "4",
            "--max-tokens", "12", "--ignore-eos", "--no-chat", "--json", "-q"]


@pytest.mark.parametrize("argv, message", [
    (["--tensor-parallel-size", "0"], "tensor_parallel_size must be a positive integer"),
    (["--tensor-parallel-size", "3"], "must divide the model's 4 attention heads"),
])
def test_cli_bad_sizes_are_one_line_exit_2(capsys, tiny_model_dir, monkeypatch, argv, message):
    from specserve.cli import main

    model = str(tiny_model_dir("llama"))
    capsys.readouterr()
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("must not start ranks"))
    code = main(["generate", "hi", "--model", model, *TINY_CLI, *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("specserve: error:") and message in err and err.count("\n") == 1


def test_cli_tensor_parallel_only_for_generate_and_serve(capsys):
    from specserve.cli import main

    assert main(["tune", "--tensor-parallel-size", "2", "--device", "cpu"]) == 2
    assert "'specserve generate' and 'specserve serve'" in capsys.readouterr().err


def test_cli_starts_its_ranks_under_torchrun_with_multicast_off(capsys, tiny_model_dir, monkeypatch):
    from specserve.cli import main

    class Started(Exception):
        pass

    def execve(path, args, env):
        raise Started(path, args, env)

    for name in MULTICAST_OFF:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(os, "execve", execve)
    argv = ["generate", "hi", "--model", str(tiny_model_dir("llama")), "--tensor-parallel-size", "2",
            "--device", "cpu"]
    with pytest.raises(Started) as started:
        main(argv)
    path, args, env = started.value.args
    assert path == sys.executable
    assert args[1:6] == ["-m", "specserve.launch", "--standalone", "--nproc-per-node=2", "-m"]
    assert args[6:] == ["specserve.cli", *argv]
    assert all(env[k] == v for k, v in MULTICAST_OFF.items())
    assert not any(k in os.environ for k in MULTICAST_OFF)  # only the ranks' environment


@pytest.mark.slow
def test_cli_generate_with_two_ranks_equals_one(tiny_model_dir):
    """The real thing: `specserve generate --tensor-parallel-size 2` starts torchrun, two
    gloo ranks, and prints the same greedy completion as one process."""
    def generate(*extra):
        done = subprocess.run([sys.executable, "-m", "specserve.cli", "generate", "def f(x):",
                               "--model", str(tiny_model_dir("llama")), *TINY_CLI, *extra],
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout)

    one, two = generate(), generate("--tensor-parallel-size", "2", "--speculative-method", "ngram")
    assert two["token_ids"] == one["token_ids"] and len(one["token_ids"]) == 12


# ---------------------------------------------------------------------- a rank that dies
def _sleeper(code: str = "import time; time.sleep(60)") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def _watch(monkeypatch, ranks: dict, interval: float = 0.02):
    import specserve.distributed as distributed

    monkeypatch.setattr(distributed, "_RANK_PROCESSES", ranks)
    lost: list[str] = []
    return distributed.RankWatch(TPGroup(rank=0, size=len(ranks)), lost.append, interval), lost


def _wait_for(condition, timeout: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_rank_watch_says_which_rank_ended_and_how(monkeypatch):
    import socket

    host = socket.gethostname()
    killed, failed, elsewhere = _sleeper(), _sleeper("raise SystemExit(3)"), _sleeper()
    try:
        watch, lost = _watch(monkeypatch, {0: (host, os.getpid()), 1: (host, killed.pid),
                                           2: ("another-host", elsewhere.pid)})
        killed.kill()  # not reaped here: the watch sees the zombie and its signal
        _wait_for(lambda: lost)
        assert lost == [f"tensor-parallel rank 1 (pid {killed.pid}) was killed by SIGKILL"]
        watch.stop()

        watch, lost = _watch(monkeypatch, {0: (host, os.getpid()), 1: (host, failed.pid)})
        _wait_for(lambda: lost)
        assert lost == [f"tensor-parallel rank 1 (pid {failed.pid}) exited with code 3"]
    finally:
        for proc in (killed, failed, elsewhere):
            proc.kill()
            proc.wait()


def test_rank_watch_ends_quietly_when_the_ranks_were_told_to_stop(monkeypatch):
    import socket
    import time

    clean = _sleeper("import time; time.sleep(0.3)")
    try:
        host = socket.gethostname()
        watch, lost = _watch(monkeypatch, {0: (host, os.getpid()), 1: (host, clean.pid)})
        watch.releasing()
        _wait_for(lambda: not watch._thread.is_alive())
        time.sleep(0.1)
        assert not watch._thread.is_alive() and lost == []
    finally:
        clean.wait()


@pytest.mark.slow
@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "idle"])
def test_a_killed_rank_ends_the_server_with_one_clear_line(tiny_model_dir, streaming):
    """`specserve serve --tensor-parallel-size 2`, rank 1 killed with a stream in flight or
    none: the stream ends with an error event, and the job exits 1 within seconds with one
    line saying which rank ended and how (no torchrun traceback)."""
    import threading
    import time

    import httpx
    import psutil

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"}
    model = str(tiny_model_dir("llama"))
    proc = subprocess.Popen([sys.executable, "-m", "specserve.cli", "serve", "--model", model, "--port", "0",
                             "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "128",
                             "--block-size", "4", "--tensor-parallel-size", "2"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=env)
    lines: list[str] = []
    url = []

    def read() -> None:
        for line in proc.stderr:
            lines.append(line)
            if "serving " in line and "http://" in line:
                url.append("http://" + line.split("http://", 1)[1].split("/v1", 1)[0])

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        _wait_for(lambda: url or proc.poll() is not None, timeout=240)
        assert url, "".join(lines)[-3000:]
        ranks = {int(p.environ().get("LOCAL_RANK", -1)): p for p in psutil.Process(proc.pid).children()}
        body = {"model": model, "prompt": "hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
        received = []
        if streaming:
            with httpx.stream("POST", url[0] + "/v1/completions", json=body, timeout=60) as response:
                for line in filter(None, response.iter_lines()):
                    received.append(line)
                    if len(received) == 3:
                        ranks[1].kill()
                        killed_at = time.monotonic()
        else:
            ranks[1].kill()
            killed_at = time.monotonic()
        proc.wait(timeout=30)
        ended_in = time.monotonic() - killed_at
        reader.join(5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = "".join(lines)
    if streaming:
        stream = "\n".join(received)
        # whether gloo's next collective or the rank watch notices first, the error names the rank
        assert '"error"' in stream and "tensor-parallel rank 1" in stream, stream[-1000:]
        assert received[-1] == "data: [DONE]"
    else:
        assert "Traceback" not in log, log[-3000:]
    assert proc.returncode == 1, log[-3000:]
    assert ended_in < 15
    assert lines[-1].strip() == (f"specserve: tensor-parallel rank 1 (pid {ranks[1].pid}) was killed by "
                                 "SIGKILL; the job has ended"), log[-3000:]
    assert "ChildFailedError" not in log


def test_deterministic_mode_under_tensor_parallelism(tp_job):
    off, ngram = (tp_job[0]["outputs"][run["name"]] for run in DETERMINISTIC_RUNS)
    assert ngram == off
    assert tp_job[0]["free_blocks"]["deterministic_ngram"][2] > 0  # it drafted
