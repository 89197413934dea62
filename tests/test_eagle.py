"""EAGLE-style draft heads: drafting from the target's hidden states in the engine (lossless,
no leaked blocks, under chunked prefill and preemption), the engine's proposals equal to
what the training head's unrolled passes predict, and the training pipeline with
``--arch eagle``."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import LLM32, make_eagle_head

from specserve import SamplingParams
from specserve.errors import SpecserveError

PROMPTS = [[5, 17, 99, 230, 17, 99], [7, 8, 9, 7, 8, 9, 10], list(range(3, 40)), [11, 12], [40, 41, 40, 41, 40]]
KS = (4, 2, 3, 0, 1)  # per request: proposals of several lengths, and a request that only keeps up
SMALL = {"max_num_batched_tokens": 16, "max_num_seqs": 8, "block_size": 4, "num_kv_blocks": 200}


def greedy(k: int | None = None, max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, num_speculative_tokens=k)


@pytest.fixture(scope="module")
def eagle(tmp_path_factory, tiny_model_dir):
    """variant -> (target dir, head dir, the training head in float32)."""
    made = {}

    def build(variant: str = "smollm2_tied_gqa3", layers: tuple[int, ...] = (1,), input_norms: bool = False):
        key = (variant, layers, input_norms)
        if key not in made:
            target_dir = tiny_model_dir(variant)
            path = tmp_path_factory.mktemp(f"eagle-{variant}")
            made[key] = (target_dir, *make_eagle_head(target_dir, list(layers), path, input_norms=input_norms))
        return made[key]

    return build


def eagle_llm(target_dir, head_dir, k: int = 4, **kwargs):
    return LLM32(str(target_dir), speculative_method="draft_model", draft_model=head_dir,
                 num_speculative_tokens=k, speculative_adaptive=False, **{**SMALL, **kwargs})


def test_an_eagle_head_left_at_the_default_cap_runs_padded_steps_losslessly(eagle):
    """No k given: the head's graphs are sized by the engine's own cap (``max_draft_tokens``),
    here the padded path a GPU's graphs take, run eagerly."""
    target_dir, head_dir, _ = eagle()
    llm = LLM32(str(target_dir), speculative_method="draft_model", draft_model=head_dir, **SMALL)
    assert llm.engine.config.num_speculative_tokens is None
    llm.engine.enable_graphs(capture=False)
    got = llm.generate(PROMPTS, greedy(None), use_tqdm=False)
    want = LLM32(str(target_dir), **SMALL).generate(PROMPTS, greedy(None), use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert llm.engine.spec_stats.num_drafts > 0


@pytest.mark.parametrize("variant", ["smollm2_tied_gqa3", "llama", "qwen3_qknorm"])
def test_an_eagle_head_is_lossless_with_chunked_prefill_and_mixed_k(variant, eagle):
    target_dir, head_dir, _ = eagle(variant)
    llm = eagle_llm(target_dir, head_dir)
    engine = llm.engine
    assert "EAGLE head" in engine.speculator.drafter.describe()
    assert engine.speculator.drafter.model.model.embed_tokens is engine.runner.model.model.embed_tokens
    params = [greedy(k) for k in KS]
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    want = LLM32(str(target_dir), **SMALL).generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert engine.spec_stats.num_drafts > 0 and engine.spec_stats.num_accepted_tokens > 0
    assert engine.num_free_blocks == engine.kv.num_blocks
    assert not engine.speculator.drafter._features and not engine.speculator.drafter._fed  # finished requests forgotten


def check_lossless_under_preemption(llm, target_dir) -> None:
    """``llm`` drafts with a KV cache too small for every request at once: some are
    preempted and recomputed (their draft state rebuilt), and greedy output still equals
    plain decoding's, with drafts made and no block leaked."""
    params = [greedy(k, max_tokens=30) for k in KS]
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.spec_stats.num_drafts > 0
    want = LLM32(str(target_dir), **SMALL).generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks


def check_seeded_sampling_is_reproducible(make_llm) -> None:
    """Two fresh engines from ``make_llm()`` sample every request alike, seed by seed."""
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=20, ignore_eos=True,
                             num_speculative_tokens=k) for i, k in enumerate(KS)]
    runs = []
    for _ in range(2):
        llm = make_llm()
        runs.append([o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)])
        assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks
    assert runs[0] == runs[1]


