"""Per-token drafting: the calibration map (draft confidence -> acceptance) learned from
synthetic outcomes, the stopping rule's choices at its extremes, n-gram lookup's
confidence from its match's length, and in the engine a draft model, an EAGLE head and
n-gram lookup whose drafts the rule cuts by confidence stay lossless: greedy tokens equal
plain greedy (float32) and sampling keeps the target's distribution."""
from __future__ import annotations

import dataclasses
import itertools
import math
import random
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tiny_models import (LLM32, continuation_chi_square, exact_continuations, make_eagle_head, save_perturbed,
                         sharpened)

from specserve import LLMEngine, SamplingParams
from specserve.scheduler import ScheduledRequest
from specserve.spec.calibration import EDGES, ConfidenceCalibration
from specserve.spec.planner import Prices
from specserve.spec.stopping import StopRule

GREEDY = SamplingParams(temperature=0)
SAMPLED = SamplingParams(temperature=1.0)


class Everyone:
    """Every request's k is the controller's: the rule may stop any of them."""

    def __contains__(self, req_id) -> bool:
        return True


def learned(truth, n: int = 40_000, depth: int = 0, greedy: bool = True, seed: int = 0,
            calibration: ConfidenceCalibration | None = None) -> ConfidenceCalibration:
    """A map taught ``n`` outcomes at ``depth``: confidence uniform, accepted with ``truth(c)``."""
    rng = np.random.default_rng(seed)
    cal = calibration or ConfidenceCalibration()
    for _ in range(n // 1000):
        conf = rng.uniform(0, 1, 1000)
        cal.observe(np.full(1000, greedy), np.full(1000, depth), conf, rng.uniform(0, 1, 1000) < truth(conf))
    return cal


def learned_everywhere(truth, n: int = 10_000) -> ConfidenceCalibration:
    """A map taught ``truth`` at every depth."""
    cal = None
    for depth in range(4):
        cal = learned(truth, n, depth, calibration=cal, seed=depth)
    return cal


def bin_truth(truth) -> np.ndarray:
    """Each bin's mean acceptance under ``truth`` with confidence uniform."""
    return np.array([truth(np.linspace(lo, hi, 1001)).mean() for lo, hi in zip(EDGES[:-1], EDGES[1:])])


def test_the_map_learns_acceptance_from_confidence_per_depth_and_kind():
    cal = learned(lambda c: c ** 2)
    cal = learned(lambda c: 0.5 * c, depth=2, calibration=cal, seed=1)
    cal = learned(lambda c: np.full_like(c, 0.9), greedy=False, calibration=cal, seed=2)
    table = cal.table
    # The forgetting keeps ~1,400 recent tokens per kind: a few hundred per bin at most.
    assert np.abs(table[0, 0] - bin_truth(lambda c: c ** 2)).max() < 0.12
    assert np.abs(table[0, 2] - bin_truth(lambda c: 0.5 * c)).max() < 0.12
    assert np.abs(table[1, 0] - 0.9).max() < 0.12  # sampling kept apart from greedy
    assert (np.diff(table, axis=-1) >= 0).all()  # monotone in confidence
    assert cal.predict(True, 5, [0.99])[0] == table[0, 3, -1]  # deeper depths share the last row
    # Unobserved: the prior, a calibrated draft (acceptance = confidence).
    fresh = ConfidenceCalibration()
    assert fresh.predict(True, 0, [0.05, 0.55, 0.99]) == pytest.approx([0.05, 0.55, 0.99])


def test_the_map_forgets_a_workload_that_changed():
    cal = learned(lambda c: np.zeros_like(c))
    assert cal.predict(True, 0, [0.97])[0] < 0.1
    cal = learned(lambda c: np.ones_like(c), n=6000, calibration=cal, seed=3)
    assert cal.predict(True, 0, [0.97])[0] > 0.9


def test_the_map_stays_monotone_when_its_data_is_not():
    cal = ConfidenceCalibration()
    # A high bin seen to fail, a low one to succeed: pooled, never inverted.
    cal.observe([True] * 200, [0] * 200, [0.15] * 100 + [0.85] * 100, [1] * 100 + [0] * 100)
    row = cal.table[0, 0]
    assert (np.diff(row) >= 0).all()
    assert row[1] == pytest.approx(row[8])


def test_the_map_is_remade_step_by_step_as_a_whole_remake_would_make_it():
    """Steps of a few tokens each (kinds, depths, confidences on and around the bins'
    edges, at 0 and 1): the map remade row by row after each, and its predictions, equal
    bit for bit a map made whole from every observation in arrays (a straightforward
    reference of the same rule)."""
    from specserve.spec.calibration import DEPTHS, FORGET, PRIOR_WEIGHT, _monotone

    def bins(confidence):  # each confidence's bin: the last edge at or below it, clipped to the bins
        return np.clip(np.searchsorted(EDGES, confidence, side="right") - 1, 0, len(EDGES) - 2)

    rng = np.random.default_rng(7)
    cal, total = ConfidenceCalibration(), 0
    seen, hits = np.zeros((2, DEPTHS, len(EDGES) - 1)), np.zeros((2, DEPTHS, len(EDGES) - 1))
    points = np.concatenate([EDGES, EDGES[1:-1] - 1e-12, rng.uniform(0, 1, 50)])
    for step in range(300):
        n = int(rng.integers(0, 9))
        greedy, depth = rng.uniform(size=n) < 0.7, rng.integers(0, 6, n)
        conf, accepted = rng.choice(points, n), rng.uniform(size=n) < 0.6
        cal.observe(greedy.tolist(), depth.tolist(), conf.tolist(), accepted.tolist())
        total += n
        kinds, depths = np.where(greedy, 0, 1), np.minimum(depth, DEPTHS - 1)
        counts = np.zeros((2, DEPTHS))
        np.add.at(counts, (kinds, depths), 1.0)
        seen *= (FORGET ** counts)[:, :, None]
        hits *= (FORGET ** counts)[:, :, None]
        index = (kinds, depths, bins(conf))
        np.add.at(seen, index, 1.0)
        np.add.at(hits, index, accepted.astype(float))
        if step % 7 == 0 or step > 290:
            weight = seen + PRIOR_WEIGHT
            raw = (hits + PRIOR_WEIGHT * cal.prior) / weight
            want = np.array([[_monotone(raw[k, d], weight[k, d]) for d in range(DEPTHS)] for k in range(2)])
            assert np.array_equal(cal.table, want), step
            assert np.array_equal(cal.predict(True, 2, points), want[0, 2][bins(points)])
            assert cal.describe()["greedy"]["acceptance"] == want[0].round(4).tolist()
    assert cal.num_observed == total


def rows(*caps: int, params: SamplingParams = GREEDY) -> list[ScheduledRequest]:
    return [ScheduledRequest(f"r{i}", [0], 10, [0], params, num_lookahead=k) for i, k in enumerate(caps)]


def drive(stop, confidences) -> list[int]:
    """Run a DraftStop over ``confidences[depth][row]`` as a drafter would."""
    n = len(confidences[0])
    for depth, conf in enumerate(confidences):
        n = stop.after(depth, conf[:n])
        if n == 0:
            break
    return stop.kept


COMPUTE_BOUND = Prices(fixed=0.010, token=0.006, span=0.001, padded_token=0.0, draft_pass=0.002, draft_token=0.001)
MEMORY_BOUND = Prices(fixed=0.010, token=0.0001, span=0.0001, padded_token=0.0, draft_pass=0.0005,
                      draft_token=0.00001)


def test_uninformative_confidence_where_tokens_are_dear_stops_at_depth_zero():
    cal = learned_everywhere(lambda c: np.full_like(c, 0.3))  # confidence says nothing: 30% whatever it is
    stop = StopRule(cal, COMPUTE_BOUND, 1, Everyone()).begin(rows(6))
    assert drive(stop, [[0.99]] * 6) == [0]
    assert len(stop.pass_rows) == 1 and stop.confidence == [[]] and stop.dropped == [(0, 0.99)]


def test_confident_drafts_where_tokens_are_cheap_go_to_the_plan():
    cal = learned_everywhere(lambda c: np.where(c > 0.9, 0.97, 0.0))
    stop = StopRule(cal, MEMORY_BOUND, 1, Everyone()).begin(rows(6))
    assert drive(stop, [[0.99]] * 6) == [6]
    assert len(stop.pass_rows) == 6  # the catch-up's proposal and five more passes
    # The same prices, a draft unsure at depth 2 (where the unsure are never accepted):
    # it keeps two and stops.
    stop = StopRule(cal, MEMORY_BOUND, 1, Everyone()).begin(rows(6))
    assert drive(stop, [[0.99], [0.99], [0.3], [0.99], [0.99], [0.99]]) == [2]


def test_the_spent_first_pass_is_part_of_the_steps_time():
    """A first draft pays if its chance covers its verify cost at the step's goodput, and the
    step's time includes the first draft pass, already run: a 34 % draft pays (0.34 >=
    4 / 16) where it would not against the step without the pass (4 / 10); a 16 % one
    does not."""
    prices = Prices(fixed=0.010, token=0.004, span=0.0, padded_token=0.0, draft_pass=0.006, draft_token=0.0)
    for acceptance, kept in ((0.34, [1]), (0.16, [0])):
        cal = learned_everywhere(lambda c, a=acceptance: np.full_like(c, a))
        assert drive(StopRule(cal, prices, 1, Everyone()).begin(rows(1)), [[0.5]]) == kept, acceptance


def test_requests_the_controller_did_not_choose_draft_what_they_planned():
    cal = learned(lambda c: np.full_like(c, 0.3))
    stop = StopRule(cal, COMPUTE_BOUND, 2, {"r1"}).begin(rows(4, 4))  # r0: its own k
    assert drive(stop, [[0.5, 0.5]] * 4) == [4, 0]


def test_a_batch_stops_row_by_row():
    cal = learned_everywhere(lambda c: np.where(c > 0.9, 0.97, 0.0))
    stop = StopRule(cal, MEMORY_BOUND, 3, Everyone()).begin(rows(5, 5, 3))
    # Row 1 is unsure from depth 1, row 2 reaches its cap, row 0 goes on.
    assert drive(stop, [[0.99, 0.99, 0.99], [0.99, 0.2, 0.99], [0.99, 0.99, 0.99],
                        [0.99, 0.99, 0.99], [0.99, 0.99, 0.99]]) == [5, 1, 3]
    assert stop.dropped == [None, (1, 0.2), None]  # the draft row 1 did not keep; the others reached their caps


# ------------------------------------------------------------------ n-gram lookup
def test_a_match_length_counts_the_tokens_a_span_repeats():
    from specserve.drafts.ngram import match_length

    rng = random.Random(0)
    for _ in range(2000):
        tokens = [rng.randrange(3) for _ in range(rng.randint(2, 150))]
        end, cap = rng.randrange(len(tokens) - 1), rng.randint(1, 80)
        n = 0
        while n < min(cap, end + 1) and tokens[end - n] == tokens[len(tokens) - 1 - n]:
            n += 1
        assert match_length(tokens, end, cap) == n, (tokens, end, cap)


def test_an_ngram_draft_stops_by_its_matchs_length():
    """Three requests, each proposing its match's continuation: a 25-token span copied
    (confidence 0.96), a period of three tokens repeating (its match 6 tokens long, 0.83;
    only three tokens follow it) and two tokens in common (0.5). The map says matches of
    five tokens or more are accepted, shorter ones seldom: the first two draft what they
    have, the third nothing, its first draft kept for the map as dropped. Then depth by
    depth, with requests whose k is not the controller's."""
    from specserve.drafts.ngram import NgramDrafter, confidence

    copied = list(range(100, 130)) + list(range(100, 125))
    requests = {"r0": SimpleNamespace(all_token_ids=copied),
                "r1": SimpleNamespace(all_token_ids=[1, 2, 3] * 3),
                "r2": SimpleNamespace(all_token_ids=[1, 2, 9, 4, 1, 2])}
    plain = NgramDrafter(4, 2).propose(rows(4, 4, 4), requests)
    assert plain.draft_token_ids == [[125, 126, 127, 128], [1, 2, 3], [9, 4, 1, 2]] and plain.confidence is None
    cal = learned_everywhere(lambda c: np.where(c > 0.8, 0.97, 0.2))
    prices = Prices(fixed=1.0, token=0.1, span=0.0, padded_token=0.0, draft_pass=0.0, draft_token=0.0)
    proposal = NgramDrafter(4, 2).propose(rows(4, 4, 4), requests, StopRule(cal, prices, 3, Everyone()))
    assert proposal.draft_token_ids == [[125, 126, 127, 128], [1, 2, 3], []]
    assert proposal.confidence == [[confidence(25)] * 4, [confidence(6)] * 3, []]
    assert proposal.dropped == [None, None, (0, 9, 0.5)]
    assert proposal.goodput is not None and proposal.pass_rows[0] == 3
    # Second drafts less sure (60 %) and later ones seldom accepted: the two requests whose
    # k is the controller's keep two drafts, the rule not going on to a third, which each
    # reports as dropped (looked up already, it teaches the map); the third request's k is
    # its own, and it keeps its whole proposal.
    cal = learned(lambda c: np.full_like(c, 0.97), n=4000)
    cal = learned(lambda c: np.full_like(c, 0.6), n=4000, depth=1, calibration=cal, seed=1)
    for depth in (2, 3):
        cal = learned(lambda c: np.full_like(c, 0.05), n=4000, depth=depth, calibration=cal, seed=depth)
    proposal = NgramDrafter(4, 2).propose(rows(4, 4, 4), requests, StopRule(cal, prices, 3, {"r0", "r1"}))
    assert proposal.draft_token_ids == [[125, 126], [1, 2], [9, 4, 1, 2]]
    assert proposal.dropped == [(2, 127, confidence(25)), (2, 3, confidence(6)), None]


# ------------------------------------------------------------------ in the engine
PROMPTS = [[5, 17, 99, 230, 17, 99], [7, 8, 9, 7, 8, 9, 10], list(range(3, 40)), [11, 12], [40, 41, 40, 41, 40]]
SMALL = {"max_num_batched_tokens": 32, "max_num_seqs": 8, "block_size": 4, "num_kv_blocks": 256}
# Keep a token while its chance pays half the step's goodput: drafts are cut by confidence.
HALF = Prices(fixed=1.0, token=0.5, span=0.0, padded_token=0.0, draft_pass=0.0, draft_token=0.0)


def force_rule(engine, rule: StopRule) -> list[list[int]]:
    """Every step's drafting goes through ``rule``; returns what each step kept per request."""
    drafter, kept = engine.speculator.drafter, []
    propose = drafter.propose

    def ruled(scheduled, requests, stop=None):
        proposal = propose(scheduled, requests, rule)
        kept.append([len(d) for d in proposal.draft_token_ids])
        return proposal

    drafter.propose = ruled
    return kept


@pytest.fixture(scope="module")
def near(tmp_path_factory, tiny_model_dir):
    return sharpened(save_perturbed(tiny_model_dir("llama"), tmp_path_factory.mktemp("near"), 0.01))


@pytest.fixture(scope="module")
def unsure(tmp_path_factory, tiny_model_dir):
    """The target itself, sharpened: the same candidates as the target's, in other proportions."""
    return sharpened(save_perturbed(tiny_model_dir("llama"), tmp_path_factory.mktemp("unsure"), 0.0), 12.0)


def greedy_under_half(drafter: str, tiny_model_dir, near, tmp_path):
    """Plain greedy's outputs of ``PROMPTS``, and an engine drafting 5 a step with a draft
    model or an EAGLE head, every step under ``HALF``'s rule: (params, want, llm, kept as
    ``force_rule`` returns it)."""
    target = str(tiny_model_dir("llama"))
    draft = near if drafter == "draft_model" else sharpened(make_eagle_head(target, [1], tmp_path)[0])
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = LLM32(target, **SMALL).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM32(target, speculative_method="draft_model", draft_model=draft, num_speculative_tokens=5,
                speculative_adaptive=False, **SMALL)
    return params, want, llm, force_rule(llm.engine, StopRule(ConfidenceCalibration(), HALF, 1, Everyone()))


@pytest.mark.parametrize("drafter", ["draft_model", "eagle"])
def test_cut_drafts_keep_greedy_decoding_exact(drafter, tiny_model_dir, near, tmp_path):
    params, want, llm, kept = greedy_under_half(drafter, tiny_model_dir, near, tmp_path)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    lengths = {k for step in kept for k in step}
    assert 0 in lengths and 5 in lengths and lengths & {1, 2, 3, 4}  # the rule cut, and not always
    assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks


def test_ngram_drafts_cut_by_their_match_keep_greedy_decoding_exact(tiny_model_dir):
    target = str(tiny_model_dir("llama"))
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = LLM32(target, **SMALL).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM32(target, speculative_method="ngram", num_speculative_tokens=5, speculative_adaptive=False, **SMALL)
    kept = force_rule(llm.engine, StopRule(ConfidenceCalibration(), HALF, 1, Everyone()))
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    lengths = {k for step in kept for k in step}
    assert 0 in lengths and lengths & {1, 2, 3, 4, 5}
    assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks


def test_ngram_stops_by_its_matches_by_default_on_a_cpu(tiny_model_dir):
    """Adaptive n-gram lookup with the default ``draft_stopping``: on a CPU the controller
    keeps a calibration map and drafting stops by the matches' lengths, the map learning
    from the verified drafts; greedy output is plain greedy's. Asked to, it plans k from
    each request's acceptance instead."""
    target = str(tiny_model_dir("llama"))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    repeating = [[5, 6, 7, 8, 9, 10, 11, 12] * 4, [20, 21, 22] * 6, [7, 8, 9, 7, 8, 9, 10]]
    want = LLM32(target, **SMALL).generate(repeating, params, use_tqdm=False)
    llm = LLM32(target, speculative_method="ngram", num_speculative_tokens=4, **SMALL)
    controller = llm.engine.speculator.controller
    on_cpu = not torch.cuda.is_available()
    assert (controller.calibration is not None) == on_cpu
    stops = []
    choose = controller.choose
    controller.choose = lambda *a, **kw: (choose(*a, **kw), stops.append(controller.stop))[0]
    got = llm.generate(repeating, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    if on_cpu and llm.engine.spec_stats.num_drafts:  # drafting paid on this machine's step times
        assert any(stops) and controller.calibration.num_observed > 0
    assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks
    planned = LLM32(target, speculative_method="ngram", draft_stopping="plan", **SMALL)
    assert planned.engine.speculator.controller.calibration is None


@pytest.mark.parametrize("drafter", ["draft_model", "eagle"])
def test_a_draft_pass_runs_only_the_rows_still_drafting(drafter, tiny_model_dir, near, tmp_path):
    """Rows are ordered by their planned k, so the rows the rule keeps drafting need not be
    the first ones: each further pass of a draft model or an EAGLE head runs those rows
    only (their proposals and, for a head, its features gathered), as the rule prices a
    pass (where it ran every row up to the last one going, a batch's stopped rows cost each
    pass), and greedy output stays plain greedy's."""
    from specserve.batch import DeviceTokenIds
    from specserve.spec.stopping import DraftStop

    params, want, llm, _ = greedy_under_half(drafter, tiny_model_dir, near, tmp_path)
    drafter = llm.engine.speculator.drafter
    decided, ran = [], []
    next_pass, forward = DraftStop._next_pass, drafter._forward

    def judged(self, *args):
        n = next_pass(self, *args)
        decided.append(list(self.running) if n else None)
        return n

    def counted(entries, *args):
        if args and isinstance(args[-1], DeviceTokenIds):  # a further pass (fed the last pass's proposals)
            ran.append(len(entries))
        return forward(entries, *args)

    speculator = llm.engine.speculator
    propose, reported = speculator.propose, []
    speculator.propose = lambda *a: (drafts := propose(*a), reported.append(drafts.pass_rows))[0]
    DraftStop._next_pass = judged
    drafter._forward = counted
    try:
        got = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        DraftStop._next_pass = next_pass
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    going = [rows for rows in decided if rows]
    assert ran == [len(rows) for rows in going]
    assert any(rows != list(range(len(rows))) for rows in going)  # some pass skipped a stopped row
    # What the step reports for the drafter's cost model: each pass's rows, as they ran.
    assert [n for rows in reported if rows for n in rows[1:]] == ran
    assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks


def test_the_rule_counts_what_drafting_at_all_cost_before_its_first_choice():
    """The step's expected time before the rule's first choice holds the step without
    drafts, the drafter's cost of drafting at all (its fixed part and each drafting
    request's: a lazily fed draft's catch-up) and its first pass: all spent whatever the
    rule keeps. Left out, the step's goodput so far is overstated and drafts that pay are
    dropped. Each further pass adds its own cost over the rows it runs."""
    prices = Prices(fixed=0.010, token=0.001, span=0.0, padded_token=0.0, draft_pass=0.003, draft_token=0.0005,
                    draft_fixed=0.002, draft_request=0.001)
    rows = [ScheduledRequest(f"r{i}", [7], 10, [0], GREEDY, num_lookahead=3) for i in range(4)]
    stop = StopRule(ConfidenceCalibration(), prices, 4, Everyone()).begin(rows, compact=True)
    assert stop.time == pytest.approx(0.010 + 0.002 + 0.003 + 4 * (0.001 + 0.0005))
    assert stop.pass_rows == [4]
    before = stop.time
    stop.after(0, [0.999, 0.001, 0.999, 0.001])  # rows 0 and 2 keep their drafts and draft on
    assert stop.kept == [1, 0, 1, 0] and stop.running == [0, 2] and stop.pass_rows == [4, 2]
    assert stop.time == pytest.approx(before + 2 * prices.token + 0.003 + 2 * 0.0005)


def test_a_steps_sample_counts_the_rows_its_draft_passes_ran():
    """The drafter's cost is fitted per row its passes ran (``StepSample.draft_rows``):
    where drafting stops by confidence, the rows still drafting at each pass, fewer than
    the planned k say; else each drafting request's passes for its own k. A catch-up that
    yields the first proposals is not one of the passes the fit counts."""
    from types import SimpleNamespace

    from specserve.scheduler import SchedulerOutput
    from specserve.spec.cost_model import StepCosts
    from specserve.spec.speculator import Drafts, Speculator

    planned = [ScheduledRequest(f"r{i}", [7], 10, [0], GREEDY, num_lookahead=k, draft_token_ids=[0] * k)
               for i, k in enumerate((4, 4, 2, 0))]
    for first_free, stopped, planned_rows in ((False, 7, 10), (True, 4, 7)):
        speculator = SimpleNamespace(controller=SimpleNamespace(costs=StepCosts(first_free)),
                                     runner=SimpleNamespace(padded_tokens=lambda *args: 0))
        cut = Speculator._step_sample(speculator, Drafts(SchedulerOutput(planned, []), pass_rows=[3, 2, 1, 1]), 0.01)
        assert (cut.depth, cut.num_drafting, cut.draft_rows) == (4, 3, stopped)
        whole = Speculator._step_sample(speculator, Drafts(SchedulerOutput(planned, [])), 0.01)
        assert (whole.depth, whole.num_drafting, whole.draft_rows) == (4, 3, planned_rows)


def test_the_default_learns_its_map_and_stays_exact(tiny_model_dir, near):
    """Adaptive with a draft model, stopping by confidence (the default on a CPU): the rule runs, the
    map learns from the verified tokens, and greedy output is plain greedy's."""
    target = str(tiny_model_dir("llama"))
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = LLM32(target, **SMALL).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM32(target, speculative_method="draft_model", draft_model=near, num_speculative_tokens=4,
                draft_stopping="confidence", **SMALL)
    controller = llm.engine.speculator.controller
    assert controller.calibration is not None
    stops = []
    choose = controller.choose
    controller.choose = lambda *a, **kw: (choose(*a, **kw), stops.append(controller.stop))[0]
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    if llm.engine.spec_stats.num_drafts:  # drafting paid on this machine's step times: the map learned
        assert any(stops) and controller.calibration.num_observed > 0
    assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks


def test_the_map_learns_from_the_drafts_the_rule_drops(tiny_model_dir, unsure):
    """A draft the rule drops is never verified, but where every draft kept before it was
    accepted, a greedy request's next token is the target's choice at its position: the
    map learns whether it would have been accepted. Here every first draft is dropped
    (tokens priced out), so nothing is verified, and the draft (the target, sharpened) has
    the target's argmax: every dropped greedy draft is learned as accepted, at depth 0, and
    the output is plain greedy's. Sampled drafts are not learned from when dropped."""
    target = str(tiny_model_dir("llama"))
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = LLM32(target, **SMALL).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM32(target, speculative_method="draft_model", draft_model=unsure, num_speculative_tokens=3,
                draft_stopping="confidence", **SMALL)
    controller = llm.engine.speculator.controller
    dear = dataclasses.replace(HALF, token=1e6)

    def choose(caps, *args, **kwargs):  # every request drafts its cap, under the dear rule
        controller.stop = StopRule(controller.calibration, dear, len(caps), Everyone())
        return dict(caps)

    controller.choose = choose
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert llm.engine.spec_stats.num_drafts == 0  # nothing verified
    cal = controller.calibration
    assert cal.seen[0, 0].sum() > 0 and np.allclose(cal.accepted[0, 0], cal.seen[0, 0])
    assert cal.seen[0, 1:].sum() == 0 and cal.seen[1].sum() == 0
    observed = cal.num_observed
    llm.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert cal.num_observed == observed and cal.seen[1].sum() == 0
    assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks


def test_a_lazy_draft_proposes_what_a_draft_fed_in_lockstep_proposes(tiny_model_dir, near):
    """Where drafting stops by confidence a draft model feeds a request only when it drafts,
    its prompt included (at its first drafts; all but the last token in a pass of their own
    when longer than ``LAZY_APART``, as the 37-token prompt here): requests drafting their
    own k = 3 every step get the same drafts as from a draft fed in lockstep, chunk by chunk
    (the plan's engine), so the same tokens are accepted; and a request that never drafts
    costs the draft no pass."""
    from specserve.drafts.model_drafter import LAZY_APART

    assert max(len(p) for p in PROMPTS) > LAZY_APART
    target = str(tiny_model_dir("llama"))
    counts, passes = {}, {}
    for stopping in ("confidence", "plan"):
        llm = LLM32(target, speculative_method="draft_model", draft_model=near, num_speculative_tokens=3,
                    draft_stopping=stopping, **SMALL)
        drafter = llm.engine.speculator.drafter
        assert drafter.lazy_from == (1 if stopping == "confidence" else math.inf)
        fed = []
        forward, catch_up = drafter._forward, drafter._catch_up_pass
        drafter._forward = lambda entries, *a, fed=fed, forward=forward: (
            fed.append(sum(len(e.token_ids) for e in entries)), forward(entries, *a))[1]
        # (a step without drafts may replay the draft's graph on the target's inputs, on a GPU)
        drafter._catch_up_pass = lambda scheduled, entries, fed=fed, catch_up=catch_up: (
            fed.append(sum(len(e.token_ids) for e in entries)), catch_up(scheduled, entries))[1]
        got = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                   num_speculative_tokens=3), use_tqdm=False)
        stats = llm.engine.spec_stats
        counts[stopping] = ([o.token_ids for o in got], stats.num_drafts, stats.num_accepted_tokens)
        fed.clear()
        llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=5, num_speculative_tokens=0),
                     use_tqdm=False)
        passes[stopping] = len(fed)
        assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks
    assert counts["confidence"] == counts["plan"] and counts["plan"][2] > 0
    assert passes["confidence"] == 0 < passes["plan"]  # (the plan's draft prefills the prompt)


