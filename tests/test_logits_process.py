"""Logits processing (penalties, logit_bias, min_tokens, bad words) at every verify row and
draft step: against transformers' processors row by row, lossless under speculation
(greedy equality, a distribution test that a one-position misalignment fails), and the
target's log-probabilities whatever drafted them."""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter

import pytest
import torch

from specserve import SamplingParams
from specserve.logits_process import LogitsProcess, RowHistory
from tiny_models import LLM32, save_perturbed

V = 40
SMALL = dict(max_num_batched_tokens=16, max_num_seqs=8, block_size=4, num_kv_blocks=400)


def hf_reference(logits: torch.Tensor, history: list[int], num_prompt: int, params: SamplingParams,
                 stop_ids: list[int], bad_words: list[list[int]]) -> torch.Tensor:
    """One row processed by transformers' processors where they exist (bad words, min new
    tokens, sequence bias, repetition penalty) and vLLM's formula for the other two, in
    vLLM's order."""
    from transformers import (MinNewTokensLengthLogitsProcessor, NoBadWordsLogitsProcessor,
                              RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor)

    ids = torch.tensor([history])
    scores = logits.clone()[None].float()
    if bad_words:
        scores = NoBadWordsLogitsProcessor(bad_words, eos_token_id=None)(ids, scores)
    if params.min_tokens:
        scores = MinNewTokensLengthLogitsProcessor(num_prompt, params.min_tokens, stop_ids)(ids, scores)
    if params.logit_bias:
        scores = SequenceBiasLogitsProcessor({(t,): b for t, b in params.logit_bias.items()})(ids, scores)
    if params.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, scores)
    counts = torch.bincount(torch.tensor(history[num_prompt:], dtype=torch.long), minlength=logits.shape[-1]).float()
    scores[0] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return scores[0]


PARAMS = [
    SamplingParams(repetition_penalty=1.7, max_tokens=50),
    SamplingParams(frequency_penalty=0.9, presence_penalty=-0.4, max_tokens=50),
    SamplingParams(logit_bias={3: 5.0, 7: -100.0, 9: 2.5}, min_tokens=6, max_tokens=50),
    SamplingParams(bad_words=["x"], repetition_penalty=0.8, frequency_penalty=0.3, min_tokens=2, max_tokens=50),
]


@pytest.mark.parametrize("drafts_on_device", [True, False])
def test_every_verify_row_matches_transformers_processors_on_its_history(drafts_on_device):
    """Row j of a span is processed from the committed tokens plus drafts d1..d(j-1): the
    same result as transformers' processors on exactly that history."""
    g = torch.Generator().manual_seed(0)
    spans, drafts, words = [], [], [[5], [11, 12], [12, 13, 11]]
    for i, params in enumerate(PARAMS):
        prompt = torch.randint(0, V, (7 + i,), generator=g).tolist()
        output = torch.randint(0, V, (3 * i,), generator=g).tolist() + [11, 12]
        tokens = prompt + output + [0] * 5  # later tokens (a pending bonus) must be ignored
        spans.append(RowHistory(params, tokens, len(prompt), len(prompt) + len(output),
                                frozenset({2, 4}), words if params.bad_words else ()))
        drafts.append([12, 13, 11, 12][:i + 1])
    flat = torch.tensor([t for d in drafts for t in d])
    starts = [0, *itertools.accumulate(len(d) for d in drafts)][:-1]
    logits = torch.randn(sum(len(d) + 1 for d in drafts), V, generator=g) * 3
    process = LogitsProcess.for_spans(spans, [len(d) for d in drafts], starts, V, torch.device("cpu"),
                                      flat if drafts_on_device else flat.clone())
    out = process.apply(logits)
    row = 0
    for span, d in zip(spans, drafts):
        for j in range(len(d) + 1):
            history = list(span.token_ids[:span.end]) + d[:j]
            expected = hf_reference(logits[row], history, span.num_prompt_tokens, span.params, [2, 4],
                                    [list(w) for w in span.bad_words_token_ids])
            torch.testing.assert_close(out[row], expected, rtol=0, atol=1e-5, msg=f"span row {j}")
            row += 1