def test_an_eagle_head_is_lossless_under_preemption(eagle):
    target_dir, head_dir, _ = eagle()
    check_lossless_under_preemption(eagle_llm(target_dir, head_dir, num_kv_blocks=20), target_dir)


def test_seeded_sampling_with_an_eagle_head_is_reproducible(eagle):
    target_dir, head_dir, _ = eagle()
    check_seeded_sampling_is_reproducible(lambda: eagle_llm(target_dir, head_dir))


@pytest.mark.parametrize("variant,layers,input_norms", [
    ("smollm2_tied_gqa3", (1,), False), ("qwen3_qknorm", (1,), False), ("smollm2_tied_gqa3", (0, 1), False),
    ("smollm2_tied_gqa3", (1,), True), ("llama", (0, 1), True)])
def test_the_engine_drafts_what_the_training_head_predicts(variant, layers, input_norms, eagle):
    """Every proposal of the engine's first verify step of a request equals the argmax of
    the training head's pass t at position P - 1 + t, fed the prompt, the first sampled
    token and the earlier proposals (teacher-forced): the unrolled training passes see
    exactly what the engine's draft steps see (features, positions, attention, and the
    input norms where the head has them)."""
    target_dir, head_dir, head = eagle(variant, layers, input_norms)
    assert llm_config_input_norms(head_dir) is input_norms
    target = head.target
    k = 4
    llm = eagle_llm(target_dir, head_dir, k=k, max_num_batched_tokens=64)
    drafter = llm.engine.speculator.drafter
    proposals = record_proposals(drafter)
    for prompt in PROMPTS[:3]:
        proposals.clear()
        llm.generate([prompt], greedy(k, max_tokens=8), use_tqdm=False)
        start, tokens, drafts = proposals[0]
        assert start == len(prompt) and len(drafts) == k
        ids = torch.tensor([tokens[:start + 1] + drafts[:-1]])
        with torch.no_grad():
            features = target.model(input_ids=ids).last_hidden_state
            outs = head(ids, features, k)
            predicted = [target.lm_head(outs[t][0, start - 1 + t]).argmax().item() for t in range(k)]
        assert predicted == drafts


def record_proposals(drafter) -> list[tuple[int, list[int], list[int]]]:
    """Spy on ``drafter.propose``: the list it returns gets (start position, the request's
    tokens, its proposals) of the first request of each step that drafted."""
    proposals, propose = [], drafter.propose

    def spy(scheduled, requests, stop=None):
        out = propose(scheduled, requests, stop)
        if out.draft_ids is not None:
            proposals.append((scheduled[0].start_pos, requests[scheduled[0].req_id].all_token_ids[:],
                              out.draft_ids.tolist()))
        return out

    drafter.propose = spy
    return proposals


def record_all_proposals(drafter) -> list[tuple[int, list[int], list[int]]]:
    """Spy on ``drafter.propose``: (start position, tokens, proposals) of every request
    that drafted, every step."""
    proposals, propose = [], drafter.propose

    def spy(scheduled, requests, stop=None):
        out = propose(scheduled, requests, stop)
        if out.draft_ids is not None:
            flat, at = out.draft_ids.tolist(), 0
            for planned, placeholders in zip(scheduled, out.draft_token_ids):
                if placeholders:
                    proposals.append((planned.start_pos, requests[planned.req_id].all_token_ids[:],
                                      flat[at:at + len(placeholders)]))
                at += len(placeholders)
        return out

    drafter.propose = spy
    return proposals


