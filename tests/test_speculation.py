"""Speculative decoding end to end: every drafter is lossless, rollback leaks nothing."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from specserve import LLMEngine, SamplingParams
from specserve.drafts.ngram import lookup
from specserve.errors import SpecserveError
from tiny_models import (LLM32, continuation_chi_square, exact_continuations, make_hf_model, make_tokenizer,
                         save_perturbed)

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SMALL = dict(max_num_batched_tokens=16, max_num_seqs=8, block_size=4, num_kv_blocks=200)


def prompts_with_repeats() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    base = [torch.randint(3, 60, (k,), generator=g).tolist() for k in (1, 37, 5, 50, 12, 3)]
    return [p + p[: len(p) // 2] for p in base]  # repeated spans give n-gram matches


@pytest.fixture(scope="module")
def draft_dirs(tmp_path_factory, tiny_model_dir):
    """Tiny drafts sharing the tiny target's vocabulary: a 1-layer llama, a qwen3, and
    "near": the target with slightly perturbed weights (often but not always agreeing)."""
    out = {name: save_perturbed(tiny_model_dir("llama"), tmp_path_factory.mktemp(f"draft-{name}"), noise)
           for name, noise in (("near", 0.004), ("perturbed", 0.006))}
    for name, variant, kwargs in (("small", "llama", dict(seed=1, num_hidden_layers=1)),
                                  ("qwen3", "qwen3_qknorm", dict(seed=2))):
        path = tmp_path_factory.mktemp(f"draft-{name}")
        seed = kwargs.pop("seed")
        make_hf_model(variant, seed=seed, **kwargs).save_pretrained(path)
        make_tokenizer(512).save_pretrained(path)
        out[name] = path
    return out


@pytest.fixture(scope="module")
def baseline(tiny_model_dir):
    llm = LLM32(str(tiny_model_dir("llama")), **SMALL)
    return [o.token_ids for o in llm.generate(prompts_with_repeats(), GREEDY, use_tqdm=False)]


def drafter_settings(tiny_model_dir, draft_dirs):
    target = str(tiny_model_dir("llama"))
    return {
        "ngram": dict(speculative_method="ngram"),
        "layerskip": dict(speculative_method="layerskip", layerskip_layers=1),
        "draft=target": dict(speculative_method="draft_model", draft_model=target),
        "draft-llama": dict(speculative_method="draft_model", draft_model=str(draft_dirs["small"])),
        "draft-qwen3": dict(speculative_method="draft_model", draft_model=str(draft_dirs["qwen3"])),
    }


@pytest.mark.parametrize("drafter", ["ngram", "layerskip", "draft=target", "draft-llama", "draft-qwen3"])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_with_speculation_equals_without(drafter, k, tiny_model_dir, draft_dirs, baseline):
    """Batched, mixed prompt lengths, a 16-token budget: prefill chunks and verification
    share steps. Output must be token-identical to plain greedy decoding. A fixed k, so
    every decoding step drafts (the adaptive choice: the test below)."""
    settings = drafter_settings(tiny_model_dir, draft_dirs)[drafter]
    llm = LLM32(str(tiny_model_dir("llama")), num_speculative_tokens=k, speculative_adaptive=False,
                **SMALL, **settings)
    outs = llm.generate(prompts_with_repeats(), GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == baseline
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_drafts
    if drafter == "draft=target":
        assert stats.acceptance_rate == 1.0
    if drafter == "ngram":
        assert stats.num_accepted_tokens > 0
    assert sum(o.spec_stats.num_drafts for o in outs) == stats.num_drafts
    assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.parametrize("drafter", ["ngram", "draft=target", "draft-llama"])
def test_greedy_with_adaptive_draft_lengths_equals_without(drafter, tiny_model_dir, draft_dirs, baseline):
    """The default: the engine chooses each request's k every step (0 included); greedy
    output is still plain greedy decoding's, and every block comes back."""
    settings = drafter_settings(tiny_model_dir, draft_dirs)[drafter]
    llm = LLM32(str(tiny_model_dir("llama")), num_speculative_tokens=4, **SMALL, **settings)
    assert llm.engine.speculator.controller is not None
    outs = llm.generate(prompts_with_repeats(), GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == baseline
    assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks


def test_seeded_requests_keep_the_fixed_k_and_their_tokens_under_adaptive_speculation(tiny_model_dir):
    """Where drafts are verified changes which tokens a seeded sampling request draws, and
    the adaptive choice follows measured step times: a seeded request keeps the engine's k
    (as in the test below, whatever shares its batch), an unseeded one is chosen for."""
    target = str(tiny_model_dir("llama"))
    seeded = SamplingParams(temperature=0.9, max_tokens=20, ignore_eos=True, seed=5)
    runs = []
    for _ in range(2):
        llm = LLM32(target, speculative_method="draft_model", draft_model=target, num_speculative_tokens=3,
                    **SMALL)
        runs.append(llm.generate([[7, 8, 9, 7, 8, 9]], seeded, use_tqdm=False)[0])
    assert runs[0].token_ids == runs[1].token_ids and runs[0].spec_stats.num_drafts > 0
    engine = llm.engine
    engine.add_request([1, 2, 3], SamplingParams(temperature=0.9, max_tokens=4, seed=1), req_id="s")
    engine.add_request([1, 2, 3], SamplingParams(temperature=0.9, max_tokens=4), req_id="u")
    engine.step()  # prefill both
    # Drafts that never land, however confident: the controller would choose k = 0.
    engine.speculator.controller.observe_confidence(np.zeros(800, dtype=bool), np.repeat(np.arange(4), 200),
                                                    np.full(800, 0.99), np.zeros(800))
    chosen = engine.speculator.plan(engine.scheduler)
    assert chosen["u"] == 0 and chosen["s"] == 3


def test_identical_draft_is_always_accepted_when_sampling(tiny_model_dir):
    """p == q exactly when the draft is the target and both apply the same filters, so
    every draft is accepted; a misaligned q row would show up as rejections."""
    target = str(tiny_model_dir("llama"))
    llm = LLM32(target, speculative_method="draft_model", draft_model=target, num_speculative_tokens=3, **SMALL)
    params = [SamplingParams(temperature=t, top_p=p, top_k=k, max_tokens=20, ignore_eos=True, seed=i)
              for i, (t, p, k) in enumerate([(1.0, 1.0, -1), (0.7, 0.9, -1), (1.3, 1.0, 20), (0, 1.0, -1)])]
    llm.generate(prompts_with_repeats()[:4], params, use_tqdm=False)
    assert llm.engine.spec_stats.acceptance_rate > 0.999


def test_seeded_speculative_sampling_is_reproducible(tiny_model_dir, draft_dirs):
    target = str(tiny_model_dir("llama"))
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, ignore_eos=True, seed=11)
    runs = []
    for filler in (0, 3):  # different batch company each time
        llm = LLM32(target, speculative_method="draft_model", draft_model=str(draft_dirs["small"]),
                  num_speculative_tokens=3, seed=filler, **SMALL)
        prompts = [[7, 8, 9]] + prompts_with_repeats()[:filler]
        others = [SamplingParams(temperature=1.0, max_tokens=10)] * filler
        runs.append(llm.generate(prompts, [params] + others, use_tqdm=False)[0].token_ids)
    assert runs[0] == runs[1]