def test_a_draft_pass_advancing_equals_the_verify_rows():
    """The drafter's state after proposing d1..dj (``advance``, rows dropping out as their
    k runs out: ``head``) processes as the verify pass's row j does."""
    g = torch.Generator().manual_seed(1)
    rows, proposals = [], [[11, 12, 13], [12, 11], [4]]
    for i, params in enumerate(PARAMS[:3]):
        prompt = torch.randint(0, V, (5,), generator=g).tolist()
        output = torch.randint(0, V, (4,), generator=g).tolist() + [11]
        rows.append(RowHistory(params, prompt + output, 5, 10, frozenset({2}), [[11, 12], [13]]))
    flat = torch.tensor([t for p in proposals for t in p])
    verify = LogitsProcess.for_spans(rows, [3, 2, 1], [0, 3, 5], V, torch.device("cpu"), flat)
    logits = torch.randn(9, V, generator=g)
    expected = verify.apply(logits)
    draft = LogitsProcess.for_drafting(rows, [r.params for r in rows], V, torch.device("cpu"))
    verify_row = {(0, 0): 0, (0, 1): 1, (0, 2): 2, (1, 0): 4, (1, 1): 5, (2, 0): 7}
    for j in range(3):
        n = sum(len(p) > j for p in proposals)
        if j:
            draft = draft.head(n)
            draft.advance(torch.tensor([proposals[i][j - 1] for i in range(n)]))
        got = draft.apply(torch.stack([logits[verify_row[i, j]] for i in range(n)]))
        for i in range(n):
            torch.testing.assert_close(got[i], expected[verify_row[i, j]], rtol=0, atol=0)


def test_nothing_is_processed_for_requests_that_ask_for_nothing():
    from specserve.logits_process import process_rows

    logits = torch.randn(4, V)
    plain = RowHistory(SamplingParams(), [1, 2, 3], 2, 3)
    assert process_rows(logits, [None, plain], [1, 1], torch.tensor([5, 6])) is logits
    biased = RowHistory(SamplingParams(logit_bias={1: 50.0}), [1, 2, 3], 2, 3)
    out = process_rows(logits, [None, biased], [1, 1], torch.tensor([5, 6]))
    torch.testing.assert_close(out[:2], logits[:2])
    assert (out[2:, 1] == logits[2:, 1] + 50).all()


# ---------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def near_draft(tmp_path_factory, target):
    return save_perturbed(target, tmp_path_factory.mktemp("near"), 0.004)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    base = [torch.randint(3, 60, (k,), generator=g).tolist() for k in (1, 37, 5, 50, 12, 3)]
    return [p + p[: len(p) // 2] for p in base]


PENALISED = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3,
                           frequency_penalty=0.5, presence_penalty=0.3, logit_bias={5: 3.0, 7: -100.0},
                           bad_words=["def x", "return"], min_tokens=4, stop_token_ids=[9])


def drafters(target, near_draft):
    return {"ngram": dict(speculative_method="ngram"),
            "layerskip": dict(speculative_method="layerskip", layerskip_layers=1),
            "draft=target": dict(speculative_method="draft_model", draft_model=target),
            "draft-near": dict(speculative_method="draft_model", draft_model=near_draft)}


@pytest.mark.parametrize("drafter", ["ngram", "layerskip", "draft=target", "draft-near"])
def test_greedy_with_penalties_equals_without_speculation(drafter, target, near_draft):
    """float32, every processing at once, mixed prompt lengths over a 16-token budget:
    token for token what plain greedy decoding gives; a draft identical to the target is
    processed as the target is, so every draft is accepted. (Penalties mild enough for
    prompt lookup to find repeats to propose, for n-gram.)"""
    params = PENALISED if drafter != "ngram" else dataclasses.replace(
        PENALISED, repetition_penalty=1.02, frequency_penalty=0.0, presence_penalty=0.05)
    plain = LLM32(target, **SMALL).generate(prompts(), params, use_tqdm=False)
    llm = LLM32(target, num_speculative_tokens=4, speculative_adaptive=False, **SMALL,
                **drafters(target, near_draft)[drafter])
    outs = llm.generate(prompts(), params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert all(7 not in o.token_ids for o in outs)  # logit_bias -100
    assert llm.engine.spec_stats.num_draft_tokens > 0
    if drafter == "draft=target":
        assert llm.engine.spec_stats.acceptance_rate == 1.0
    assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks


def test_min_tokens_keeps_stop_tokens_and_strings_away(target):
    llm = LLM32(target, speculative_method="ngram", **SMALL)
    free = llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    first = free.token_ids[0]
    stopped = llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first]),
                           use_tqdm=False)[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    held = llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first],
                                                    min_tokens=3), use_tqdm=False)[0]
    assert first not in held.token_ids[:3] and len(held.token_ids) >= 3
    text = free.text
    by_string = llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=8, stop=[text[:2]], min_tokens=8),
                             use_tqdm=False)[0]
    assert by_string.finish_reason == "length" and by_string.text == text  # no stop string before 8 tokens


