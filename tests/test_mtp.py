"""A target's own multi-token-prediction layer as its draft (``speculative_method "mtp"``):
MiMo's ``model.mtp_layers.0`` beside a Qwen2 model. The target loads exactly without them,
the engine's proposals equal the MTP layer's definition (vLLM's ``mimo_mtp.py``), decoding
stays lossless, and a target without MTP layers is refused in one line."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_eagle import (KS, PROMPTS, SMALL, check_lossless_under_preemption, check_seeded_sampling_is_reproducible,
                        greedy, record_proposals)
from test_eagle3 import rms
from tiny_models import LLM32

from specserve.errors import SpecserveError



@pytest.fixture(scope="module")
def mimo(tiny_model_dir, tmp_path_factory) -> tuple[Path, Path, dict]:
    """(the tiny Qwen2's folder, the same model as a MiMo checkpoint with one MTP layer of
    random weights beside it, those MTP tensors)."""
    plain = tiny_model_dir("qwen2_bias")
    path = tmp_path_factory.mktemp("mimo")
    shutil.copytree(plain, path, dirs_exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["MiMoForCausalLM"], model_type="mimo", num_nextn_predict_layers=1)
    (path / "config.json").write_text(json.dumps(config))
    h, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    g = torch.Generator().manual_seed(5)
    shapes = {"input_proj.weight": (h, 2 * h), "self_attn.q_proj.weight": (q, h), "self_attn.q_proj.bias": (q,),
              "self_attn.k_proj.weight": (kv, h), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.weight": (kv, h),
              "self_attn.v_proj.bias": (kv,), "self_attn.o_proj.weight": (h, q), "mlp.gate_proj.weight": (inter, h),
              "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter)}
    mtp = {f"model.mtp_layers.0.{name}": torch.randn(*shape, generator=g) * 0.1 for name, shape in shapes.items()}
    for name in ("token_layernorm", "hidden_layernorm", "final_layernorm", "input_layernorm",
                 "post_attention_layernorm"):
        mtp[f"model.mtp_layers.0.{name}.weight"] = 1 + torch.randn(h, generator=g) * 0.1
    save_file({**load_file(path / "model.safetensors"), **mtp}, str(path / "model.safetensors"))
    return plain, path, mtp


def mtp_drafts(target, config: dict, mtp: dict, tokens: list[int], start: int, k: int) -> list[int]:
    """The MTP layer's k greedy drafts after ``tokens[:start + 1]``, a whole forward per
    draft: entry j embeds x_{j+1} (zero at position 0), norms it and the feature (the
    target's final hidden state h_j, else the layer's own output), ``input_proj`` of
    [feature; embedding], a Qwen2 decoder layer, ``final_layernorm``, the target's LM head."""
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding, apply_rotary_pos_emb

    eps, heads, kv_heads = config["rms_norm_eps"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config["hidden_size"] // heads
    w = {name.removeprefix("model.mtp_layers.0."): t for name, t in mtp.items()}
    rotary = Qwen2RotaryEmbedding(Qwen2Config(**{k: v for k, v in config.items() if k not in ("architectures",
                                                                                               "model_type")}))

    def layer(feat: torch.Tensor, fed: torch.Tensor) -> torch.Tensor:
        length = fed.shape[1]
        emb = target.model.embed_tokens(fed)
        emb[:, 0] = 0  # position 0
        x = torch.cat([rms(feat, w["hidden_layernorm.weight"], eps), rms(emb, w["token_layernorm.weight"], eps)], -1)
        x = x @ w["input_proj.weight"].T
        y = rms(x, w["input_layernorm.weight"], eps)
        proj = {n: y @ w[f"self_attn.{n}_proj.weight"].T + w[f"self_attn.{n}_proj.bias"] for n in "qkv"}
        qh = proj["q"].view(1, length, heads, head_dim).transpose(1, 2)
        kh = proj["k"].view(1, length, kv_heads, head_dim).transpose(1, 2)
        vh = proj["v"].view(1, length, kv_heads, head_dim).transpose(1, 2)
        cos, sin = rotary(y, torch.arange(length)[None])
        qh, kh = apply_rotary_pos_emb(qh, kh, cos, sin)
        group = heads // kv_heads
        attn = torch.nn.functional.scaled_dot_product_attention(qh, kh.repeat_interleave(group, 1),
                                                                vh.repeat_interleave(group, 1), is_causal=True)
        x = x + attn.transpose(1, 2).reshape(1, length, -1) @ w["self_attn.o_proj.weight"].T
        y = rms(x, w["post_attention_layernorm.weight"], eps)
        x = x + (torch.nn.functional.silu(y @ w["mlp.gate_proj.weight"].T) * (y @ w["mlp.up_proj.weight"].T)) \
            @ w["mlp.down_proj.weight"].T
        return rms(x, w["final_layernorm.weight"], eps)

    ids = torch.tensor([tokens[:start + 1]])
    with torch.no_grad():
        features = target.model(input_ids=ids[:, :start]).last_hidden_state
        fed, drafts = ids[:, 1:], []
        for _ in range(k):
            out = layer(features, fed)[:, -1]
            drafts.append(target.lm_head(out).argmax().item())
            fed, features = torch.cat([fed, torch.tensor([[drafts[-1]]])], 1), torch.cat([features, out[:, None]], 1)
    return drafts


def mtp_llm(path, k: int = 4, **kwargs):
    return LLM32(str(path), speculative_method="mtp", num_speculative_tokens=k, speculative_adaptive=False,
                 **{**SMALL, **kwargs})


def test_a_mimo_target_loads_exactly_without_its_mtp_layers(mimo):
    plain, path, _ = mimo
    params = [greedy(k) for k in KS]
    got = LLM32(str(path), **SMALL).generate(PROMPTS, params, use_tqdm=False)
    want = LLM32(str(plain), **SMALL).generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_the_mtp_layer_drafts_what_its_definition_predicts(mimo):
    from transformers import AutoModelForCausalLM

    plain, path, mtp = mimo
    llm = mtp_llm(path, max_num_batched_tokens=64)
    drafter = llm.engine.speculator.drafter
    assert drafter.describe().startswith("mtp (the target's own multi-token-prediction layer 0 of 1")
    assert drafter.model.lm_head is llm.engine.runner.model.lm_head
    proposals = record_proposals(drafter)
    target = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    config = json.loads((path / "config.json").read_text())
    for prompt in PROMPTS[:3]:
        proposals.clear()
        got = llm.generate([prompt], greedy(4, max_tokens=10), use_tqdm=False)[0]
        assert len(proposals) > 1
        for start, tokens, drafts in proposals:
            assert drafts == mtp_drafts(target, config, mtp, tokens, start, len(drafts))
        want = LLM32(str(plain), **SMALL).generate([prompt], greedy(max_tokens=10), use_tqdm=False)[0]
        assert got.token_ids == want.token_ids


def test_mtp_drafting_is_lossless_with_mixed_k_preemption_and_sampling(mimo):
    plain, path, _ = mimo
    check_lossless_under_preemption(mtp_llm(path, num_kv_blocks=20), plain)
    check_seeded_sampling_is_reproducible(lambda: mtp_llm(path))


def test_mtp_needs_a_target_with_mtp_layers(mimo):
    plain, _, _ = mimo
    with pytest.raises(SpecserveError, match="speculative_method 'mtp' drafts with the multi-token-prediction"):
        mtp_llm(plain)
