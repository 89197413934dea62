"""Draft paths (``num_draft_paths``): a greedy request verifies its best draft and further
paths that take a runner-up candidate at one depth, each over a block table of its own
forked for the step (``KVCacheManager.fork``); the longest accepted path's blocks are
kept, the others freed (``spec.paths.DraftPaths``)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve import SamplingParams
from specserve.errors import KVCacheError, SpecserveError
from specserve.kv_cache import KVCacheManager
from specserve.request import FinishReason, Request
from specserve.scheduler import Scheduler, StepResult
from specserve.spec.acceptance import PATH_GAIN_START
from specserve.spec.paths import DRAFT_FORKS, DraftPaths, PathEntry
from tiny_models import LLM32, save_perturbed

PROMPTS = ["a b c a b c a b c a b c", "def f(x): return x\ndef f(x):", "hello", "x = 1\ny = 2\nx = 1\n",
           "import os\nimport sys\nimport os\n"]
ENGINE = dict(block_size=4, num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=96)
KS = (4, 2, 4, 1, 3)  # per request: k = 1 and 2 leave some forks out (depth >= k)


# ---------------------------------------------------------------------- block tables
def test_a_path_shares_the_blocks_before_its_fork_and_owns_a_copy_of_the_next():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    assert kv.allocate_slots("a", 15) and kv.block_table("a") == [0, 1, 2, 3]
    # Fork at position 9 (block 2): blocks 0-1 shared, block 2 copied into the path's first.
    assert kv.fork("a", 1, 9, 15) == (2, 4)
    assert kv.branch_block_table("a", 1) == [0, 1, 4, 5]
    assert kv.fork("a", 2, 9, 15) == (2, 6)
    assert kv.num_branches("a") == 2 and kv.num_free_blocks == 16 - 8
    with pytest.raises(KVCacheError, match="forked twice"):
        kv.fork("a", 1, 9, 15)
    # Path 2 wins: its blocks replace the request's from the fork on; the rest go back.
    kv.merge("a", 2)
    assert kv.block_table("a") == [0, 1, 6, 7]
    assert kv.num_branches("a") == 0
    assert sorted(kv.pool.free_block_ids()) == [2, 3, 4, 5] + list(range(8, 16))
    # The request's own path wins: every path's blocks go back.
    assert kv.fork("a", 1, 8, 15) is not None  # a block boundary: block 2 is still copied
    assert kv.branch_block_table("a", 1)[:2] == [0, 1]
    kv.merge("a", None)
    assert kv.block_table("a") == [0, 1, 6, 7] and kv.num_free_blocks == 12
    # Freeing the request frees its paths too.
    kv.fork("a", 1, 9, 15)
    kv.free("a")
    assert kv.num_free_blocks == 16 and kv.num_branches("a") == 0


def test_a_fork_the_pool_cannot_hold_allocates_nothing():
    kv = KVCacheManager(num_blocks=5, block_size=4)
    kv.allocate_slots("a", 15)
    assert kv.fork("a", 1, 4, 15) is None  # needs 3 blocks, 1 free
    assert kv.num_free_blocks == 1 and kv.num_branches("a") == 0


# ---------------------------------------------------------------------- the paths
def _request(req_id: str, n: int, **params) -> Request:
    return Request(req_id, list(range(100, 100 + n)), SamplingParams(**params), frozenset({2}))


def test_paths_come_from_the_budget_left_first_paths_first_greedy_only():
    kv = KVCacheManager(64, 4)
    sched = Scheduler(kv, max_num_batched_tokens=40, max_num_seqs=8, max_model_len=512)
    paths = DraftPaths(kv, DRAFT_FORKS)
    reqs = [_request("g1", 6, temperature=0), _request("g2", 9, temperature=0),
            _request("s", 5, temperature=0.8, seed=1)]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()  # prefill: nothing drafts, so no paths
    assert not paths.add(out, 40 - out.num_scheduled_tokens) and not out.block_copies
    sched.update(out, StepResult([[7], [7], [7]]))
    out = sched.schedule({"g1": 3, "g2": 1, "s": 3})
    # 4 + 2 + 4 tokens for the requests, 30 left for paths of 1 + k tokens each, first
    # paths first; g2 (k = 1) forks only at depth 0, the sampling request never.
    assert paths.add(out, 40 - out.num_scheduled_tokens)
    added = [(p.req_id, p.path, p.fork, p.num_lookahead) for p in out.scheduled if isinstance(p, PathEntry)]
    assert added == [("g1", 1, (0, 1), 3), ("g2", 1, (0, 1), 1), ("g1", 2, (1, 1), 3),
                     ("g1", 3, (0, 2), 3), ("g2", 3, (0, 2), 1)]
    assert out.num_scheduled_tokens == 10 + 16
    g1 = [p for p in out.scheduled if p.req_id == "g1"]
    assert all(p.token_ids == [7] and p.start_pos == 6 for p in g1)
    # g1 has computed 6 tokens: the fork is at position 5 (a draft cache may lack it), block 1.
    own = kv.block_table("g1")
    assert [p.block_table[:1] for p in g1] == [own[:1]] * 4
    assert len({p.block_table[1] for p in g1}) == 4
    assert (own[1], g1[1].block_table[1]) in out.block_copies and len(out.block_copies) == 5
    # g1's second path accepts 2 drafts, its first 1, its own none: the second path wins.
    tokens = {("g1", 0): [9], ("g1", 1): [8, 9], ("g1", 2): [8, 8, 9], ("g1", 3): [9],
              ("g2", 0): [5, 6], ("g2", 1): [5, 6], ("g2", 3): [5], ("s", 0): [4]}
    kept = g1[2].block_table[:kv.num_blocks_for(6 + 3)]
    result = StepResult([tokens[p.req_id, getattr(p, "path", 0)] for p in out.scheduled if p.sample])
    own_out, own_result, outcomes = paths.keep_best(out, result)
    # The scheduler sees one entry per request: the winner in its own entry's place.
    assert [(p.req_id, getattr(p, "path", 0)) for p in own_out.scheduled] == [("g1", 2), ("g2", 0), ("s", 0)]
    assert outcomes == {"g1": (True, 4, 0), "g2": (False, 3, 1)}  # a tie keeps the request's own
    updates = sched.update(own_out, own_result)
    by_id = {u.req.req_id: u for u in updates}
    assert by_id["g1"].new_token_ids == [8, 8, 9] and by_id["g2"].new_token_ids == [5, 6]
    assert kv.block_table("g1") == kept and reqs[0].num_computed_tokens == 9
    assert kv.num_branches("g1") == kv.num_branches("g2") == 0
    used = sum(len(kv.block_table(r.req_id)) for r in reqs)
    assert kv.num_free_blocks == kv.num_blocks - used


def test_a_request_aborted_during_the_step_frees_its_paths():
    kv = KVCacheManager(64, 4)
    sched = Scheduler(kv, 64, 8, 512)
    paths = DraftPaths(kv, DRAFT_FORKS)
    sched.add_request(_request("g", 6, temperature=0))
    sched.update(sched.schedule(), StepResult([[7]]))
    out = sched.schedule({"g": 4})
    paths.add(out, 64 - out.num_scheduled_tokens)
    assert kv.num_branches("g") == 3
    sched.finish_request("g", FinishReason.ABORT)
    sched.update(*paths.keep_best(out, StepResult([[1]] * 4))[:2])
    assert kv.num_free_blocks == kv.num_blocks


# ---------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def near_draft(tmp_path_factory, tiny_model_dir):
    """The tiny target with perturbed weights: its best guess is often wrong, its runner-up
    often right."""
    return save_perturbed(tiny_model_dir("llama"), tmp_path_factory.mktemp("draft-paths"), 0.01)


def _greedy(k: int, max_tokens: int = 40) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, num_speculative_tokens=k)


@pytest.fixture(scope="module")
def plain_outputs(tiny_model_dir):
    return [o.token_ids for o in LLM32(str(tiny_model_dir("llama")), **ENGINE).generate(
        PROMPTS, [_greedy(k) for k in KS], use_tqdm=False)]


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("method", ["draft_model", "layerskip"])
def test_greedy_with_draft_paths_equals_speculation_off(tiny_model_dir, near_draft, plain_outputs, method, graphs):
    target = str(tiny_model_dir("llama"))
    drafter = dict(draft_model=near_draft) if method == "draft_model" else dict(layerskip_layers=1)
    stats = {}
    for paths in (1, 2, 4):
        llm = LLM32(target, speculative_method=method, num_speculative_tokens=4, speculative_adaptive=False,
                    num_draft_paths=paths, **drafter, **ENGINE)
        if graphs:
            llm.engine.enable_graphs(capture=False)
        got = llm.generate(PROMPTS, [_greedy(k) for k in KS], use_tqdm=False)
        assert [o.token_ids for o in got] == plain_outputs, paths
        assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks
        stats[paths] = llm.engine.spec_stats
    assert stats[1].num_path_wins == 0
    assert stats[2].num_path_wins > 0 and stats[4].num_path_wins > stats[2].num_path_wins
    assert stats[4].mean_acceptance_length > stats[1].mean_acceptance_length


def test_sampling_requests_draft_one_path_beside_greedy_ones_with_several(tiny_model_dir, near_draft):
    """A seeded sampling request in a batch with greedy requests that verify 3 paths gets
    exactly the tokens it gets where no request has paths."""
    target = str(tiny_model_dir("llama"))
    params = [_greedy(3), SamplingParams(temperature=0.9, seed=5, max_tokens=40, ignore_eos=True,
                                         num_speculative_tokens=3), _greedy(4)]
    outs = {}
    for paths in (1, 3):
        llm = LLM32(target, speculative_method="draft_model", draft_model=near_draft, num_speculative_tokens=4,
                    num_draft_paths=paths, **ENGINE)
        outs[paths] = [o.token_ids for o in llm.generate(PROMPTS[:3], params, use_tqdm=False)]
        assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks
    assert outs[3] == outs[1]


def test_paths_are_refused_where_the_drafter_ranks_no_candidates(tiny_model_dir, tmp_path):
    from tiny_models import make_eagle_head

    target = str(tiny_model_dir("llama"))
    with pytest.raises(SpecserveError, match="num_draft_paths 2 needs speculative_method draft_model or layerskip"):
        LLM32(target, speculative_method="ngram", num_draft_paths=2, **ENGINE)
    with pytest.raises(SpecserveError, match=r"num_draft_paths must be in \[1, 4\], got 5"):
        LLM32(target, speculative_method="layerskip", num_draft_paths=5, **ENGINE)
    # Speculation off (k = 0): nothing drafts, so nothing forks; the engine still serves.
    llm = LLM32(target, speculative_method="layerskip", num_speculative_tokens=0, num_draft_paths=2, **ENGINE)
    assert llm.engine.speculator.paths.forks == []
    assert len(llm.generate(["hi"], _greedy(0, 4), use_tqdm=False)[0].token_ids) == 4
    head = make_eagle_head(target, [1], tmp_path)[0]
    with pytest.raises(SpecserveError, match="proposes 1 path"):
        LLM32(target, speculative_method="draft_model", draft_model=head, num_draft_paths=2, **ENGINE)


def test_cli_refuses_paths_for_ngram_in_one_line(capsys, tiny_model_dir):
    from specserve.cli import main

    code = main(["generate", "hi", "--model", str(tiny_model_dir("llama")), "--speculative-method", "ngram",
                 "--num-draft-paths", "3"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "num_draft_paths 3 needs speculative_method" in err[0]


def test_each_path_drafts_what_the_draft_model_predicts_along_it(tiny_model_dir, near_draft):
    """A further path's drafts are the draft model's best guesses along that path (its
    fork's rank-th at the fork), as HF transformers computes them from the whole context:
    the path's draft cache — shared blocks, the copied block, its own — holds the right
    keys and values."""
    from transformers import AutoModelForCausalLM

    oracle = AutoModelForCausalLM.from_pretrained(near_draft, dtype=torch.float32).eval()
    llm = LLM32(str(tiny_model_dir("llama")), speculative_method="draft_model", draft_model=near_draft,
                num_speculative_tokens=4, speculative_adaptive=False, num_draft_paths=4, **ENGINE)
    engine = llm.engine
    steps, propose = [], engine.speculator.drafter.propose
    engine.speculator.drafter.propose = lambda scheduled, requests, stop=None: steps.append(
        [(p, list(requests[p.req_id].all_token_ids[:p.start_pos + 1])) for p in scheduled
         if isinstance(p, PathEntry)]) \
        or propose(scheduled, requests, stop)
    llm.generate(PROMPTS[:3], [_greedy(4, 24)] * 3, use_tqdm=False)
    checked = 0
    for paths in steps:
        for p, context in paths:
            ids = torch.tensor([context + p.draft_token_ids])
            with torch.no_grad():
                logits = oracle(ids).logits[0, len(context) - 1:-1]
            depth, rank = p.fork
            want = [int(row.topk(rank + 1).indices[rank] if j == depth else row.argmax())
                    for j, row in enumerate(logits)]
            assert p.draft_token_ids == want
            checked += 1
    assert checked > 20


@pytest.mark.parametrize("pairs", [[(3, 7)], [(1, 2), (3, 4), (5, 6), (8, 9), (10, 11), (12, 0)]])
def test_block_copies_reach_every_layers_k_and_v_and_nothing_else(tiny_model_dir, pairs):
    """A few pairs are copied one by one, more in one gather and scatter: the same blocks."""
    runner = LLM32(str(tiny_model_dir("llama")), **ENGINE).engine.runner
    torch.manual_seed(0)
    runner.kv_storage.copy_(torch.randn_like(runner.kv_storage))
    before = runner.kv_storage.clone()
    runner.copy_blocks(pairs)
    want = before.clone()
    for src, dst in pairs:
        want[:, :, dst] = before[:, :, src]
    assert torch.equal(runner.kv_storage, want)
    assert all(k.data_ptr() == runner.kv_storage[i, 0].data_ptr() for i, (k, _) in enumerate(runner.kv_caches))


def test_the_controller_learns_what_paths_add_and_chooses_who_forks(tiny_model_dir, near_draft, plain_outputs):
    """With adaptive speculation (the default) the controller's plan says which requests
    verify further paths (here: all but request "0", every request drafting its cap), and
    learns from each request-step what its own path accepted and what the paths added."""
    engine = LLM32(str(tiny_model_dir("llama")), speculative_method="draft_model", draft_model=near_draft,
                   num_speculative_tokens=4, num_draft_paths=4, **ENGINE).engine
    ctl = engine.speculator.controller
    ctl._plan = lambda caps, *args: (np.fromiter(caps.values(), dtype=int, count=len(caps)), {"0"} & set(caps), None, 0.0)
    seen, observe = [], ctl.observe_acceptance
    ctl.observe_acceptance = lambda req_id, outcome: seen.append((req_id, *outcome)) or observe(req_id, outcome)
    steps, schedule = [], engine.scheduler.schedule
    engine.scheduler.schedule = lambda *args: steps.append(schedule(*args)) or steps[-1]
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)) for p in PROMPTS]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.req_id: o.token_ids for o in engine.step() if o.finished})
    assert [done[i] for i in ids] == plain_outputs
    forked = {p.req_id for out in steps for p in out.scheduled if isinstance(p, PathEntry)}
    assert "0" not in forked and forked == set(ids) - {"0"}
    paths_of = {req_id: {paths for r, *_, paths, _ in seen if r == req_id} for req_id in ids}
    assert paths_of["0"] == {1} and all(4 in paths_of[r] for r in ids[1:])
    assert all(extra == 0 for *_, paths, extra in seen if paths == 1)
    extra_total = sum(extra for *_, extra in seen)
    assert extra_total > 0 and ctl.estimates.path_gain[4] != PATH_GAIN_START * 3
    own_total = sum(accepted for _, _, _, accepted, _, _ in seen)
    assert own_total + extra_total >= engine.spec_stats.num_accepted_tokens  # a stop may cut some