def test_bad_words_are_never_completed(target):
    llm = LLM32(target, speculative_method="ngram", **SMALL)
    free = llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    # The first two output tokens of each prompt, as text: a two-token word to ban.
    tok = llm.tokenizer
    words = [tok.decode(o.token_ids[:2]) for o in free]
    banned = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, bad_words=[w]) for w in words]
    outs = llm.generate(prompts(), banned, use_tqdm=False)
    changed = 0
    for o, f, word, req_words in zip(outs, free, words, [llm.engine._bad_words(p) for p in banned]):
        for seq in req_words:
            n = len(seq)
            assert all(o.token_ids[i:i + n] != seq for i in range(len(o.token_ids) - n + 1)), word
        changed += o.token_ids != f.token_ids
    assert changed >= len(outs) // 2


# ---------------------------------------------------------------------- the distribution
# The prompt alternates 20 and 21 and the bias favours both: n-gram's proposals (the
# pattern) are accepted often, and the penalties weigh on exactly the tokens drafted.
SAMPLED = dict(temperature=0.9, top_k=3, top_p=0.95, repetition_penalty=1.6, frequency_penalty=0.7,
               logit_bias={20: 5.0, 21: 5.0}, max_tokens=3, ignore_eos=True)
PROMPT = [20, 21, 20, 21, 20]
NUM_DRAWS = 6000


def exact_distribution(target: str) -> dict[tuple[int, ...], float]:
    """The target's distribution of the 3 output tokens, enumerated with transformers'
    model and the processors above: every history's next-token distribution after the
    penalties, temperature, top-k 3 and top-p."""
    from transformers import AutoModelForCausalLM

    from specserve.sampler import SamplingMetadata, target_probs

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    params = SamplingParams(**SAMPLED)
    meta = SamplingMetadata.build([params], torch.device("cpu"))
    out: dict[tuple[int, ...], float] = {}

    def walk(history: list[int], prob: float, depth: int) -> None:
        if depth == 3:
            out[tuple(history[len(PROMPT):])] = prob
            return
        with torch.no_grad():
            logits = model(torch.tensor([history])).logits[0, -1]
        processed = hf_reference(logits, history, len(PROMPT), params, [], [])
        p = target_probs(processed[None], meta)[0]
        for token in p.nonzero()[:, 0].tolist():
            walk(history + [token], prob * p[token].item(), depth + 1)

    walk(list(PROMPT), 1.0, 0)
    return out


def draws(target: str, settings: dict) -> Counter:
    llm = LLM32(target, num_speculative_tokens=2, speculative_adaptive=False, max_num_seqs=64,
                max_num_batched_tokens=256, block_size=4, num_kv_blocks=1200, **settings)
    params = [SamplingParams(**SAMPLED, seed=s) for s in range(NUM_DRAWS)]
    outs = llm.generate([PROMPT] * NUM_DRAWS, params, use_tqdm=False)
    assert llm.engine.spec_stats.num_accepted_tokens > 0 or settings.get("speculative_method") in (None, "none")
    return Counter(tuple(o.token_ids) for o in outs)