def llm_config_input_norms(head_dir) -> bool:
    return json.loads((Path(head_dir) / "config.json").read_text())["specserve_draft"]["input_norms"]


def test_an_eagle_head_must_share_the_target_embeddings(eagle, tmp_path):
    import shutil

    target_dir, head_dir, _ = eagle()
    shutil.copytree(head_dir, tmp_path / "head")
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    config["specserve_draft"]["shares_target_embeddings"] = False
    (tmp_path / "head" / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecserveError, match="EAGLE head without shares_target_embeddings"):
        eagle_llm(target_dir, str(tmp_path / "head"))


def test_chain_acceptance_replays_chain_drafting():
    from specserve.training.validation import chain_acceptance

    # Token 0 from the prefill. Chain from token 1: pass 0 right on 1, pass 1 right on 2,
    # pass 2 wrong on 3 -> 2 accepted, token 3 emitted. Next chain from token 4: pass 0
    # wrong -> 0 accepted, token 4 emitted. From token 5: k = 2 caps a run of 2; the end.
    agree = [[False, True, False, False, False, True, False, False],
             [False, False, True, False, False, False, True, False],
             [False, False, False, False, False, False, False, True]]
    assert chain_acceptance(agree, k=2) == (3, 4)
    assert chain_acceptance(agree, k=3) == (3, 5)


def test_validation_reports_every_kinds_answers_even_none():
    """Per kind: the greedy answers replayed, their chain acceptance and top-1 agreement;
    a kind with no greedy answer (a generation budget may leave one none) says 0 answers
    and no acceptance rather than leaving its key out; sampled answers are not replayed."""
    import contextlib

    from specserve.training.data import Example
    from specserve.training.validation import validate

    def score(ids, rows, cols):  # the draft agrees on every even response position
        return torch.tensor(0.5), (cols % 2 == 0)[None].repeat(2, 1)

    chat = Example(list(range(10)), 4, "chat", "val", False)  # response positions 3..8
    sampled_code = Example(list(range(8)), 3, "code", "val", True)
    model = torch.nn.Linear(1, 1)
    result = validate(model, [[chat, sampled_code]], torch.device("cpu"), 0, contextlib.nullcontext, score, k=4)
    assert result["answers_chat"] == 1 and result["answers_code"] == 0
    assert "sim_accept_len_code" not in result and "top1_agreement_code" not in result
    assert result["top1_agreement_chat"] == 0.5 and result["kl"] == 0.5
    assert model.training  # (back in training mode)
    with_code = validate(model, [[chat], [Example(list(range(8)), 3, "code", "val", False)]], torch.device("cpu"),
                         0, contextlib.nullcontext, score, k=4)
    assert with_code["answers_code"] == 1 and "sim_accept_len_code" in with_code
    # The model card says so rather than leaving the cell blank; a record from before the
    # counts leaves it blank.
    from specserve.training.card import _figure

    assert _figure(result, "sim_accept_len", "code") == "no answers"
    assert _figure(result, "top1_agreement", "chat") == "0.5"
    assert _figure({"kl": 1.0}, "sim_accept_len", "code") == ""


