"""The families beyond Llama: Phi-3 (merged projections as stored, LongRoPE), Gemma 1/2/3 and mixture
of experts (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE). Logits against
transformers are in test_model.py and test_cpu_kernels.py (every variant); here: greedy
generation against transformers' ``generate``, speculation against plain decoding, and
what is particular to each family."""
from __future__ import annotations

import json

import pytest
import torch

from specserve import SamplingParams
from specserve.errors import ModelLoadError
from test_engine import hf_greedy, mixed_prompts
from test_model import load_ours, ragged_logits
from tiny_models import LLM32, make_hf_model, save_perturbed

FAMILIES = ["phi3_longrope", "phi4_mini_partial", "mixtral_moe", "qwen2_moe_shared", "qwen3_moe", "gemma3", "gemma2", "gemma"]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
SMALL = dict(max_num_batched_tokens=16, max_num_seqs=8, block_size=4, num_kv_blocks=160)


@pytest.mark.parametrize("variant", FAMILIES)
def test_greedy_generation_equals_transformers(variant, tiny_model_dir):
    """Continuous batching with chunked prefill (prompts of 1 to 60 tokens, budget 16)."""
    llm = LLM32(str(tiny_model_dir(variant)), **SMALL)
    hf = make_hf_model(variant)
    prompts = mixed_prompts()
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        assert out.token_ids == hf_greedy(hf, prompt, 20), variant
    assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks


@pytest.fixture(scope="module")
def family_draft(tiny_model_dir, tmp_path_factory):
    """A draft of the same family: the target's weights, perturbed."""
    made = {}

    def build(variant: str) -> str:
        if variant not in made:
            made[variant] = save_perturbed(tiny_model_dir(variant), tmp_path_factory.mktemp(f"draft-{variant}"), 0.01)
        return made[variant]

    return build


@pytest.mark.parametrize("variant", FAMILIES)
@pytest.mark.parametrize("drafter", ["ngram", "layerskip", "draft_model"])
def test_speculation_equals_plain_greedy(variant, drafter, tiny_model_dir, family_draft):
    target = str(tiny_model_dir(variant))
    settings = {"ngram": dict(speculative_method="ngram"),
                "layerskip": dict(speculative_method="layerskip", layerskip_layers=1),
                "draft_model": dict(speculative_method="draft_model", draft_model=family_draft(variant))}[drafter]
    prompts = mixed_prompts() + [[7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8]]  # one that n-gram drafts well
    plain = [o.token_ids for o in LLM32(target, **SMALL).generate(prompts, GREEDY, use_tqdm=False)]
    llm = LLM32(target, num_speculative_tokens=3, speculative_adaptive=False, **SMALL, **settings)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == plain
    assert llm.engine.spec_stats.num_draft_tokens > 0
    assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks


def hf_greedy_uncached(hf, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                      eos_token_id=None, pad_token_id=0, use_cache=False)
    return out[0, len(prompt):].tolist()


def longrope_prompts() -> list[list[int]]:
    """Against the tiny models' original length of 256: one prompt that crosses it while
    decoding, one past it from the start, one that stays short."""
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in (250, 300, 10)]


@pytest.mark.parametrize("variant", ["phi3_longrope", "phi4_mini_partial"])
@pytest.mark.parametrize("drafter", [None, "ngram", "draft_model"])
def test_longrope_past_its_original_length_equals_transformers(variant, drafter, tiny_model_dir, family_draft):
    """transformers rotates a sequence longer than ``original_max_position_embeddings``
    with the long factors at every position: the request that crosses is recomputed once,
    in long mode, and every output equals transformers' greedy decoding, drafts (capped
    below the crossing) included. The oracle runs a forward over the whole sequence for
    each token (no cache): that is the rule itself, which transformers 5.24's cached
    generate follows by recomputing at the crossing and 5.17's does not."""
    spec = {} if drafter is None else dict(speculative_method=drafter, num_speculative_tokens=3,
                                          speculative_adaptive=False)
    if drafter == "draft_model":  # a LongRoPE draft: its own cache recomputed in long mode too
        spec["draft_model"] = family_draft(variant)
    llm = LLM32(str(tiny_model_dir(variant)), **{**SMALL, "num_kv_blocks": 400}, **spec)
    assert llm.engine.max_model_len == 512 and llm.engine.scheduler.long_rope_from == 256
    hf = make_hf_model(variant)
    prompts = longrope_prompts()
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        assert out.token_ids == hf_greedy_uncached(hf, prompt, 20), len(prompt)
    assert llm.engine.scheduler.num_rope_restarts == 1  # the 250-token prompt, at position 256
    assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks


def test_longrope_modes_never_share_cached_blocks(tiny_model_dir):
    """With prefix caching, a long-mode request does not take the short-mode blocks of a
    prompt it starts with (their keys were rotated otherwise); a second long-mode request
    takes the first one's."""
    llm = LLM32(str(tiny_model_dir("phi3_longrope")), **{**SMALL, "num_kv_blocks": 400},
                enable_prefix_caching=True)
    hf = make_hf_model("phi3_longrope")
    short = longrope_prompts()[0][:200]
    long_a, long_b = short + list(range(3, 103)), short + list(range(3, 100)) + [7, 8, 9]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    [first] = llm.generate([short], params, use_tqdm=False)
    assert first.token_ids == hf_greedy_uncached(hf, short, 4)
    [second] = llm.generate([long_a], params, use_tqdm=False)
    assert second.num_cached_tokens == 0 and second.token_ids == hf_greedy_uncached(hf, long_a, 4)
    [third] = llm.generate([long_b], params, use_tqdm=False)
    assert third.num_cached_tokens == 296 and third.token_ids == hf_greedy_uncached(hf, long_b, 4)


def test_longrope_long_positions_rotate_with_the_long_factors():
    """A long-mode position (shifted by ``long_offset``) gets transformers' long
    frequencies, in the per-step tables and in the fused path's cache alike."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from specserve.kernels import reference
    from specserve.models.rotary import Rotary, apply_rotary
    from tiny_models import hf_config

    config = hf_config("phi3_longrope")
    rotary, cached = Rotary(config), Rotary(config, config.max_position_embeddings)
    assert rotary.long_offset == 512
    long_freq, scaling = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=257)
    short_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu")
    positions = torch.tensor([3, 300, 3 + 512, 300 + 512])
    cos, _ = rotary(positions, torch.float32)
    angles = positions[:, None].remainder(512).float() * torch.stack([short_freq, short_freq, long_freq, long_freq])
    torch.testing.assert_close(cos[:, 0, :8], angles.cos() * scaling)
    x = torch.randn(4, 2, 16, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(reference.rotary_embedding(x, x, positions, cached.cos_sin_cache)[0],
                               apply_rotary(x, *rotary(positions, torch.float32)), atol=1e-6, rtol=1e-5)


def test_merged_projections_as_stored_are_split_exactly(tiny_model_dir):
    """Phi-3 stores q/k/v and gate/up merged: they load part by part, to the same values."""
    hf = make_hf_model("phi3_longrope")
    ours = load_ours(tiny_model_dir("phi3_longrope"))
    assert torch.equal(ours.model.layers[1].self_attn.qkv_proj.weight, hf.model.layers[1].self_attn.qkv_proj.weight)
    assert torch.equal(ours.model.layers[0].mlp.gate_up_proj.weight, hf.model.layers[0].mlp.gate_up_proj.weight)


@pytest.mark.parametrize("variant", ["mixtral_moe", "qwen2_moe_shared"])
def test_only_the_routed_experts_run_and_equal_every_expert_weighted(variant, tiny_model_dir):
    """The CPU path (the chosen experts over their tokens) equals the GPU path's form (all
    experts, weighted by the routing); each token picks its own experts."""
    ours = load_ours(tiny_model_dir(variant))
    moe = ours.model.layers[0].mlp
    x = torch.randn(9, ours.config.hidden_size, generator=torch.Generator().manual_seed(0))
    weights, experts = moe.routing(x)
    assert len({tuple(sorted(e)) for e in experts.tolist()}) > 1
    assert torch.allclose(moe._routed(x, weights, experts), moe._dense(x, weights, experts), atol=1e-6)
    calls = []
    for i, expert in enumerate(moe.experts):
        expert.register_forward_hook(lambda _m, inp, _out, i=i: calls.append((i, inp[0].shape[0])))
    moe._routed(x[:1], *moe.routing(x[:1]))
    assert sorted(i for i, _ in calls) == sorted(moe.routing(x[:1])[1][0].tolist())  # k experts, no more


def test_a_dense_layer_of_a_moe_model_stays_dense(tiny_model_dir):
    """Qwen2-MoE's ``mlp_only_layers``: layer 1 has the plain MLP."""
    from specserve.models.mlp import MLP
    from specserve.models.moe import SparseMoE

    ours = load_ours(tiny_model_dir("qwen2_moe_shared"))
    assert isinstance(ours.model.layers[0].mlp, SparseMoE) and ours.model.layers[0].mlp.shared_expert is not None
    assert isinstance(ours.model.layers[1].mlp, MLP)