def test_a_draft_fed_lazily_in_large_steps_only_proposes_what_lockstep_does(tiny_model_dir, near):
    """A draft model fed lazily in steps of at least ``lazy_from`` requests only, in
    lockstep in smaller ones (``catch_up_lazily``): requests skip drafting every third step
    while the batch drains from five requests to two, so backlogs left by large steps are
    fed in small ones (in the catch-up, or in a pass of their own by a request that drafts
    there), and the other way round. Every request's drafts are those of a draft fed in
    lockstep all along (and of one fed lazily all along): the same tokens are accepted,
    the outputs are plain greedy's, and the large steps feed the draft fewer tokens than
    lockstep does. (On the CPU: the draft's passes are counted where they run, not
    replayed on the target's inputs.)"""
    target = str(tiny_model_dir("llama"))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 12, 40, 12, 12)]
    got, fed, sizes = {}, {}, {}
    for lazy_from in (math.inf, 3, 1):
        llm = LLM32(target, speculative_method="draft_model", draft_model=near, num_speculative_tokens=3,
                    speculative_adaptive=False, draft_stopping="plan", device="cpu", **SMALL)
        speculator = llm.engine.speculator
        drafter = speculator.drafter
        drafter.catch_up_lazily(lazy_from)  # (fixed k: in lockstep, unless told)
        fed[lazy_from], sizes[lazy_from] = [], []
        forward, propose, plan, steps = drafter._forward, drafter.propose, speculator._drafter_plan, itertools.count()
        drafter._forward = lambda entries, *a, f=fed[lazy_from], forward=forward: (
            f.append(sum(len(e.token_ids) for e in entries)), forward(entries, *a))[1]
        drafter.propose = lambda scheduled, *a, s=sizes[lazy_from], propose=propose: (
            s.append(len(scheduled)), propose(scheduled, *a))[1]

        def skipping(scheduler, plan=plan, steps=steps):
            step, chosen = next(steps), plan(scheduler)
            return {r: 0 if (step + i) % 3 == 0 else k for i, (r, k) in enumerate(sorted(chosen.items()))}

        speculator._drafter_plan = skipping
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        stats = llm.engine.spec_stats
        got[lazy_from] = ([o.token_ids for o in outputs], stats.num_drafts, stats.num_accepted_tokens)
        assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks
    assert got[3] == got[math.inf] == got[1] and got[3][2] > 0
    assert min(sizes[3]) < 3 <= max(sizes[3])  # steps of both kinds
    assert sum(fed[1]) < sum(fed[3]) < sum(fed[math.inf])
    plain = LLM32(target, device="cpu", **SMALL).generate(PROMPTS, params, use_tqdm=False)
    assert got[3][0] == [o.token_ids for o in plain]