def chi_square_p(counts: Counter, exact: dict) -> float:
    """The p-value of Pearson's chi-square test of ``counts`` against ``exact``, rare
    outcomes (expected < 5) pooled."""
    total = sum(counts.values())
    assert set(counts) <= set(exact), "drew a sequence the target cannot produce"
    stat, dof, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for seq, p in exact.items():
        expected = p * total
        if expected < 5:
            pooled_obs += counts.get(seq, 0)
            pooled_exp += expected
            continue
        stat += (counts.get(seq, 0) - expected) ** 2 / expected
        dof += 1
    if pooled_exp:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        dof += 1
    # The chi-square survival function: the regularised upper incomplete gamma function.
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.fixture(scope="module")
def exact(target):
    return exact_distribution(target)


@pytest.mark.parametrize("drafter", ["ngram", "draft-near"])
def test_speculative_sampling_with_penalties_has_the_target_distribution(drafter, target, near_draft, exact):
    """6,000 seeded requests of 3 tokens (top-k 3: at most 27 sequences) under speculation
    with k = 2 against the exact distribution: chi-square p > 0.001."""
    counts = draws(target, drafters(target, near_draft)[drafter])
    assert chi_square_p(counts, exact) > 1e-3, counts.most_common(8)


def test_a_verify_row_that_misses_one_draft_fails_the_distribution_test(target, exact, monkeypatch):
    """The power check: verifying each row from the committed tokens alone (drafts d1..d(j-1)
    left out of its history, while the draft's q kept them) changes the distribution enough
    that the test above rejects it."""
    def misaligned(cls, spans, num_drafts, starts, vocab, device, draft_ids):
        rows = [span for span, k in zip(spans, num_drafts) for _ in range(k + 1)]
        return cls(rows, [0] * len(rows), vocab, device)

    monkeypatch.setattr(LogitsProcess, "for_spans", classmethod(misaligned))
    counts = draws(target, dict(speculative_method="draft_model", draft_model=target))
    assert chi_square_p(counts, exact) < 1e-3


# ---------------------------------------------------------------------- log-probabilities
@pytest.fixture(scope="module")
def hf_target(target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)


