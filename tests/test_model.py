"""Our ragged Llama-family model against transformers' own model classes (fp32, 1e-4)."""
from __future__ import annotations

import pytest
import torch

from tiny_models import VARIANTS, make_hf_model
from specserve.attention import TorchAttentionBackend
from specserve.config import EngineConfig
from specserve.kv_cache import KVCacheManager
from specserve.loader import ModelFiles, build_model, load_hf_config
from specserve.model_runner import ModelRunner
from specserve.sampling_params import SamplingParams
from specserve.scheduler import ScheduledRequest, SchedulerOutput

ATOL = 1e-4


def load_ours(path):
    files = ModelFiles("tiny", path)
    config = load_hf_config(files)
    return build_model(files, config, torch.float32, torch.device("cpu"), TorchAttentionBackend())


def ragged_logits(model, prompts: list[list[int]], chunk: int, block_size: int = 4,
                  dtype: torch.dtype = torch.float32, device: torch.device = torch.device("cpu")) -> list[torch.Tensor]:
    """Run ``prompts`` through the paged runner in chunks of at most ``chunk`` tokens each
    (all requests in every step, one ragged batch; the KV cache in ``dtype``, the model's);
    returns per-prompt logits [len, vocab]."""
    runner = ModelRunner(model, EngineConfig(block_size=block_size, num_kv_blocks=256), device, dtype)
    kv = KVCacheManager(runner.num_blocks, block_size)
    done = [0] * len(prompts)
    logits = [[] for _ in prompts]
    # Shuffle block order so block tables are not contiguous.
    kv.pool.allocate(7)
    while any(d < len(p) for d, p in zip(done, prompts)):
        planned = []
        for i, p in enumerate(prompts):
            if done[i] == len(p):
                continue
            n = min(chunk, len(p) - done[i])
            kv.allocate_slots(str(i), done[i] + n)
            planned.append(ScheduledRequest(str(i), p[done[i]:done[i] + n], done[i],
                                            kv.block_table(str(i)), SamplingParams()))
        batch = runner.prepare(SchedulerOutput(planned, []))
        with torch.inference_mode():
            hidden = model(batch.input_ids, batch.positions, runner.kv_caches, batch)
            out = model.compute_logits(hidden)
        start = 0
        for s in planned:
            n = len(s.token_ids)
            logits[int(s.req_id)].append(out[start:start + n])
            done[int(s.req_id)] += n
            start += n
    return [torch.cat(parts) for parts in logits]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers(variant, tiny_model_dir):
    path = tiny_model_dir(variant)
    hf = make_hf_model(variant)
    ours = load_ours(path)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (23, 1, 9, 14)]
    ragged = ragged_logits(ours, prompts, chunk=5)
    for prompt, got in zip(prompts, ragged):
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0]
        assert got.shape == want.shape
        assert (got - want).abs().max().item() < ATOL, variant


def test_chunking_does_not_change_logits(tiny_model_dir):
    ours = load_ours(tiny_model_dir("llama"))
    prompt = [[(7 * i) % 500 + 3 for i in range(37)]]
    whole = ragged_logits(ours, prompt, chunk=64)[0]
    chunked = ragged_logits(ours, prompt, chunk=3)[0]
    assert (whole - chunked).abs().max().item() < ATOL


def test_sliding_window_is_applied(tiny_model_dir):
    """The window must change the output once a prompt is longer than it (Mistral, 8)."""
    path = tiny_model_dir("mistral_window")
    ours = load_ours(path)
    prompt = [[(11 * i) % 500 + 3 for i in range(20)]]
    windowed = ragged_logits(ours, prompt, chunk=20)[0]
    for layer in ours.model.layers:
        layer.self_attn.sliding_window = None
    full = ragged_logits(ours, prompt, chunk=20)[0]
    assert (windowed[:8] - full[:8]).abs().max().item() < ATOL
    assert (windowed[8:] - full[8:]).abs().max().item() > 1e-3


def test_merged_projections_loaded(tiny_model_dir):
    hf = make_hf_model("qwen2_bias")
    ours = load_ours(tiny_model_dir("qwen2_bias"))
    attn, hf_attn = ours.model.layers[1].self_attn, hf.model.layers[1].self_attn
    q, k, v = attn.qkv_proj.bias.split([attn.q_size, attn.kv_size, attn.kv_size])
    assert torch.equal(q, hf_attn.q_proj.bias) and torch.equal(v, hf_attn.v_proj.bias)
    up = ours.model.layers[0].mlp.gate_up_proj.weight[ours.config.intermediate_size:]
    assert torch.equal(up, hf.model.layers[0].mlp.up_proj.weight)


@pytest.mark.slow
def test_default_model_logits_match_transformers(default_model_path):
    from transformers import AutoModelForCausalLM

    ours = load_ours(default_model_path)
    hf = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    prompts = [list(range(100, 140)), [1, 9690, 198, 2683, 359, 253]]
    ragged = ragged_logits(ours, prompts, chunk=16, block_size=16)
    for prompt, got in zip(prompts, ragged):
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0]
        assert (got - want).abs().max().item() < ATOL