def test_a_lazy_drafts_backlog_is_not_charged_to_the_step_that_drafts(tiny_model_dir, near):
    """A lazy draft catches a request up on its prompt (37 tokens, more than
    ``LAZY_APART``) in a pass of its own at the request's first drafts, as it would on the
    tokens of the steps a veto left undrafted: that pass is what starting to draft costs
    once. The goodput check gets the step's time without it (else a check under a veto
    paid for every token the plain steps left unfed, and confirmed the veto), and so does
    the target's cost model; the next steps have no backlog."""
    llm = LLM32(str(tiny_model_dir("llama")), speculative_method="draft_model", draft_model=near,
                num_speculative_tokens=3, draft_stopping="confidence", **SMALL)
    speculator = llm.engine.speculator
    drafter, controller = speculator.drafter, speculator.controller
    assert drafter.lazy_from == 1
    forward = drafter._forward

    def slow_backlog(entries, *args):  # the backlog pass: whole chunks, nothing sampled
        if any(not e.sample and len(e.token_ids) > 1 for e in entries):
            time.sleep(0.05)
        return forward(entries, *args)

    drafter._forward = slow_backlog
    steps, charged = [], []
    observe, goodput = speculator.observe, controller.observe_goodput

    def spy(drafts, updates, elapsed):  # what the step cost, and what the cost model would learn of it
        steps.append((drafts.backlog_s, elapsed, speculator._step_sample(drafts, elapsed).target_s, drafts.draft_s))
        observe(drafts, updates, elapsed)

    speculator.observe = spy
    controller.observe_goodput = lambda tokens, seconds, *choice: (charged.append(seconds),
                                                                  goodput(tokens, seconds, *choice))[1]
    llm.generate(PROMPTS[2:3], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                              num_speculative_tokens=3), use_tqdm=False)
    backlogs = [backlog for backlog, *_ in steps]
    assert backlogs[0] == 0.0 and sum(b >= 0.05 for b in backlogs) == 1  # the prompt's chunk, then the first drafts
    assert sum(b > 0 for b in backlogs) == 1
    assert charged == [elapsed - backlog for backlog, elapsed, *_ in steps]
    assert all(target == elapsed - draft - backlog for backlog, elapsed, target, draft in steps)
    assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks


def test_a_draft_path_engine_keeps_its_static_forks(tiny_model_dir, near):
    llm = LLM32(str(tiny_model_dir("llama")), speculative_method="draft_model", draft_model=near,
                num_speculative_tokens=4, num_draft_paths=2, draft_stopping="confidence", **SMALL)
    assert llm.engine.speculator.controller.calibration is None


def test_draft_stopping_is_chosen_or_refused(tiny_model_dir, near):
    from specserve import EngineConfig
    from specserve.errors import SpecserveError

    def calibrated(mode: str) -> bool:
        llm = LLM32(str(tiny_model_dir("llama")), speculative_method="draft_model", draft_model=near,
                    draft_stopping=mode, **SMALL)
        return llm.engine.speculator.controller.calibration is not None

    assert calibrated("confidence") and not calibrated("plan")
    assert calibrated("auto") == (not torch.cuda.is_available())  # auto: on a CPU, not on a GPU
    with pytest.raises(SpecserveError, match="draft_stopping must be one of auto, confidence, plan"):
        EngineConfig(draft_stopping="sometimes")


@pytest.mark.parametrize("drafter", ["draft_model", "eagle", "ngram"])
def test_sampling_with_drafts_cut_by_confidence_has_the_target_distribution(drafter, tiny_model_dir, unsure,
                                                                           tmp_path):
    """4-token continuations (top_k = 2: 16 outcomes, exact from transformers) with drafts a
    confidence rule cuts at varied depths: chi-square within its 15 degrees of freedom.
    The rule reads q's top probability, never the drawn token's: with the drawn token's
    probability instead, chi-square is in the hundreds (checked). A draft model and an EAGLE
    head alike: their further passes run only the rows still drafting. And n-gram lookup,
    its proposals one-hot, cut by its matches' lengths."""
    target = str(tiny_model_dir("llama"))
    drafting = {"speculative_method": "ngram"} if drafter == "ngram" else {
        "speculative_method": "draft_model",
        "draft_model": unsure if drafter == "draft_model" else sharpened(make_eagle_head(target, [1], tmp_path)[0],
                                                                         12.0)}
    prompt = [5, 17, 99, 230, 17, 99]
    if drafter == "ngram":  # the target's own greedy tokens after it: sampled ones repeat some of their pairs
        prompt += [316, 316, 2, 469, 2, 469, 268, 440, 238, 308, 207, 372]
    length, sp = 4, dict(temperature=1.0, top_k=2)
    exact = exact_continuations(target, prompt, length, sp)
    n = 3000
    engine = LLMEngine(dtype="float32", model=target, **drafting, num_speculative_tokens=3, speculative_adaptive=False,
                       max_num_batched_tokens=4096, max_num_seqs=512, block_size=16, num_kv_blocks=2000)
    # Keep while the chance of acceptance is over about half, in steps of up to 512 requests.
    kept = force_rule(engine, StopRule(ConfidenceCalibration(), dataclasses.replace(HALF, fixed=512.0), 512,
                                       Everyone()))
    chi2 = continuation_chi_square(engine, prompt, sp, exact, n)
    assert len(exact) == 16 and chi2 < 37.7, chi2  # p = 0.001 for 15 degrees of freedom
    lengths = [k for step in kept for k in step]
    # Cut at every depth (n-gram: matches of two or three tokens kept one draft of their three)
    assert ({0, 1} if drafter == "ngram" else {0, 1, 2}) <= set(lengths)


def test_metrics_show_the_calibration_map(chat_model_dir):
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from specserve.async_engine import AsyncLLMEngine
    from specserve.server import ThreadedServer
    from specserve.server.app import create_app

    engine = AsyncLLMEngine(LLMEngine(model=str(chat_model_dir), dtype="float32", block_size=4, num_kv_blocks=128,
                                      speculative_method="draft_model", draft_model=str(chat_model_dir),
                                      draft_stopping="confidence"))
    srv = ThreadedServer(create_app(engine, served_model_name="tiny"))
    with srv:
        calibration = engine.engine.draft_calibration
        calibration.observe([True] * 10, [0] * 10, [0.99] * 10, [1] * 10)
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)}
    predicted = families["specserve:spec_decode_calibrated_acceptance"].samples
    seen = families["specserve:spec_decode_calibration_observations"].samples
    assert len(predicted) == len(seen) == 2 * 4 * 12  # kinds x depths x bins
    top = {(s.labels["kind"], s.labels["depth"], s.labels["confidence_le"]): s.value for s in seen}
    assert top["greedy", "0", "1.0"] >= 10
    assert all(0 <= s.value <= 1 for s in predicted)