@pytest.mark.parametrize("restricted", [False, True])
def test_the_training_loss_is_the_weighted_distillation_loss_of_each_pass(restricted, eagle):
    """Per pass: KL(p || q) + ce_weight × cross-entropy to the target's argmax, weighted
    PASS_DECAY^t. Over a draft vocabulary (``--draft-vocab``): p renormalised over its
    tokens, q over them only, the cross-entropy on rows whose argmax it holds."""
    import torch.nn.functional as F

    from specserve.training.eagle_head import PASS_DECAY, head_losses

    _, _, head = eagle()
    target = head.target
    ids = torch.tensor([PROMPTS[2][:20]])
    cols = torch.arange(3, 19)
    with torch.no_grad():
        features = target.model(input_ids=ids).last_hidden_state
        t_full = target.lm_head(features[0, cols]).float()
        argmax = t_full.argmax(-1)
        vocab = None
        if restricted:  # every other row's argmax and 200 more tokens
            vocab = torch.unique(torch.cat([argmax[::2], torch.arange(100, 300)]))
            assert not torch.isin(argmax, vocab).all()
        loss, kl, ce, agree = head_losses(head, target, ids, torch.zeros_like(cols), cols, 2, 0.5, vocab)
        outs = head(ids, features, 2)
        rows = torch.arange(target.config.vocab_size) if vocab is None else vocab
        t_logits = t_full[:, rows]
        has = torch.isin(argmax, rows)
        want = 0.0
        for t in range(2):
            d_logits = target.lm_head(outs[t][0, cols - 1]).float()[:, rows]
            kl_t = F.kl_div(F.log_softmax(d_logits, -1), F.log_softmax(t_logits, -1), log_target=True,
                            reduction="batchmean")
            column = torch.searchsorted(rows, argmax[has])
            ce_t = F.cross_entropy(d_logits[has], column)
            want += PASS_DECAY ** t * (kl_t + 0.5 * ce_t)
            assert agree[t].tolist() == (rows[d_logits.argmax(-1)] == argmax).tolist()
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)


def test_the_pass_masks_follow_the_draft_steps():
    from specserve.training.eagle_head import _pass_mask

    mask = _pass_mask(2, 5, "cpu")
    # Position 4 in pass 2: pass 0's keys at 0..2, pass 1's key at 3, pass 2's at 4.
    assert mask[4].tolist() == [True, True, True, False, False] + [False, False, False, True, False] + \
        [False, False, False, False, True]
    assert mask.shape == (5, 15) and _pass_mask(0, 3, "cpu").tolist() == torch.ones(3, 3).tril().bool().tolist()


def test_the_eagle_training_pipeline_runs_end_to_end(tmp_path, tiny_model_dir):
    from specserve.training.main import main

    target = str(tiny_model_dir("smollm2_tied_gqa3"))
    record = main(["--target", target, "--work-dir", str(tmp_path / "work"), "--device", "cpu", "--arch", "eagle",
                   "--num-prompts", "6", "--num-val-prompts", "2", "--max-new-tokens", "8", "--max-seq-len", "256",
                   "--steps", "3", "--batch-tokens", "512", "--eval-prompts", "1", "--eval-max-tokens", "6",
                   "--eval-baselines", "", "--passes", "3", "--draft-vocab", "64", "--eagle-init-layers", "0,-1",
                   "--out", str(tmp_path / "head")])
    assert record["training"]["steps"] == 3 and record["num_layers"] == 2 and record["init_layers"] == [0, 1]
    assert "sim_accept_len_chat" in record["training"]["held_out_replay"]
    assert set(record["evaluation"]["mean_acceptance_length"]) == {"draft_model"}
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["specserve_draft"]["kind"] == "eagle" and config["num_hidden_layers"] == 2
    assert config["specserve_draft"]["input_norms"] is True  # a new head norms its inputs
    assert len(json.loads((tmp_path / "head" / "draft_vocab.json").read_text())) == 64
    card = (tmp_path / "head" / "MODEL_CARD.md").read_text()
    assert "EAGLE-style draft head" in card and "64 tokens most frequent" in card and "unrolled" in card
    engine = record["evaluation"]["mean_acceptance_length"]["draft_model"]
    assert f"| this draft | {engine['chat']:.2f} | {engine['code']:.2f} |" in card  # a column per kind
    # A kind a budget left without answers says so in the card's validation tables.
    from specserve.training.card import write_model_card

    for figures in (record["training"]["final_val"], *record["training"]["history"]["val"]):
        figures.update(answers_code=0)
        figures.pop("sim_accept_len_code", None), figures.pop("top1_agreement_code", None)
    write_model_card(tmp_path / "head", record)
    rows = [line for line in (tmp_path / "head" / "MODEL_CARD.md").read_text().splitlines()
            if line.startswith(("| after training |", f"| {record['training']['steps']} |"))]
    assert len(rows) == 2 and all(row.rstrip(" |").endswith("no answers") for row in rows), rows