@pytest.mark.parametrize("drafter", ["none", "ngram", "draft-near"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_under_speculation_are_the_targets(drafter, temperature, target, near_draft, hf_target):
    """Every output token's log-probability and top-3 (and each prompt token's after the
    first, over chunked prefill) within 1e-4 of a plain transformers pass over the same
    tokens: accepted drafts, recovered and bonus tokens alike report the target's."""
    settings = {} if drafter == "none" else drafters(target, near_draft)[drafter]
    llm = LLM32(target, num_speculative_tokens=3, speculative_adaptive=False, **SMALL, **settings)
    # The bias (raw log-probabilities do not see it) makes sampled text repeat the alternating
    # prompt, so that n-gram drafts are accepted at temperature > 0 too.
    params = SamplingParams(temperature=temperature, seed=1, max_tokens=20, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2, logit_bias={20: 8.0, 21: 8.0})
    outs = llm.generate(prompts() + [PROMPT * 3], params, use_tqdm=False)
    for o in outs:
        ids = o.prompt_token_ids + o.token_ids
        with torch.no_grad():
            ref = hf_target(torch.tensor([ids])).logits[0].log_softmax(-1)
        assert len(o.prompt_logprobs) == len(o.prompt_token_ids) - 1 and len(o.logprobs) == len(o.token_ids)
        for i, lp in enumerate(o.prompt_logprobs + o.logprobs):
            assert lp.token_id == ids[i + 1]
            assert abs(lp.logprob - ref[i, ids[i + 1]].item()) < 1e-4
            top = ref[i].topk(len(lp.top))
            assert [t for t, _ in lp.top] == top.indices.tolist()
            assert max(abs(v - r) for (_, v), r in zip(lp.top, top.values.tolist())) < 1e-4
        assert math.isclose(o.cumulative_logprob, sum(lp.logprob for lp in o.logprobs))
    if drafter != "none":
        assert llm.engine.spec_stats.num_accepted_tokens > 0


def test_processed_logprobs_are_what_was_sampled_from(target, near_draft):
    """``processed_logprobs``: penalties, bias and temperature included, the same with
    speculation as without; a token the filters removed reports -inf."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=4, frequency_penalty=1.0,
                            logit_bias={5: -100.0})
    plain = LLM32(target, logprobs_mode="processed_logprobs", **SMALL).generate(prompts(), params, use_tqdm=False)
    spec = LLM32(target, logprobs_mode="processed_logprobs", speculative_method="draft_model",
                 draft_model=near_draft, num_speculative_tokens=3, speculative_adaptive=False,
                 **SMALL).generate(prompts(), params, use_tqdm=False)
    raw = LLM32(target, **SMALL).generate(prompts(), params, use_tqdm=False)
    for a, b, r in zip(spec, plain, raw):
        assert a.token_ids == b.token_ids == r.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert abs(x.logprob - y.logprob) < 1e-4
        assert any(abs(x.logprob - y.logprob) > 1e-3 for x, y in zip(a.logprobs, r.logprobs))
    bias = SamplingParams(temperature=1.0, top_k=2, max_tokens=4, ignore_eos=True, logprobs=3, seed=0)
    out = LLM32(target, logprobs_mode="processed_logprobs", **SMALL).generate([[3, 4]], bias, use_tqdm=False)[0]
    assert all(lp.top[2][1] == float("-inf") for lp in out.logprobs)  # outside top-k 2


def test_prompt_logprobs_skip_the_prefix_cache_and_survive_preemption(target, hf_target):
    """A request that wants its prompt's log-probabilities computes every prompt position
    (a cached block keeps no logits), and a preemption's recomputation adds none twice."""
    llm = LLM32(target, max_num_batched_tokens=8, max_num_seqs=4, block_size=4, num_kv_blocks=30)
    prompt = prompts()[3]  # 75 tokens
    llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)  # its blocks are cached now
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=0)] + \
        [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * 3
    outs = llm.generate([prompt] + prompts()[:3], params, use_tqdm=False)
    assert outs[0].num_cached_tokens == 0 and len(outs[0].prompt_logprobs) == len(prompt) - 1
    with torch.no_grad():
        ref = hf_target(torch.tensor([prompt])).logits[0].log_softmax(-1)
    for i, lp in enumerate(outs[0].prompt_logprobs):
        assert lp.token_id == prompt[i + 1] and abs(lp.logprob - ref[i, prompt[i + 1]].item()) < 1e-4
    assert llm.engine.scheduler.num_preemptions > 0


def test_prompt_logits_chunks_are_bounded_whatever_the_budget(target, hf_target, monkeypatch):
    """A chunk whose every row's logits are kept is held to PROMPT_LOGITS_CHUNK rows (their
    memory is a vocabulary of floats each), over as many steps as it takes; the values are
    the same."""
    import specserve.scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "PROMPT_LOGITS_CHUNK", 16)
    llm = LLM32(target, max_num_batched_tokens=256, block_size=4, num_kv_blocks=200)
    chunks = []
    real = llm.engine.scheduler.schedule
    llm.engine.scheduler.schedule = lambda *a: (out := real(*a), chunks.extend(
        len(p.token_ids) for p in out.scheduled if p.prompt_logits))[0]
    prompt = prompts()[3]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0), use_tqdm=False)[0]
    assert max(chunks) == 16 and sum(chunks) == len(prompt)
    with torch.no_grad():
        ref = hf_target(torch.tensor([prompt])).logits[0].log_softmax(-1)
    assert [lp.token_id for lp in out.prompt_logprobs] == prompt[1:]
    assert max(abs(lp.logprob - ref[i, prompt[i + 1]].item()) for i, lp in enumerate(out.prompt_logprobs)) < 1e-4
    assert [lp.rank for lp in out.prompt_logprobs] == [int((ref[i] > ref[i, prompt[i + 1]]).sum()) + 1
                                                       for i in range(len(prompt) - 1)]


def test_a_bad_word_outside_the_vocabulary_is_refused(target, monkeypatch):
    """A tokenizer with added tokens past the model's vocabulary: a bad word made of one is
    refused, not banned in another row (its flat place would land there)."""
    engine = LLM32(target, block_size=4, num_kv_blocks=64).engine
    monkeypatch.setattr(engine.tokenizer, "encode", lambda text, **kw: [600] if "zz" in text else [5])
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request([1, 2], SamplingParams(bad_words=["zz"]))
    assert not engine.has_unfinished_requests()