def test_per_request_k_overrides_the_engine(tiny_model_dir):
    llm = LLM32(str(tiny_model_dir("llama")), speculative_method="ngram", num_speculative_tokens=4, **SMALL)
    prompts = prompts_with_repeats()[:2]
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                 num_speculative_tokens=0),
                                  SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                 num_speculative_tokens=2)], use_tqdm=False)
    assert outs[0].spec_stats.num_drafts == 0
    assert outs[1].spec_stats.num_drafts > 0
    assert max(len(outs[1].spec_stats.drafts_per_position), 0) <= 2


def test_draft_with_another_vocabulary_is_refused(tmp_path, tiny_model_dir):
    path = tmp_path / "draft"
    make_hf_model("llama", vocab_size=600).save_pretrained(path)
    with pytest.raises(SpecserveError, match="vocabulary of 600 tokens"):
        LLM32(str(tiny_model_dir("llama")), speculative_method="draft_model", draft_model=str(path), **SMALL)
    with pytest.raises(SpecserveError, match="needs a draft checkpoint"):
        LLM32(str(tiny_model_dir("llama")), speculative_method="draft_model", **SMALL)


@pytest.mark.parametrize("seed, paths", [(0, 1), (1, 1), (2, 1), (3, 3)])
def test_randomized_run_with_aborts_and_preemptions_leaks_nothing(seed, paths, tiny_model_dir, draft_dirs):
    """Many requests, drafts, aborts and a cache small enough to force preemption. After
    every step each live request holds exactly the blocks its computed tokens need (with
    draft paths: its paths' blocks were merged or freed)."""
    rng = random.Random(seed)
    engine = LLMEngine(dtype="float32", model=str(tiny_model_dir("llama")), speculative_method="draft_model",
                       draft_model=str(draft_dirs["small"]), num_speculative_tokens=3,
                       max_num_batched_tokens=24, max_num_seqs=6, block_size=4, num_kv_blocks=36,
                       num_draft_paths=paths, speculative_adaptive=paths == 1)  # fixed k: paths fork whatever the timings
    forked, schedule = [], engine.scheduler.schedule
    engine.scheduler.schedule = lambda *args: forked.append(schedule(*args)) or forked[-1]
    finished, submitted = {}, []
    for step_no in range(400):
        if step_no < 120 and rng.random() < 0.3:
            prompt = [rng.randrange(3, 500) for _ in range(rng.randint(1, 40))]
            params = SamplingParams(temperature=rng.choice([0, 0.8]), max_tokens=rng.randint(1, 30),
                                    ignore_eos=rng.random() < 0.5, seed=rng.randrange(1000))
            submitted.append(engine.add_request(prompt, params))
        live = sorted(engine.scheduler.requests)
        if live and rng.random() < 0.05:
            engine.abort(rng.choice(live))
        for out in engine.step():
            if out.finished:
                assert out.req_id not in finished, "a request ended twice"
                finished[out.req_id] = out.finish_reason
        kv, bs = engine.kv, engine.kv.block_size
        used = 0
        for req in engine.scheduler.requests.values():
            table = kv.block_table(req.req_id)
            if req.status.value == "running":
                assert len(table) == -(-req.num_computed_tokens // bs)
            else:
                assert not kv.holds(req.req_id)
            used += len(table)
        assert kv.num_free_blocks == kv.num_blocks - used
        if step_no >= 120 and not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests()
    assert set(finished) == set(submitted)
    assert set(finished.values()) <= {"stop", "length", "abort"}
    assert engine.scheduler.num_preemptions > 0
    assert engine.num_free_blocks == engine.kv.num_blocks
    assert (sum(len(out.block_copies) for out in forked) > 0) == (paths > 1)


@pytest.mark.parametrize("tokens, k, expected", [
    ([1, 2, 3, 4, 1, 2], 3, [3, 4, 1]),          # suffix [1, 2] seen before
    ([1, 2, 3, 9, 2, 3, 7, 2, 3], 2, [7, 2]),    # most recent earlier match wins
    ([5, 6, 7, 8], 3, []),                       # no match
    ([1, 2, 3, 1, 2, 3], 8, [1, 2, 3]),          # fewer tokens than k remain
])
def test_ngram_lookup(tokens, k, expected):
    assert lookup(tokens, k, max_n=3, min_n=2) == expected


@pytest.mark.parametrize("seed", range(4))
def test_ngram_index_finds_what_the_scan_finds(seed):
    """The drafter's incremental index against the plain scan, on token lists that grow
    by runs of random length (and once shrink), over small alphabets full of repeats.
    Some runs are long pauses (more than the index catches up in one lookup), so the
    index also answers while it is behind (by ``find_scan``) and while it catches up."""
    from specserve.drafts.ngram import CATCH_UP_TOKENS, NgramIndex, continuation

    rng = random.Random(seed)
    for max_n, min_n in ((4, 2), (3, 1), (2, 2), (5, 3)):
        index, tokens = NgramIndex(min_n), []
        for step in range(120):
            if step == 60:
                del tokens[-7:]
            run = rng.randint(1, 5) if rng.random() < 0.9 else rng.randint(CATCH_UP_TOKENS, 3 * CATCH_UP_TOKENS)
            tokens += [rng.randrange(4 if seed % 2 else 9) for _ in range(run)]
            k = rng.randint(1, 6)
            got = continuation(tokens, index.find(tokens, max_n), k)
            assert got == lookup(tokens, k, max_n, min_n), (step, tokens)


@pytest.mark.parametrize("seed", range(4))
def test_ngram_fast_scan_finds_what_the_plain_scan_finds(seed):
    """``find_scan`` (reversed list, ``list.index`` jumps, longest match wins) against
    ``lookup`` (n from max_n down, newest first), on random lists with many repeats."""
    from specserve.drafts.ngram import continuation, find_scan

    rng = random.Random(seed)
    for _ in range(400):
        tokens = [rng.randrange(rng.choice((3, 6, 20))) for _ in range(rng.randint(0, 80))]
        min_n = rng.randint(1, 4)
        max_n, k = rng.randint(min_n, 6), rng.randint(1, 6)
        got = continuation(tokens, find_scan(tokens, max_n, min_n), k)
        assert got == lookup(tokens, k, max_n, min_n), (tokens, k, max_n, min_n)


def test_ngram_prefers_longer_matches():
    tokens = [4, 2, 9, 1, 2, 8, 5, 1, 2]   # only [1, 2] recurs: it was followed by 8
    assert lookup(tokens, 1, max_n=2, min_n=1) == [8]
    tokens = [7, 1, 2, 3, 0, 1, 2, 4, 7, 1, 2]  # [7, 1, 2] matches at the start -> 3
    assert lookup(tokens, 1, max_n=3, min_n=1) == [3]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "layerskip"])
