"""The adaptive draft-length controller on synthetic acceptance and cost inputs."""
from __future__ import annotations

import pytest

from specserve import SamplingParams
from specserve.spec_controller import CostModel, DraftLengthController
from tiny_models import LLM32

MEMORY_BOUND = dict(a=0.030, b=0.0001, c=0.0)   # a step costs the same for 1 or 64 tokens
COMPUTE_BOUND = dict(a=0.001, b=0.002, c=0.0)   # every token costs more than the fixed part


def controller(max_k=4, a=0.03, b=0.0001, c=0.0, draft=(0.0, 0.0), pad=0.0) -> DraftLengthController:
    """``pad``: cost per token of the padded shape a graph replays (every request padded to
    the longest query)."""
    ctl = DraftLengthController(max_k, probe_interval=1000)
    for tokens, spans, padded in ((1, 0, 1), (5, 1, 5), (8, 0, 8), (40, 8, 40), (12, 1, 40), (32, 0, 32),
                                  (160, 32, 160), (36, 1, 160), (100, 3, 128)):
        ctl.observe_step(tokens, spans, a + b * tokens + c * spans + pad * padded, 0, 0, 0.0, padded)
    for depth, reqs in ((1, 1), (4, 1), (4, 8), (2, 32)):
        ctl.observe_step(1, 0, a + b, depth, reqs, depth * (draft[0] + draft[1] * reqs))
    return ctl


def train_acceptance(ctl, req_id, rate_accepted: int, k: int = 4, times: int = 30):
    for _ in range(times):
        ctl.observe_acceptance(req_id, k, k, rate_accepted)


def test_cost_model_recovers_linear_costs():
    model = CostModel(3)
    for tokens in range(1, 50):
        for spans in (0, 3):
            model.observe([1, tokens, spans], 0.01 + 0.002 * tokens + 0.004 * spans)
    assert model.theta == pytest.approx([0.01, 0.002, 0.004], rel=1e-3)


def test_one_stall_does_not_poison_the_fit():
    model = CostModel(3)
    for tokens in (1, 8, 40):
        for spans in (0, 8):
            model.observe([1, tokens, spans], 0.03 + 0.0005 * tokens + 0.001 * spans)
    model.observe([1, 40, 8], 3.0)  # another process held the CPU for three seconds
    assert model.predict([1, 40, 8]) < 2 * (0.03 + 0.0005 * 40 + 0.001 * 8)
    for _ in range(20):  # but a cost that really changed is learned, clip after clip
        model.observe([1, 40, 8], 0.5)
    assert model.predict([1, 40, 8]) == pytest.approx(0.5, rel=0.2)


def test_steps_with_prefill_teach_only_the_draft_cost():
    ctl = controller(**MEMORY_BOUND)
    theta, samples = ctl.target_cost.theta.copy(), ctl.target_cost.num_samples
    ctl.observe_step(600, 2, None, 4, 8, 0.004)  # a prefill step: eager on a GPU
    assert ctl.target_cost.num_samples == samples and (ctl.target_cost.theta == theta).all()
    assert ctl.draft_cost.num_samples == 5


def test_positions_the_drafter_could_not_propose_are_not_rejections():
    ctl = controller(**MEMORY_BOUND)
    train_acceptance(ctl, "r", 4)
    for _ in range(30):  # n-gram lookup found nothing: nothing verified, nothing paid
        ctl.observe_acceptance("r", 4, 0, 0)
    assert ctl.choose({"r": 4}) == {"r": 4}


def test_choice_is_the_best_plan_of_all():
    """Dinkelbach over every draft depth at once finds the plan a brute force finds."""
    import itertools

    import numpy as np

    rng = np.random.default_rng(0)
    for trial in range(60):
        a, b, c, pad = (rng.uniform(0.001, 0.03), rng.uniform(0, 0.004), rng.uniform(0, 0.004),
                        rng.uniform(0, 0.002))
        ctl = controller(max_k=3, a=a, b=b, c=c, draft=(rng.uniform(0, 0.01), rng.uniform(0, 0.002)), pad=pad)
        caps = {f"r{i}": int(rng.integers(0, 4)) for i in range(3)}
        for r in caps:
            ctl._alpha[r] = rng.uniform(0, 1, size=3)
            ctl._rate[r] = rng.uniform(0.05, 1)  # share of planned drafts the drafter proposes
        graph = trial % 2 == 1
        (_, b, c, pad), (d, e) = ctl.target_cost.theta, ctl.draft_cost.theta
        rate = [ctl._rate[r] for r in caps]

        def ratio(plan):
            gain = sum(q * np.prod(ctl._alpha[r][:j + 1]) for r, k, q in zip(caps, plan, rate) for j in range(k))
            tokens = sum(q * k for k, q in zip(plan, rate))
            padded = 3 * (1 + max(plan)) if graph else 0
            cost = (ctl.target_cost.predict([1.0, 3 + tokens, sum(q for k, q in zip(plan, rate) if k), padded])
                    + d * max(plan) + e * tokens)
            return (3 + gain) / cost

        plans = itertools.product(*(range(cap + 1) for cap in caps.values()))
        best = max(ratio(plan) for plan in plans)
        assert ratio(list(ctl.choose(caps, padded=graph).values())) == pytest.approx(best, rel=1e-9), trial