def record_graph_shapes(graphs) -> list[tuple[int, ...]]:
    """The shape of every step ``graphs`` runs from now on (``GraphRunner._shape``)."""
    shapes, run = [], graphs.run
    graphs.run = lambda *a: shapes.append(graphs._shape(a[0].scheduled)) or run(*a)
    return shapes


def test_the_graph_path_hands_the_head_its_features(eagle):
    """The target's padded and ragged CUDA-graph paths (eagerly here, ``capture=False``)
    give the head the same hidden-state rows as the plain path, and the head's own graphs
    read its feature rows where each pass's tokens are (ragged prompt chunks, padded
    catch-ups of several tokens beside single ones, draft steps): same proposals, same
    tokens, same drafts accepted."""
    target_dir, head_dir, _ = eagle()
    params = [greedy(k) for k in KS]
    eager = {"max_num_batched_tokens": 64, "enforce_eager": True}  # (a GPU's captures: the CUDA test)
    plain = eagle_llm(target_dir, head_dir, **eager)
    want_proposals = record_proposals(plain.engine.speculator.drafter)
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    llm = eagle_llm(target_dir, head_dir, **eager)
    llm.engine.enable_graphs(capture=False)
    shapes = record_graph_shapes(llm.engine.runner.graphs)
    head_shapes = record_graph_shapes(llm.engine.speculator.drafter.runner.graphs)
    proposals = record_proposals(llm.engine.speculator.drafter)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert {s[0] == 0 for s in shapes} == {True, False}  # ragged (prefill) and padded steps
    assert {s[0] == 0 for s in head_shapes} == {True, False} and max(s[1] for s in head_shapes if s[0]) > 1
    assert proposals == want_proposals and len(proposals) > 10
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert llm.engine.spec_stats.num_accepted_tokens == plain.engine.spec_stats.num_accepted_tokens
    assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks


def test_a_head_with_a_draft_vocabulary_proposes_only_from_it_and_stays_lossless(eagle, tmp_path):
    import shutil

    target_dir, head_dir, _ = eagle()
    shutil.copytree(head_dir, tmp_path / "head")
    vocab = list(range(0, 512, 3))
    (tmp_path / "head" / "draft_vocab.json").write_text(json.dumps(vocab))
    llm = eagle_llm(target_dir, str(tmp_path / "head"))
    assert f"among its {len(vocab)} most written tokens" in llm.engine.speculator.drafter.describe()
    drafter, proposed = llm.engine.speculator.drafter, []
    propose = drafter.propose
    drafter.propose = lambda s, r, stop=None: (out := propose(s, r, stop)) and (
        proposed.extend(out.draft_ids.tolist()) if out.draft_ids is not None else None) or out
    for params in ([greedy(k) for k in KS],
                   [SamplingParams(temperature=0.9, seed=i, max_tokens=20, ignore_eos=True,
                                   num_speculative_tokens=k) for i, k in enumerate(KS)]):
        got = llm.generate(PROMPTS, params, use_tqdm=False)
        if params[0].greedy:
            want = LLM32(str(target_dir), **SMALL).generate(PROMPTS, params, use_tqdm=False)
            assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert proposed and set(proposed) <= set(vocab)
    assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures real CUDA graphs")