def test_default_model_greedy_with_speculation_equals_without(method, default_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_path)
    questions = ["Rewrite this function to use a list comprehension:\n\ndef squares(n):\n"
                 "    out = []\n    for i in range(n):\n        out.append(i * i)\n    return out",
                 "What is the capital of France?",
                 "List three uses of a paged KV cache."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                       add_generation_prompt=True) for q in questions]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain = LLM32(max_num_batched_tokens=48, max_num_seqs=4).generate(prompts, params, use_tqdm=False)
    spec = LLM32(max_num_batched_tokens=48, max_num_seqs=4, speculative_method=method,
                 num_speculative_tokens=4, speculative_adaptive=False)  # drafts every step
    outs = spec.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert spec.engine.spec_stats.num_drafts > 0
    assert spec.engine.num_free_blocks == spec.engine.kv.num_blocks


def test_stop_string_inside_an_accepted_run_cuts_the_tokens(tiny_model_dir):
    """With a draft equal to the target whole runs are accepted at once; a stop string in
    the middle of one must end the output exactly where plain decoding ends it."""
    target = str(tiny_model_dir("llama"))
    prompt = [5, 17, 99, 230]
    greedy = dict(temperature=0, max_tokens=30, ignore_eos=True)
    plain = LLM32(target, block_size=4, num_kv_blocks=200)
    full = plain.generate([prompt], SamplingParams(**greedy), use_tqdm=False)[0]
    pieces = [plain.tokenizer.decode([t]) for t in full.token_ids[8:20]]
    stop = next(p for p in pieces if p.strip() and p.isascii() and p.isprintable())
    spec = LLM32(target, block_size=4, num_kv_blocks=200, speculative_method="draft_model",
                 draft_model=target, num_speculative_tokens=6)
    want = plain.generate([prompt], SamplingParams(stop=[stop], **greedy), use_tqdm=False)[0]
    got = spec.generate([prompt], SamplingParams(stop=[stop], **greedy), use_tqdm=False)[0]
    assert got.finish_reason == want.finish_reason == "stop"
    assert (got.token_ids, got.text) == (want.token_ids, want.text)
    assert got.spec_stats.num_accepted_tokens <= len(got.token_ids)
    assert spec.engine.num_free_blocks == spec.engine.kv.num_blocks


