"""Medusa heads in their published layout (``models/medusa.py``, ``drafts/medusa.py``): every
proposal equals the heads' definition over the target's final hidden state, decoding stays
lossless, and heads that are not exactly Medusa's are refused in one line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_eagle import (KS, PROMPTS, SMALL, check_lossless_under_preemption, check_seeded_sampling_is_reproducible,
                        greedy, record_all_proposals)
from tiny_models import LLM32

from specserve.errors import SpecserveError



def make_medusa_heads(target_dir, path: Path, num_heads: int = 3, num_layers: int = 1, fmt: str = "pt",
                      seed: int = 0) -> tuple[str, dict]:
    """Heads as the Medusa repository saves them (``medusa/model/medusa_model.py``): the
    state dict of its ``medusa_head`` ModuleList in ``medusa_lm_head.pt`` (``fmt`` "pt"), or
    under ``medusa_head.`` in model.safetensors; a config.json that names 5 heads whatever
    the file holds, as the published ones do. Returns (path, state by ``medusa_head.`` names)."""
    path.mkdir(parents=True, exist_ok=True)
    target = json.loads((Path(target_dir) / "config.json").read_text())
    h, vocab = target["hidden_size"], target["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    state = {}
    for i in range(num_heads):
        for j in range(num_layers):
            state[f"{i}.{j}.linear.weight"] = torch.randn(h, h, generator=g) * 0.2
            state[f"{i}.{j}.linear.bias"] = torch.randn(h, generator=g) * 0.1
        state[f"{i}.{num_layers}.weight"] = torch.randn(vocab, h, generator=g) * 0.3
    (path / "config.json").write_text(json.dumps({"medusa_num_heads": 5, "medusa_num_layers": num_layers,
                                                  "base_model_name_or_path": str(target_dir)}))
    named = {f"medusa_head.{k}": v for k, v in state.items()}
    if fmt == "pt":
        torch.save(state, path / "medusa_lm_head.pt")
    else:
        save_file(named, str(path / "model.safetensors"))
    return str(path), named


def medusa_drafts(target, state: dict, num_layers: int, tokens: list[int], start: int, k: int) -> list[int]:
    """Head i's argmax over the target's final hidden state at position start - 1, after
    ``num_layers`` blocks x + SiLU(W x + b): the heads' definition, straight."""
    with torch.no_grad():
        x0 = target.model(input_ids=torch.tensor([tokens[:start]])).last_hidden_state[0, -1]
        drafts = []
        for i in range(k):
            x = x0
            for j in range(num_layers):
                x = x + torch.nn.functional.silu(state[f"medusa_head.{i}.{j}.linear.weight"] @ x
                                                 + state[f"medusa_head.{i}.{j}.linear.bias"])
            drafts.append(int((state[f"medusa_head.{i}.{num_layers}.weight"] @ x).argmax()))
    return drafts


def medusa_llm(target_dir, head_dir, k: int = 3, **kwargs):
    return LLM32(str(target_dir), speculative_method="draft_model", draft_model=head_dir,
                 num_speculative_tokens=k, speculative_adaptive=False, **{**SMALL, **kwargs})


@pytest.mark.parametrize("fmt,num_layers", [("pt", 1), ("safetensors", 2)])
def test_medusa_heads_draft_what_their_definition_predicts(fmt, num_layers, tiny_model_dir, tmp_path):
    """Every proposal of every step (chunked prompts, mixed k, k above the number of heads)
    equals the heads over the target's hidden state, and greedy output equals plain decoding."""
    from transformers import AutoModelForCausalLM

    target_dir = tiny_model_dir("llama")
    head_dir, state = make_medusa_heads(target_dir, tmp_path / "heads", num_layers=num_layers, fmt=fmt)
    llm = medusa_llm(target_dir, head_dir, k=4)
    drafter = llm.engine.speculator.drafter
    assert f"Medusa: 3 heads of {num_layers} block(s)" in drafter.describe()
    proposals = record_all_proposals(drafter)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    params = [greedy(k) for k in KS]
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    want = LLM32(str(target_dir), **SMALL).generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert len(proposals) > 10 and max(len(d) for *_, d in proposals) == 3  # k = 4 capped at 3 heads
    for start, tokens, drafts in proposals:
        assert drafts == medusa_drafts(target, state, num_layers, tokens, start, len(drafts))
    assert llm.engine.spec_stats.num_drafts > 0
    assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks


def test_medusa_drafting_is_lossless_under_preemption_and_reproducible_when_sampled(tiny_model_dir, tmp_path):
    target_dir = tiny_model_dir("llama")
    head_dir, _ = make_medusa_heads(target_dir, tmp_path / "heads")
    check_lossless_under_preemption(medusa_llm(target_dir, head_dir, num_kv_blocks=20), target_dir)
    check_seeded_sampling_is_reproducible(lambda: medusa_llm(target_dir, head_dir))


def test_heads_that_are_not_exactly_medusas_are_refused(tiny_model_dir, tmp_path):
    target_dir = tiny_model_dir("llama")
    _, state = make_medusa_heads(target_dir, tmp_path / "heads", fmt="safetensors")
    cases = [
        ({**state, "model.norm.weight": torch.ones(64)}, "'model.norm.weight' is not a Medusa head's"),
        ({k: v for k, v in state.items() if k != "medusa_head.1.0.linear.bias"},
         "lack tensor 'medusa_head.1.0.linear.bias'"),
        ({**state, "medusa_head.1.0.linear.weight": torch.zeros(64, 32)},
         "has shape \\(64, 32\\), expected \\(64, 64\\)"),
        ({**state, "medusa_head.0.2.weight": torch.zeros(512, 64)}, "an LM head each .* at the same depth"),
        ({**state, "medusa_head.0.0.linear.bias": torch.zeros(64, dtype=torch.int32)}, "is int32"),
    ]
    for i, (bad_state, message) in enumerate(cases):
        path = tmp_path / f"bad{i}"
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1}))
        save_file(bad_state, str(path / "model.safetensors"))
        with pytest.raises(SpecserveError, match=message):
            medusa_llm(target_dir, str(path))
    other = tiny_model_dir("smollm2_tied_gqa3")  # hidden 96: heads made for another target
    head_dir, _ = make_medusa_heads(target_dir, tmp_path / "heads2")
    with pytest.raises(SpecserveError, match="a target of hidden size 96"):
        medusa_llm(other, head_dir)


def test_sampling_with_medusa_heads_has_the_target_distribution(tiny_model_dir, tmp_path):
    """4-token continuations (top_k = 2: 16 outcomes, exact from transformers) sampled with
    Medusa drafts, whose q at each depth ignores the earlier drafts: chi-square within its
    15 degrees of freedom. The heads are the target's own LM head (blocks at zero: the
    identity), so drafts are accepted often enough for the rejection path to matter."""
    from safetensors.torch import load_file
    from tiny_models import continuation_chi_square, exact_continuations

    from specserve.engine import LLMEngine

    target = str(tiny_model_dir("llama"))
    lm_head = load_file(Path(target) / "model.safetensors")["lm_head.weight"]
    head_dir, state = make_medusa_heads(target, tmp_path / "heads", fmt="safetensors")
    save_file({k: (lm_head.clone() if k.endswith(".1.weight") else torch.zeros_like(v)) for k, v in state.items()},
              str(tmp_path / "heads" / "model.safetensors"))
    prompt, length, sp = [5, 17, 99, 230, 17, 99], 4, dict(temperature=1.0, top_k=2)
    exact = exact_continuations(target, prompt, length, sp)
    engine = LLMEngine(dtype="float32", model=target, speculative_method="draft_model", draft_model=head_dir,
                       num_speculative_tokens=3, speculative_adaptive=False,
                       max_num_batched_tokens=4096, max_num_seqs=512, block_size=16, num_kv_blocks=2000)
    chi2 = continuation_chi_square(engine, prompt, sp, exact, 3000)
    stats = engine.spec_stats
    assert len(exact) == 16 and chi2 < 37.7, chi2  # p = 0.001 for 15 degrees of freedom
    assert stats.num_accepted_tokens > 0.1 * stats.num_draft_tokens, stats