@pytest.mark.parametrize("input_norms", [False, True])
def test_captured_graphs_hand_the_head_the_eager_features_on_cuda(input_norms, eagle):
    """On a GPU, with real captures: float32 greedy tokens and accepted drafts equal the
    eager engine's (the head reads the graphs' hidden-state outputs, and its own passes
    are replays reading their feature rows from the graphs' buffer)."""
    target_dir, head_dir, _ = eagle(input_norms=input_norms)
    kwargs = dict(device="cuda", block_size=16, num_kv_blocks=256, max_num_seqs=8)
    params = [greedy(k) for k in KS]
    eager = eagle_llm(target_dir, head_dir, enforce_eager=True, **kwargs)
    want = eager.generate(PROMPTS, params, use_tqdm=False)
    llm = eagle_llm(target_dir, head_dir, **kwargs)
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.capture
    assert llm.engine.speculator.drafter.runner.graphs.capture  # the head's passes are replays too
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert llm.engine.spec_stats.num_accepted_tokens == eager.engine.spec_stats.num_accepted_tokens > 0
    assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks


def test_features_the_target_never_computed_are_zeros(eagle):
    """Positions without kept target features (none in the runs above) read as zeros: the
    head drafts worse there, and verification still decides."""
    target_dir, head_dir, _ = eagle()
    drafter = eagle_llm(target_dir, head_dir).engine.speculator.drafter
    rows = torch.arange(1.0, 4.0)[:, None].expand(3, drafter.model.config.hidden_size)
    drafter._features["r"] = (5, rows)
    assert drafter._feature_rows("r", 6, 8).data_ptr() == rows[1:].data_ptr()  # kept rows: no copy
    got = drafter._feature_rows("r", 3, 9)
    assert got[:, 0].tolist() == [0, 0, 1, 2, 3, 0]
    assert drafter._feature_rows("unknown", 0, 2).abs().sum() == 0



def test_a_head_made_from_a_layers_draft_starts_as_that_draft(tmp_path, tiny_model_dir):
    """``--arch eagle --init-from`` a layers-only draft: the head is that draft's layers with
    ``fc`` passing the embedding through (the features' half zero), so before training its
    entry m (token m + 1, at position m) gives the draft's logits for the sequence without
    its first token, at position m — whatever the features."""
    from safetensors import safe_open
    from specserve.training.eagle_head import EagleHead
    from specserve.training.draft import build_draft
    from specserve.training.main import main
    from transformers import AutoModelForCausalLM

    target_dir = tiny_model_dir("smollm2_tied_gqa3")
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = build_draft(target, [0, 1], torch.device("cpu"), 64).eval()
    head = EagleHead(target, draft.model.layers, draft.model.norm, "tokens").eval()
    ids = torch.tensor([PROMPTS[2][:24]])
    with torch.no_grad():
        want = draft(input_ids=ids[:, 1:]).logits[0]
        noise = torch.randn(1, ids.shape[1], target.config.hidden_size)
        got = target.lm_head(head(ids, noise, 1)[0][0, :-1])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # The pipeline builds it so from a saved draft.
    argv = ["--target", str(target_dir), "--work-dir", str(tmp_path / "work"), "--device", "cpu",
            "--num-prompts", "4", "--num-val-prompts", "2", "--max-new-tokens", "6", "--max-seq-len", "256",
            "--batch-tokens", "512", "--eval-prompts", "0", "--num-layers", "2", "--init-layers", "first"]
    layers = main(argv + ["--steps", "1", "--out", str(tmp_path / "layers")])
    record = main(argv + ["--steps", "1", "--arch", "eagle", "--passes", "2", "--lr", "0",
                          "--init-from", str(tmp_path / "layers"), "--out", str(tmp_path / "head")])
    assert record["num_layers"] == 2 and record["init_layers"] == layers["init_layers"]
    assert llm_config_input_norms(tmp_path / "head") is False  # none: it starts as the draft
    with safe_open(str(tmp_path / "head" / "model.safetensors"), "pt") as f:
        fc = f.get_tensor("fc.weight").float()
    hidden = fc.shape[0]
    assert torch.equal(fc[:, :hidden], torch.eye(hidden)) and not fc[:, hidden:].any()
    # --fc-lr-mult: fc learns (its features' half leaves zero) while the layers stay put.
    main(argv + ["--steps", "2", "--arch", "eagle", "--passes", "2", "--lr", "1e-12", "--fc-lr-mult", "1e10",
                 "--init-from", str(tmp_path / "layers"), "--out", str(tmp_path / "head2")])
    with safe_open(str(tmp_path / "head2" / "model.safetensors"), "pt") as f, \
            safe_open(str(tmp_path / "layers" / "model.safetensors"), "pt") as g:
        assert f.get_tensor("fc.weight")[:, hidden:].float().abs().max() > 1e-4
        assert all(torch.equal(f.get_tensor(name), g.get_tensor(name)) for name in g.keys())
    assert "`fc` at 1e+10× that" in (tmp_path / "head2" / "MODEL_CARD.md").read_text()


