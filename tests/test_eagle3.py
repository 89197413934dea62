"""EAGLE-3 heads in their published layout (``models/eagle.py`` ``Eagle3ForCausalLM``): the
engine's proposals equal an independent whole-sequence forward of the head as the EAGLE
repository defines it, decoding stays lossless, and malformed heads are refused in one line."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_eagle import (KS, PROMPTS, SMALL, check_lossless_under_preemption, check_seeded_sampling_is_reproducible,
                        eagle_llm, greedy, record_all_proposals, record_proposals)
from tiny_models import LLM32, make_hf_model

from specserve.errors import SpecserveError



@pytest.fixture(scope="module")
def deep_target(tmp_path_factory, tiny_tokenizer):
    """Tiny llamas deep enough for three distinct feature layers: layers -> directory."""
    made = {}

    def build(layers: int = 4, **overrides) -> Path:
        key = (layers, tuple(sorted(overrides.items())))
        if key not in made:
            path = tmp_path_factory.mktemp(f"deep-{layers}")
            make_hf_model("llama", num_hidden_layers=layers, **overrides).save_pretrained(path)
            tiny_tokenizer.save_pretrained(path)
            made[key] = path
        return made[key]

    return build


def make_eagle3_head(target_dir, path: Path, layer_ids: list[int] | None = (0, 2, 3), draft_vocab: int = 200,
                     seed: int = 0, embed_copy: bool = False, norm_before_residual: bool = False,
                     fmt: str = "bin") -> tuple[str, dict]:
    """A head in the layout the EAGLE repository saves (``eagle/model/cnets.py``: ``Model``
    with ``midlayer`` a ``LlamaDecoderLayeremb``, ``fc`` of 3H -> H without bias, ``norm``,
    ``lm_head`` over ``draft_vocab_size`` tokens, buffers ``d2t`` (int64: target id - draft
    id) and ``t2d`` (bool over the target's vocabulary)), beside a config.json as its
    published heads ship it (``LlamaForCausalLMEagle3``, ``draft_vocab_size``,
    ``target_hidden_size``; ``eagle_aux_hidden_state_layer_ids`` as vLLM reads it).
    ``layer_ids`` None: no layer ids (EAGLE's default choice). Returns (path, state)."""
    path.mkdir(parents=True, exist_ok=True)
    target_config = json.loads((Path(target_dir) / "config.json").read_text())
    h, inter = target_config["hidden_size"], target_config["intermediate_size"]
    heads, kv_heads = target_config["num_attention_heads"], target_config["num_key_value_heads"]
    head_dim = target_config.get("head_dim") or h // heads
    vocab = target_config["vocab_size"]
    config = {k: target_config[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                            "num_key_value_heads", "rms_norm_eps", "vocab_size",
                                            "max_position_embeddings", "hidden_act", "bos_token_id",
                                            "eos_token_id") if k in target_config}
    config.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                  tie_word_embeddings=False, draft_vocab_size=draft_vocab, target_hidden_size=h,
                  rope_theta=target_config.get("rope_theta", 10000.0), torch_dtype="float32")
    if "head_dim" in target_config:
        config["head_dim"] = head_dim
    if layer_ids is not None:
        config["eagle_aux_hidden_state_layer_ids"] = list(layer_ids)
    if norm_before_residual:
        config["norm_before_residual"] = True
    (path / "config.json").write_text(json.dumps(config, indent=2))
    g = torch.Generator().manual_seed(seed)
    q, kv = heads * head_dim, kv_heads * head_dim
    shapes = {"midlayer.self_attn.q_proj.weight": (q, 2 * h), "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
              "midlayer.self_attn.v_proj.weight": (kv, 2 * h), "midlayer.self_attn.o_proj.weight": (h, q),
              "midlayer.mlp.gate_proj.weight": (inter, h), "midlayer.mlp.up_proj.weight": (inter, h),
              "midlayer.mlp.down_proj.weight": (h, inter), "fc.weight": (h, 3 * h),
              "lm_head.weight": (draft_vocab, h)}
    state = {name: torch.randn(*shape, generator=g) * (0.25 if name == "lm_head.weight" else 0.08)
             for name, shape in shapes.items()}
    for name in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        state[f"{name}.weight"] = 1 + torch.randn(h, generator=g) * 0.1
    # The draft vocabulary: every id of a scattered subset, ascending (as EAGLE's scandata sorts it).
    used = torch.sort(torch.randperm(vocab, generator=g)[:draft_vocab]).values
    state["d2t"] = used - torch.arange(draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    state["t2d"] = t2d
    if embed_copy:
        from safetensors.torch import load_file

        state["embed_tokens.weight"] = load_file(Path(target_dir) / "model.safetensors")["model.embed_tokens.weight"]
    if fmt == "bin":
        torch.save(state, path / "pytorch_model.bin")
    else:
        save_file(state, str(path / "model.safetensors"))
    return str(path), state


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def eagle3_drafts(target, config: dict, state: dict, layer_ids, tokens: list[int], start: int, k: int,
                  norm_before_residual: bool = False) -> list[int]:
    """The head's k greedy drafts after ``tokens[:start + 1]`` from its definition, a whole
    forward per draft and no cache: entry j reads embed(x_{j+1}) and f_j, f_j = fc of the
    target's hidden states entering ``layer_ids`` (transformers' ``hidden_states[i]``) where
    the target computed j, else the head's output at j - 1; attention over
    [norm(embed); norm(f)] with rotary positions 0..j; logits lm_head(norm(out)) over the
    draft vocabulary, draft id d meaning token d + d2t[d]."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    eps, h = config["rms_norm_eps"], config["hidden_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or h // heads
    rotary = LlamaRotaryEmbedding(LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"}))
    w = {name.removeprefix("midlayer."): t.float() for name, t in state.items()}
    ids = torch.tensor([tokens[:start + 1]])

    def midlayer(emb: torch.Tensor, feat: torch.Tensor) -> torch.Tensor:
        length = emb.shape[1]
        normed = rms(feat, w["hidden_norm.weight"], eps)
        residual = normed if norm_before_residual else feat
        x = torch.cat([rms(emb, w["input_layernorm.weight"], eps), normed], dim=-1)
        q = (x @ w["self_attn.q_proj.weight"].T).view(1, length, heads, head_dim).transpose(1, 2)
        kk = (x @ w["self_attn.k_proj.weight"].T).view(1, length, kv_heads, head_dim).transpose(1, 2)
        v = (x @ w["self_attn.v_proj.weight"].T).view(1, length, kv_heads, head_dim).transpose(1, 2)
        cos, sin = rotary(x, torch.arange(length)[None])
        q, kk = apply_rotary_pos_emb(q, kk, cos, sin)
        group = heads // kv_heads
        attn = torch.nn.functional.scaled_dot_product_attention(
            q, kk.repeat_interleave(group, 1), v.repeat_interleave(group, 1), is_causal=True)
        hid = residual + attn.transpose(1, 2).reshape(1, length, -1) @ w["self_attn.o_proj.weight"].T
        y = rms(hid, w["post_attention_layernorm.weight"], eps)
        mlp = (torch.nn.functional.silu(y @ w["mlp.gate_proj.weight"].T) * (y @ w["mlp.up_proj.weight"].T))
        return hid + mlp @ w["mlp.down_proj.weight"].T

    with torch.no_grad():
        states = target(input_ids=ids[:, :start], output_hidden_states=True).hidden_states
        features = torch.cat([states[i] for i in sorted(layer_ids)], dim=-1) @ w["fc.weight"].T
        fed, drafts = ids[:, 1:], []
        for _ in range(k):
            out = midlayer(target.model.embed_tokens(fed), features)[:, -1]
            d = (rms(out, w["norm.weight"], eps) @ w["lm_head.weight"].T).argmax().item()
            drafts.append(d + int(state["d2t"][d]))
            fed, features = torch.cat([fed, torch.tensor([[drafts[-1]]])], 1), torch.cat([features, out[:, None]], 1)
    return drafts


@pytest.mark.parametrize("fmt,embed_copy,norm_before_residual", [
    ("bin", False, False), ("safetensors", True, False), ("bin", False, True)])
def test_a_published_eagle3_head_drafts_what_its_definition_predicts(fmt, embed_copy, norm_before_residual,
                                                                      deep_target, tmp_path):
    """Loaded from its own files: the engine's first proposals of each request equal the
    independent forward above, they come from the draft vocabulary only, and greedy
    decoding equals plain greedy decoding (float32)."""
    from transformers import AutoModelForCausalLM

    target_dir = deep_target(4)
    head_dir, state = make_eagle3_head(target_dir, tmp_path / "head", fmt=fmt, embed_copy=embed_copy,
                                       norm_before_residual=norm_before_residual)
    llm = eagle_llm(target_dir, head_dir, k=4, max_num_batched_tokens=64)
    drafter = llm.engine.speculator.drafter
    assert "EAGLE-3 head: 1 layer(s) over target layers 0, 2, 3" in drafter.describe()
    assert drafter.model.model.embed_tokens is llm.engine.runner.model.model.embed_tokens
    assert drafter.model.lm_head is not llm.engine.runner.model.lm_head
    proposals = record_proposals(drafter)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    config = json.loads((Path(head_dir) / "config.json").read_text())
    vocab = set((torch.arange(200) + state["d2t"]).tolist())
    plain = LLM32(str(target_dir), **SMALL)
    for prompt in PROMPTS[:3]:
        proposals.clear()
        got = llm.generate([prompt], greedy(4, max_tokens=8), use_tqdm=False)[0]
        start, tokens, drafts = proposals[0]
        assert start == len(prompt)
        assert drafts == eagle3_drafts(target, config, state, (0, 2, 3), tokens, start, 4, norm_before_residual)
        assert set(drafts) <= vocab
        assert got.token_ids == plain.generate([prompt], greedy(max_tokens=8), use_tqdm=False)[0].token_ids


def test_an_eagle3_head_is_lossless_with_mixed_k_preemption_and_sampling(deep_target, tmp_path):
    target_dir = deep_target(4)
    head_dir, _ = make_eagle3_head(target_dir, tmp_path / "head")
    check_lossless_under_preemption(eagle_llm(target_dir, head_dir, num_kv_blocks=24), target_dir)
    check_seeded_sampling_is_reproducible(lambda: eagle_llm(target_dir, head_dir))


def test_the_target_keeps_its_feature_layers_on_every_path(deep_target, tmp_path):
    """The target's kept rows are its residual stream entering the feature layers, as
    transformers' ``hidden_states`` give them, on the plain path and on the graph paths
    (eagerly here): same tokens and accepted drafts either way."""
    from transformers import AutoModelForCausalLM

    target_dir = deep_target(4)
    head_dir, _ = make_eagle3_head(target_dir, tmp_path / "head")
    eager = {"max_num_batched_tokens": 64, "enforce_eager": True}  # (a GPU's own graphs: the test below)
    llm = eagle_llm(target_dir, head_dir, **eager)
    runner = llm.engine.runner
    assert runner.model.feature_layers == (0, 2, 3)
    kept = []
    forward = runner.forward
    runner.forward = lambda batch, *a: (forward(batch, *a), kept.append(
        (batch.input_ids.clone(), runner.last_hidden.clone())))[0]
    prompt = PROMPTS[2]
    llm.generate([prompt], greedy(0, max_tokens=1), use_tqdm=False)
    ids, rows = (t.cpu() for t in kept[0])  # (transformers' model on the CPU)
    assert ids.tolist() == prompt
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        states = target(input_ids=ids[None], output_hidden_states=True).hidden_states
    torch.testing.assert_close(rows, torch.cat([states[i][0] for i in (0, 2, 3)], -1), atol=1e-5, rtol=1e-5)
    params = [greedy(k) for k in KS]
    plain = eagle_llm(target_dir, head_dir, **eager)
    plain_proposals = record_proposals(plain.engine.speculator.drafter)
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    graphed = eagle_llm(target_dir, head_dir, **eager)
    graphed.engine.enable_graphs(capture=False)
    proposals = record_proposals(graphed.engine.speculator.drafter)
    got = graphed.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert proposals == plain_proposals and len(proposals) > 10  # the same features, step by step


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures real CUDA graphs")
def test_captured_graphs_hand_an_eagle3_head_the_eager_features_on_cuda(deep_target, tmp_path):
    """On a GPU, with real captures: the graphs' kept rows are the feature layers' (float32
    greedy tokens and proposals equal the eager engine's)."""
    target_dir = deep_target(4)
    head_dir, _ = make_eagle3_head(target_dir, tmp_path / "head")
    kwargs = dict(device="cuda", block_size=16, num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=64,
                  gpu_memory_utilization=0.05)
    params = [greedy(k) for k in KS]
    eager = eagle_llm(target_dir, head_dir, enforce_eager=True, **kwargs)
    want_proposals = record_proposals(eager.engine.speculator.drafter)
    want = eager.generate(PROMPTS, params, use_tqdm=False)
    llm = eagle_llm(target_dir, head_dir, **kwargs)
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.capture
    assert llm.engine.speculator.drafter.runner.graphs.capture  # the head's passes are replays too
    proposals = record_proposals(llm.engine.speculator.drafter)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert proposals == want_proposals and len(proposals) > 10
    assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks


def test_without_layer_ids_a_head_reads_eagles_default_layers(deep_target, tmp_path):
    target_dir = deep_target(8)
    head_dir, _ = make_eagle3_head(target_dir, tmp_path / "head", layer_ids=None)
    llm = eagle_llm(target_dir, head_dir)
    assert llm.engine.runner.model.feature_layers == (2, 4, 5)  # (2, L // 2, L - 3)
    got = llm.generate(PROMPTS[:2], [greedy(3)] * 2, use_tqdm=False)
    want = LLM32(str(target_dir), **SMALL).generate(PROMPTS[:2], [greedy(3)] * 2, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_an_eagle3_head_takes_prefix_cache_hits_from_the_target_features_it_was_given(deep_target, tmp_path):
    """Shared-prefix rounds (``test_prefix_cache``) with prefix caching on and off: the same
    greedy output, hits taken, every proposal of the cached engine equal to the head's
    definition (so no entry read features the target never computed), no leaked blocks."""
    from test_prefix_cache import SMALL as CACHE_SMALL
    from test_prefix_cache import generate_rounds
    from transformers import AutoModelForCausalLM

    target_dir = deep_target(4)
    head_dir, state = make_eagle3_head(target_dir, tmp_path / "head")
    options = dict(speculative_method="draft_model", draft_model=head_dir, num_speculative_tokens=3,
                   speculative_adaptive=False, **CACHE_SMALL)
    on, off = LLM32(str(target_dir), **options), LLM32(str(target_dir), **options, enable_prefix_caching=False)
    proposals = record_all_proposals(on.engine.speculator.drafter)
    assert generate_rounds(on) == generate_rounds(off)
    kv = on.engine.kv
    assert kv.num_hit_tokens > 0 and kv.draft_cache == "features" and kv.num_free_blocks == kv.num_blocks
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    config = json.loads((Path(head_dir) / "config.json").read_text())
    checked = proposals[::7]
    assert len(checked) > 5
    for start, tokens, drafts in checked:
        assert drafts == eagle3_drafts(target, config, state, (0, 2, 3), tokens, start, len(drafts))


def _edit(head_dir: str, path: Path, config: dict | None = None, state: dict | None = None) -> str:
    shutil.copytree(head_dir, path)
    if config is not None:
        merged = {**json.loads((path / "config.json").read_text()), **config}
        (path / "config.json").write_text(json.dumps({k: v for k, v in merged.items() if v is not None}))
    if state is not None:
        torch.save(state, path / "pytorch_model.bin")
    return str(path)


def test_malformed_eagle3_heads_are_refused_in_one_line(deep_target, tmp_path):
    target_dir = deep_target(4)
    head_dir, state = make_eagle3_head(target_dir, tmp_path / "head")
    other_used = state["t2d"].clone()
    other_used[other_used.nonzero()[0]] = False
    other_used[(~state["t2d"]).nonzero()[0]] = True
    wrong_embed = {**state, "embed_tokens.weight": torch.zeros(512, 64)}
    cases = [
        ({"eagle_aux_hidden_state_layer_ids": [0, 2, 9]}, None, "reads 3 distinct target layers below 4"),
        ({"eagle_aux_hidden_state_layer_ids": [1, 1, 2]}, None, "reads 3 distinct target layers"),
        ({"eagle_config": {"use_aux_hidden_state": False}}, None, "without auxiliary hidden states"),
        (None, {**state, "t2d": other_used}, "t2d and d2t name different draft vocabularies"),
        (None, {**state, "d2t": state["d2t"] + 400}, "outside the vocabulary"),
        (None, {**state, "d2t": state["d2t"][:-1]}, "d2t must hold 200 integers"),
        (None, {k: v for k, v in state.items() if k not in ("d2t", "t2d")}, "no d2t map"),
        (None, {k: v for k, v in state.items() if k != "fc.weight"}, "lacks 1 tensors, e.g. fc.weight"),
        (None, wrong_embed, "'model.embed_tokens.weight' differs from the target's"),
        (None, {**state, "midlayer.extra.weight": torch.zeros(2)}, "unexpected tensor"),
    ]
    for i, (config, new_state, message) in enumerate(cases):
        bad = _edit(head_dir, tmp_path / f"bad{i}", config, new_state)
        with pytest.raises(SpecserveError, match=message):
            eagle_llm(target_dir, bad)
    (Path(_edit(head_dir, tmp_path / "vocab")) / "draft_vocab.json").write_text("[1, 2, 3]")
    with pytest.raises(SpecserveError, match="carries its draft vocabulary in its d2t map"):
        eagle_llm(target_dir, str(tmp_path / "vocab"))
    small = deep_target(4, hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(SpecserveError, match="shares its target's embeddings but has hidden size 64"):
        eagle_llm(small, head_dir)


# ---------------------------------------------------------------------------- training (--arch eagle3)
PUBLISHED_KEYS = {f"midlayer.{name}.weight" for name in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
    "mlp.down_proj", "input_layernorm", "hidden_norm", "post_attention_layernorm")} | {
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}


def test_a_head_trained_here_round_trips_through_the_published_layout(deep_target, tmp_path):
    """A training head (weights nudged at random, rounded to bf16), saved by ``save_eagle3``:
    its files hold exactly the published tensors and config fields; the engine loads it and
    proposes what the training head's unrolled passes predict, which is also what the
    independent definition above predicts from the saved tensors."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from specserve.loader import resolve_model
    from specserve.training.draft import build_draft
    from specserve.training.eagle3_head import Eagle3Head, save_eagle3

    target_dir = deep_target(4)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    vocab = torch.unique(torch.randint(0, 512, (300,), generator=torch.Generator().manual_seed(3)))
    draft = build_draft(target, [3], torch.device("cpu"), target.config.intermediate_size)
    head = Eagle3Head(target, draft.model.layers[0], draft.model.norm, (3, 0, 2), vocab)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
            p.copy_(p.to(torch.bfloat16).float())
    save_eagle3(head.eval(), resolve_model(str(target_dir)), [3], tmp_path / "head")
    state = load_file(tmp_path / "head" / "model.safetensors")
    assert set(state) == PUBLISHED_KEYS and state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    assert torch.equal(torch.arange(len(vocab)) + state["d2t"], vocab)
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == len(vocab) and config["target_hidden_size"] == 64
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]
    k = 4
    llm = eagle_llm(target_dir, str(tmp_path / "head"), k=k, max_num_batched_tokens=64)
    proposals = record_proposals(llm.engine.speculator.drafter)
    for prompt in PROMPTS[:3]:
        proposals.clear()
        llm.generate([prompt], greedy(k, max_tokens=8), use_tqdm=False)
        start, tokens, drafts = proposals[0]
        ids = torch.tensor([tokens[:start + 1] + drafts[:-1]])
        with torch.no_grad():
            features, _ = head.read_target(ids)
            outs = head(ids, features, k)
            predicted = [vocab[head.logits(outs[t][0, start - 1 + t], vocab).argmax()].item() for t in range(k)]
        assert predicted == drafts
        assert drafts == eagle3_drafts(target, config, state, (0, 2, 3), tokens, start, k)


def test_the_eagle3_training_pipeline_runs_end_to_end(deep_target, tmp_path):
    from specserve.training.main import main

    target = str(deep_target(4))
    argv = ["--target", target, "--work-dir", str(tmp_path / "work"), "--device", "cpu", "--arch", "eagle3",
            "--num-prompts", "6", "--num-val-prompts", "2", "--max-new-tokens", "8", "--max-seq-len", "256",
            "--batch-tokens", "512", "--eval-prompts", "1", "--eval-max-tokens", "6", "--eval-baselines", "",
            "--passes", "3", "--draft-vocab", "64", "--eagle3-layers", "0,1,-1"]
    record = main(argv + ["--steps", "3", "--out", str(tmp_path / "head")])
    assert record["training"]["steps"] == 3 and record["feature_layers"] == [0, 1, 3]
    assert set(record["evaluation"]["mean_acceptance_length"]) == {"draft_model"}
    assert not (tmp_path / "head" / "draft_vocab.json").exists()  # its vocabulary is in d2t
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["draft_vocab_size"] == 64 and config["specserve_draft"]["layout"] == "eagle3"
    card = (tmp_path / "head" / "MODEL_CARD.md").read_text()
    assert "EAGLE-3 draft head" in card and "[0, 1, 3]" in card and "64 tokens most frequent" in card
    # It continues from itself (--init-from), and only as an EAGLE-3 head.
    again = main(argv + ["--steps", "1", "--lr", "0", "--init-from", str(tmp_path / "head"),
                         "--out", str(tmp_path / "head2")])
    assert again["training"]["final_val"]["kl"] == pytest.approx(record["training"]["final_val"]["kl"], rel=0.05)
    with pytest.raises(SystemExit, match="is an EAGLE-3 head: add --arch eagle3"):
        main([a if a != "eagle3" else "eagle" for a in argv] + ["--steps", "1", "--init-from", str(tmp_path / "head"),
                                                                "--out", str(tmp_path / "head3")])
    with pytest.raises(SystemExit, match="three distinct layers"):
        main(argv[:-1] + ["0,0,1", "--steps", "1", "--out", str(tmp_path / "head4")])