def test_drafts_rarely_proposed_do_not_pay_for_a_padded_graph_step():
    """n-gram lookup on chat: good drafts when there are any, but seldom any. On a graph
    step every request pays the padding whenever one drafts, so the rare proposals do
    not pay; eagerly, their tokens cost only when they exist, so they still do."""
    ctl = controller(**MEMORY_BOUND, pad=0.00005)
    caps = {f"r{i}": 4 for i in range(32)}
    for r in caps:
        for step in range(60):  # proposes 1 step in 10, and then all 4 are accepted
            proposed = 4 if step % 10 == 0 else 0
            ctl.observe_acceptance(r, 4, proposed, proposed)
    assert set(ctl.choose(caps, padded=True).values()) == {0}
    assert set(ctl.choose(caps).values()) == {4}
    often = controller(**MEMORY_BOUND, pad=0.00005)
    for r in caps:
        train_acceptance(often, r, 4)
    assert set(often.choose(caps, padded=True).values()) == {4}


def test_padding_makes_one_drafter_in_a_big_graph_batch_too_dear():
    """On a CUDA graph every request is padded to the longest query: one request with
    excellent drafts in a batch of 32 bad ones pays for 32 x k padded tokens."""
    ctl = controller(**MEMORY_BOUND, pad=0.0004)
    caps = {f"r{i}": 4 for i in range(32)}
    for r in caps:
        train_acceptance(ctl, r, 0)
    train_acceptance(ctl, "r0", 4)
    assert ctl.choose(caps)["r0"] == 4                    # eager: only its own tokens count
    assert set(ctl.choose(caps, padded=True).values()) == {0}


def test_memory_bound_and_always_accepted_drafts_take_the_maximum():
    ctl = controller(**MEMORY_BOUND)
    caps = {f"r{i}": 4 for i in range(8)}
    for r in caps:
        train_acceptance(ctl, r, 4)
    assert ctl.choose(caps) == caps


def test_never_accepted_drafts_get_zero():
    ctl = controller(**MEMORY_BOUND)
    train_acceptance(ctl, "bad", 0)
    train_acceptance(ctl, "good", 4)
    chosen = ctl.choose({"bad": 4, "good": 4})
    assert chosen == {"bad": 0, "good": 4}


def test_compute_bound_batch_gets_zero_even_with_fair_acceptance():
    ctl = controller(**COMPUTE_BOUND)
    caps = {f"r{i}": 4 for i in range(32)}
    for r in caps:
        for _ in range(20):  # the first draft is accepted half the time
            ctl.observe_acceptance(r, 4, 4, 1)
            ctl.observe_acceptance(r, 4, 4, 0)
    assert set(ctl.choose(caps).values()) == {0}


def test_draft_cost_lowers_k():
    # The first draft is accepted half the time: worth drafting when drafting is free,
    # not when each draft pass costs two thirds of a step (1.5 tokens for 5/3 the time).
    cheap = controller(**MEMORY_BOUND)
    dear = controller(**MEMORY_BOUND, draft=(0.02, 0.0))
    for ctl in (cheap, dear):
        for _ in range(40):
            ctl.observe_acceptance("r", 4, 4, 1)
            ctl.observe_acceptance("r", 4, 4, 0)
    assert cheap.choose({"r": 4})["r"] >= 1
    assert dear.choose({"r": 4})["r"] == 0


def test_caps_are_respected_and_idle_requests_are_probed():
    ctl = controller(**MEMORY_BOUND)
    ctl.probe_interval = 3
    train_acceptance(ctl, "good", 4)
    train_acceptance(ctl, "bad", 0)
    assert ctl.choose({"good": 2, "bad": 4, "off": 0}) == {"good": 2, "bad": 0, "off": 0}
    picks = [ctl.choose({"bad": 4})["bad"] for _ in range(6)]
    assert picks == [0, 1, 0, 0, 1, 0]  # one probe every 3 steps (the first choose counted)


def test_acceptance_tracks_the_position_of_the_first_rejection():
    ctl = DraftLengthController(4)
    for _ in range(50):
        ctl.observe_acceptance("r", 4, 4, 2)
    alpha = ctl._alpha["r"]
    assert alpha[0] == pytest.approx(1, abs=1e-3) and alpha[1] == pytest.approx(1, abs=1e-3)
    assert alpha[2] == pytest.approx(0, abs=1e-3)
    assert alpha[3] == pytest.approx(0.6)  # never observed: still the initial value
    ctl.free("r")
    assert "r" not in ctl._alpha


def test_engine_with_adaptive_speculation_is_lossless_and_frees_blocks(tiny_model_dir):
    llm = LLM32(str(tiny_model_dir("llama")), speculative_method="ngram", num_speculative_tokens=4,
                speculative_adaptive=True, block_size=4, num_kv_blocks=256, max_num_batched_tokens=64)
    plain = LLM32(str(tiny_model_dir("llama")), block_size=4, num_kv_blocks=256)
    prompts = ["a b c a b c a b c a b c", "def f(x): return x\ndef f(x):", "hello"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = llm.generate(prompts, params, use_tqdm=False)
    want = plain.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    engine = llm.engine
    assert engine.controller.target_cost.num_samples > 6  # profiled, then learned online
    assert engine.num_free_blocks == engine.kv.num_blocks
    assert sum(engine.draft_length_counts.values()) > 0
    # A request's own k still wins.
    out = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                  num_speculative_tokens=0), use_tqdm=False)[0]
    assert out.spec_stats.num_drafts == 0