def test_accepted_tokens_cut_by_a_stop_token_are_not_counted(tiny_model_dir):
    target = str(tiny_model_dir("llama"))
    plain = LLM32(target, block_size=4, num_kv_blocks=200).generate(
        [[5, 17, 99, 230]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    spec = LLM32(target, block_size=4, num_kv_blocks=200, speculative_method="draft_model",
                 draft_model=target, num_speculative_tokens=8, speculative_adaptive=False)
    out = spec.generate([[5, 17, 99, 230]], SamplingParams(temperature=0, max_tokens=12,
                                                          stop_token_ids=[plain.token_ids[3]]),
                        use_tqdm=False)[0]
    assert out.token_ids == plain.token_ids[:4]
    stats = out.spec_stats
    assert stats.num_drafts == 1 and stats.num_accepted_tokens == 3  # 4 kept: 3 drafts + the stop


def test_a_request_cannot_raise_k_above_the_engine(tiny_model_dir):
    llm = LLM32(str(tiny_model_dir("llama")), speculative_method="ngram", num_speculative_tokens=2, **SMALL)
    out = llm.generate(prompts_with_repeats()[3:4], SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True, num_speculative_tokens=7), use_tqdm=False)[0]
    assert out.spec_stats.num_drafts > 0 and len(out.spec_stats.drafts_per_position) <= 2


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_seed_gives_the_same_tokens_whatever_k_the_budget_leaves(method, tiny_model_dir, draft_dirs):
    """A 10-token budget trims k differently depending on the other requests; a seeded
    request must still produce the same tokens."""
    extra = dict(draft_model=str(draft_dirs["near"])) if method == "draft_model" else dict(prompt_lookup_min=1)
    params = SamplingParams(temperature=0.9, max_tokens=30, ignore_eos=True, seed=11)
    runs = []
    for filler in (0, 5):
        llm = LLM32(str(tiny_model_dir("llama")), speculative_method=method, num_speculative_tokens=4,
                    max_num_batched_tokens=10, max_num_seqs=8, block_size=4, num_kv_blocks=200,
                    speculative_adaptive=False, **extra)  # the others' k: the budget's, not step times'
        prompts = [[3 + i, 4, 5, 6] for i in range(filler)] + [[7, 8, 9, 7, 8, 9]]
        others = [SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)] * filler
        runs.append(llm.generate(prompts, others + [params], use_tqdm=False)[-1].token_ids)
    assert runs[0] == runs[1]