def test_what_is_not_supported_is_refused_by_name(tiny_model_dir, tmp_path):
    import shutil

    path = tmp_path / "phi3-like"
    shutil.copytree(tiny_model_dir("phi3_longrope"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "partial_rotary_factor": 0.7}))
    with pytest.raises(ModelLoadError, match="partial_rotary_factor 0.7 gives 11 rotary dimensions of 16"):
        load_ours(path)
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["FalconForCausalLM"],
                                                  "model_type": "falcon"}))
    with pytest.raises(ModelLoadError, match=r"decided by config.json's architectures \['FalconForCausalLM'\]\); "
                                             r"supported: .*MixtralForCausalLM.*Phi3ForCausalLM"):
        load_ours(path)
    (path / "config.json").write_text(json.dumps({**config, "architectures": None, "model_type": "falcon"}))
    with pytest.raises(ModelLoadError, match="decided by config.json's model_type 'falcon'"):
        load_ours(path)


def test_chunked_prefill_routes_each_token_on_its_own(tiny_model_dir):
    """A prompt's logits are the same whole or in chunks of 3 (verify spans route the same way)."""
    ours = load_ours(tiny_model_dir("qwen3_moe"))
    prompt = [[(7 * i) % 500 + 3 for i in range(30)]]
    assert (ragged_logits(ours, prompt, chunk=64)[0] - ragged_logits(ours, prompt, chunk=3)[0]).abs().max() < 1e-4


def test_gemma2_soft_caps_are_applied(tiny_model_dir, tmp_path):
    """Without its attention and final logit caps the tiny Gemma 2 gives other logits (so
    the logit test against transformers sees a cap that is ignored)."""
    import shutil

    prompt = [[(5 * i) % 400 + 3 for i in range(24)]]
    capped = ragged_logits(load_ours(tiny_model_dir("gemma2")), prompt, chunk=64)[0]
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        path = tmp_path / field
        shutil.copytree(tiny_model_dir("gemma2"), path)
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, field: None}))
        assert (ragged_logits(load_ours(path), prompt, chunk=64)[0] - capped).abs().max() > 0.5, field


def test_partial_rotary_reorders_each_head_once_and_rotates_only_its_share():
    """Phi-4-mini's 3/4 rotary: the reordering puts stored pairs (j, j + 6) of a 16-wide
    head at (j, j + 8); the 4 unrotated dimensions get angle 0 and scaling 1."""
    from specserve.models.rotary import rope_parameters, rotary_order
    from tiny_models import hf_config

    config = hf_config("phi4_mini_partial")
    order = rotary_order(config)
    assert order == [0, 1, 2, 3, 4, 5, 12, 13, 6, 7, 8, 9, 10, 11, 14, 15]
    inv_freq, scaling = rope_parameters(config)
    assert inv_freq[6:].tolist() == [0, 0] and inv_freq[:6].min() > 0
    assert scaling[6:].tolist() == [1, 1] and scaling[0] > 1  # LongRoPE's attention factor on the rotated ones
    assert rotary_order(hf_config("phi3_longrope")) is None