# ---------------------------------------------------------------------------- published EAGLE-1/2 heads
def test_an_eagle1_heads_first_layer_takes_linears_replaced(tiny_model_dir, tmp_path):
    """EAGLE-1's first layer adds the residual where a decoder layer has its first norm
    (``ResidualAdd``): telling the head that its linears were replaced (as packing them
    for a bf16 CPU does, or quantizing them) leaves it as it is, and it drafts as before."""
    from specserve.models.packed_linear import linears_replaced

    target_dir = tiny_model_dir("llama")
    head_dir, _ = make_eagle1_head(target_dir, tmp_path)
    llm = eagle_llm(target_dir, head_dir, k=4, max_num_batched_tokens=64)
    want = llm.generate(PROMPTS[:2], greedy(4, max_tokens=8), use_tqdm=False)
    linears_replaced(llm.engine.speculator.drafter.model)
    got = llm.generate(PROMPTS[:2], greedy(4, max_tokens=8), use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def make_eagle1_head(target_dir, path: Path, num_layers: int = 1, fc_bias: bool = True, seed: int = 0):
    """A head in the layout the EAGLE repository saves (eagle/model/cnets.py: ``fc`` over
    [embedding; feature], ``layers.N.*`` with no ``model.`` prefix, no input norm in layer 0,
    no final norm, a copy of the target's ``embed_tokens``), as ``pytorch_model.bin`` beside
    a Llama config. Returns (path, its state dict)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(target_dir)
    config.num_hidden_layers = num_layers
    config.save_pretrained(path)
    target = load_file(Path(target_dir) / "model.safetensors")
    h, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * 16, config.num_key_value_heads * 16
    g = torch.Generator().manual_seed(seed)
    state = {"fc.weight": torch.randn(h, 2 * h, generator=g) * 0.08,
             "embed_tokens.weight": target["model.embed_tokens.weight"]}
    if fc_bias:
        state["fc.bias"] = torch.randn(h, generator=g) * 0.05
    for i in range(num_layers):
        shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                  "self_attn.o_proj": (h, q), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
                  "mlp.down_proj": (h, inter)}
        for name, shape in shapes.items():
            state[f"layers.{i}.{name}.weight"] = torch.randn(*shape, generator=g) * 0.08
        norms = ["post_attention_layernorm"] + (["input_layernorm"] if i else [])
        for name in norms:
            state[f"layers.{i}.{name}.weight"] = 1 + torch.randn(h, generator=g) * 0.1
    torch.save(state, path / "pytorch_model.bin")
    return str(path), state


def eagle1_drafts(target, config, state, tokens: list[int], start: int, k: int) -> list[int]:
    """The head's k greedy drafts after ``tokens[:start + 1]``, straight from the EAGLE-1
    definition (a whole forward per draft, no cache): entry j is fc([embed(x_{j+1}); f_j]),
    f_j the target's final hidden state where it computed one, else the head's own output."""
    from transformers import LlamaModel

    ref = LlamaModel(config).eval()
    missing, unexpected = ref.load_state_dict({k: v for k, v in state.items() if k.startswith("layers.")},
                                              strict=False)
    assert not unexpected and set(missing) == {"embed_tokens.weight", "norm.weight", "layers.0.input_layernorm.weight"}
    ref.layers[0].input_layernorm, ref.norm = torch.nn.Identity(), torch.nn.Identity()
    ids = torch.tensor([tokens[:start + 1]])
    with torch.no_grad():
        features = target.model(input_ids=ids[:, :start]).last_hidden_state
        fed, drafts = ids[:, 1:], []
        for _ in range(k):
            x = torch.cat([target.model.embed_tokens(fed), features], dim=-1) @ state["fc.weight"].T
            out = ref(inputs_embeds=x + state.get("fc.bias", 0)).last_hidden_state[:, -1]
            drafts.append(target.lm_head(out).argmax().item())
            fed, features = torch.cat([fed, torch.tensor([[drafts[-1]]])], 1), torch.cat([features, out[:, None]], 1)
    return drafts


@pytest.mark.parametrize("num_layers, fc_bias", [(1, True), (2, False)])
def test_a_published_eagle1_head_drafts_what_its_definition_predicts(num_layers, fc_bias, tiny_model_dir, tmp_path):
    """Loaded from ``pytorch_model.bin`` in EAGLE's own layout: the engine's first proposals
    equal an independent whole-sequence forward of the head, and decoding stays lossless."""
    from transformers import AutoModelForCausalLM

    target_dir = tiny_model_dir("llama")
    head_dir, state = make_eagle1_head(target_dir, tmp_path, num_layers, fc_bias)
    llm = eagle_llm(target_dir, head_dir, k=4, max_num_batched_tokens=64)
    drafter = llm.engine.speculator.drafter
    assert "published EAGLE-1/2 layout" in drafter.describe() and (drafter.model.fc.bias is not None) == fc_bias
    proposals = record_proposals(drafter)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    config = drafter.model.config
    for prompt in PROMPTS[:3]:
        proposals.clear()
        got = llm.generate([prompt], greedy(4, max_tokens=8), use_tqdm=False)[0]
        start, tokens, drafts = proposals[0]
        assert start == len(prompt) and drafts == eagle1_drafts(target, config, state, tokens, start, 4)
        assert got.token_ids == LLM32(str(target_dir), **SMALL).generate([prompt], greedy(max_tokens=8),
                                                                          use_tqdm=False)[0].token_ids


def test_a_published_head_is_refused_when_not_its_targets_or_not_run(tiny_model_dir, tmp_path):
    target_dir = tiny_model_dir("llama")
    head_dir, state = make_eagle1_head(target_dir, tmp_path / "other")
    other = {**state, "embed_tokens.weight": state["embed_tokens.weight"] + 1}  # trained for another model
    torch.save(other, Path(head_dir) / "pytorch_model.bin")
    with pytest.raises(SpecserveError, match="'model.embed_tokens.weight' differs from the target's"):
        eagle_llm(target_dir, head_dir)
    for extra, message in (({"d2t": torch.zeros(1)}, "d2t/t2d but no midlayer"),
                           ({"medusa_head.0.0.linear.weight": torch.zeros(1)}, "unexpected tensor 'medusa_head")):
        torch.save({**state, **extra}, Path(head_dir) / "pytorch_model.bin")
        with pytest.raises(SpecserveError, match=message):
            eagle_llm(target_dir, head_dir)


def test_a_published_heads_embeddings_may_be_stored_in_another_dtype(tiny_model_dir, tmp_path):
    """A head saved in fp16 beside a float32 target holds the target's embeddings rounded to
    fp16: that is the target's, and it loads."""
    target_dir = tiny_model_dir("llama")
    head_dir, state = make_eagle1_head(target_dir, tmp_path)
    torch.save({k: v.half() for k, v in state.items()}, Path(head_dir) / "pytorch_model.bin")
    assert "EAGLE-1/2" in eagle_llm(target_dir, head_dir).engine.speculator.drafter.describe()