def test_speculative_sampling_has_the_target_distribution(tiny_model_dir, draft_dirs):
    """End to end with a draft model that differs from the target: the distribution of
    3-token continuations (top_k = 2, so 8 outcomes, computed exactly with transformers)
    must match — chi-square well inside its 7 degrees of freedom."""
    target = str(tiny_model_dir("llama"))
    prompt, length, sp = [5, 17, 99, 230, 17, 99], 3, dict(temperature=1.0, top_k=2)
    exact = exact_continuations(target, prompt, length, sp)
    n = 3000
    engine = LLMEngine(dtype="float32", model=target, speculative_method="draft_model",
                       draft_model=str(draft_dirs["perturbed"]), num_speculative_tokens=2,
                       speculative_adaptive=False,  # every step drafts: the rule under test
                       max_num_batched_tokens=4096, max_num_seqs=512, block_size=16, num_kv_blocks=2000)
    chi2 = continuation_chi_square(engine, prompt, sp, exact, n)
    print(f"chi2 {chi2:.1f}, acceptance {engine.spec_stats.acceptance_rate:.3f}")
    assert len(exact) == 8 and chi2 < 24.3  # p = 0.001 for 7 degrees of freedom
    stats = engine.spec_stats
    assert 0.2 < stats.acceptance_rate < 0.8  # the draft really differs, and often agrees
