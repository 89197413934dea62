"""Scheduler driven by a scripted fake runner over a real KVCacheManager.

The fake runner gives every request that samples the token ``token_at(position)`` unless a
test scripts other tokens for it, so a request's output does not depend on batching or on
preemption, and exact outputs can be asserted.
"""
from __future__ import annotations

import random

import pytest

from specserve.kv_cache import KVCacheManager
from specserve.request import FinishReason, Request, RequestStatus
from specserve.sampling_params import SamplingParams
from specserve.scheduler import Scheduler, SchedulerOutput, StepResult

EOS = 2


def token_at(position: int) -> int:
    """The fake runner's token for ``position`` (never EOS)."""
    return 1000 + position


def make_scheduler(*, num_blocks: int = 64, block_size: int = 4, budget: int = 32,
                   max_num_seqs: int = 8, max_model_len: int = 1024) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, block_size), max_num_batched_tokens=budget,
                     max_num_seqs=max_num_seqs, max_model_len=max_model_len)


def make_request(req_id: str, num_prompt_tokens: int, **params) -> Request:
    prompt = [100 + i for i in range(num_prompt_tokens)]
    return Request(req_id, prompt, SamplingParams(**params), eos_token_ids=frozenset({EOS}))


def add(sched: Scheduler, *reqs: Request) -> None:
    for req in reqs:
        sched.add_request(req)


def fake_tokens(out: SchedulerOutput, script: dict[str, list[int]]) -> StepResult:
    """One entry per sampling request: its scripted tokens, else token_at(next position)."""
    return StepResult([script.get(s.req_id, [token_at(s.start_pos + len(s.token_ids))])
                       for s in out.scheduled if s.sample])


def step(sched: Scheduler, script: dict[str, list[int]] | None = None,
         num_draft_tokens: dict[str, int] | None = None) -> SchedulerOutput:
    out = sched.schedule(num_draft_tokens)
    check_plan(sched, out)
    sched.update(out, fake_tokens(out, script or {}))
    check_kv(sched)
    return out


def summary(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    """(req_id, known tokens fed, start_pos, sample) per scheduled request, in order."""
    return [(s.req_id, len(s.token_ids), s.start_pos, s.sample) for s in out.scheduled]


def check_plan(sched: Scheduler, out: SchedulerOutput) -> None:
    """Budget, sequence limit and the consistency of every planned entry."""
    assert out.num_scheduled_tokens <= sched.max_num_batched_tokens
    assert len(out.scheduled) <= sched.max_num_seqs
    ids = [s.req_id for s in out.scheduled]
    assert len(set(ids)) == len(ids)
    assert set(ids).isdisjoint(out.preempted_req_ids)
    for s in out.scheduled:
        req = sched.requests[s.req_id]
        assert req.status is RequestStatus.RUNNING
        assert s.start_pos == req.num_computed_tokens
        assert s.token_ids and s.token_ids == req.all_token_ids[s.start_pos:s.start_pos + len(s.token_ids)]
        assert s.sample == (s.start_pos + len(s.token_ids) == req.num_tokens)
        assert s.block_table == sched.kv.block_table(s.req_id)
        assert len(s.block_table) == sched.kv.num_blocks_for(s.start_pos + s.num_tokens)
    # Preempted requests sit at the front of the queue, oldest first, with nothing cached.
    assert list(sched.waiting)[:len(out.preempted_req_ids)] == \
        [sched.requests[r] for r in reversed(out.preempted_req_ids)]
    for req_id in out.preempted_req_ids:
        req = sched.requests[req_id]
        assert req.status is RequestStatus.WAITING and req.num_computed_tokens == 0
        assert not sched.kv.holds(req_id)


def check_kv(sched: Scheduler) -> None:
    """After update: running tables cover exactly the computed tokens; no block is shared
    or lost; waiting requests hold nothing."""
    kv = sched.kv
    used = [b for req in sched.running for b in kv.block_table(req.req_id)]
    free = kv.pool.free_block_ids()
    assert len(set(used)) == len(used)
    assert sorted(used + free) == list(range(kv.num_blocks))
    for req in sched.running:
        assert len(kv.block_table(req.req_id)) == kv.num_blocks_for(req.num_computed_tokens)
    for req in sched.waiting:
        assert not kv.holds(req.req_id) and req.num_computed_tokens == 0


def run_to_completion(sched: Scheduler, max_steps: int = 500) -> int:
    steps = 0
    while sched.has_unfinished_requests():
        step(sched)
        steps += 1
        assert steps <= max_steps, "scheduler made no progress"
    assert_all_blocks_free(sched)
    return steps


def assert_all_blocks_free(sched: Scheduler) -> None:
    assert not sched.running and not sched.waiting and not sched.requests
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert sorted(sched.kv.pool.free_block_ids()) == list(range(sched.kv.num_blocks))


def generated(first_position: int, count: int) -> list[int]:
    return [token_at(p) for p in range(first_position, first_position + count)]


# ---------------------------------------------------------------------------- budget / chunking
def test_prompt_within_budget_is_one_chunk_that_samples():
    sched = make_scheduler(budget=8)
    req = make_request("a", 8, max_tokens=2)
    add(sched, req)
    out = step(sched)
    assert summary(out) == [("a", 8, 0, True)]
    assert out.num_scheduled_tokens == 8
    assert out.scheduled[0].num_lookahead == 0
    assert req.num_computed_tokens == 8 and req.output_token_ids == [token_at(8)]
    assert summary(step(sched)) == [("a", 1, 8, True)]
    assert req.finish_reason is FinishReason.LENGTH
    assert_all_blocks_free(sched)


def test_prompt_one_over_budget_takes_two_chunks():
    sched = make_scheduler(budget=8)
    req = make_request("a", 9, max_tokens=1)
    add(sched, req)
    assert summary(step(sched)) == [("a", 8, 0, False)]
    assert req.num_computed_tokens == 8 and req.output_token_ids == []
    assert summary(step(sched)) == [("a", 1, 8, True)]
    assert req.output_token_ids == [token_at(9)]
    assert_all_blocks_free(sched)


def test_long_prompt_is_chunked_while_a_running_request_decodes_every_step():
    sched = make_scheduler(budget=8, block_size=4, num_blocks=16)
    a = make_request("a", 3, max_tokens=6)
    add(sched, a)
    assert summary(step(sched)) == [("a", 3, 0, True)]
    b = make_request("b", 20, max_tokens=2)
    add(sched, b)

    plans = [step(sched) for _ in range(4)]
    # The decoding request comes first and gets its token every step; the prompt fills the rest.
    assert [summary(out) for out in plans] == [
        [("a", 1, 3, True), ("b", 7, 0, False)],
        [("a", 1, 4, True), ("b", 7, 7, False)],
        [("a", 1, 5, True), ("b", 6, 14, True)],
        [("a", 1, 6, True), ("b", 1, 20, True)],
    ]
    assert [out.num_scheduled_tokens for out in plans] == [8, 8, 7, 2]
    # Each chunk is given blocks for itself only, from the front of the free queue.
    assert [[s.block_table for s in out.scheduled] for out in plans] == [
        [[0], [1, 2]],
        [[0, 3], [1, 2, 4, 5]],
        [[0, 3], [1, 2, 4, 5, 6]],
        [[0, 3], [1, 2, 4, 5, 6, 7]],
    ]
    assert b.finish_reason is FinishReason.LENGTH
    assert b.output_token_ids == generated(20, 2)
    assert a.output_token_ids == generated(3, 5)
    run_to_completion(sched)
    assert a.output_token_ids == generated(3, 6)


def test_waiting_prompts_share_what_is_left_of_the_budget():
    sched = make_scheduler(budget=8)
    a, b, c = make_request("a", 5, max_tokens=1), make_request("b", 5, max_tokens=1), \
        make_request("c", 5, max_tokens=1)
    add(sched, a, b, c)
    assert summary(step(sched)) == [("a", 5, 0, True), ("b", 3, 0, False)]
    # b continues its prefill; c is admitted with what remains.
    assert summary(step(sched)) == [("b", 2, 3, True), ("c", 5, 0, True)]
    assert_all_blocks_free(sched)


def test_at_most_max_num_seqs_requests_run():
    sched = make_scheduler(budget=64, max_num_seqs=2)
    reqs = [make_request(f"r{i}", 4, max_tokens=2) for i in range(3)]
    add(sched, *reqs)
    assert [s.req_id for s in step(sched).scheduled] == ["r0", "r1"]
    assert sched.num_waiting == 1
    assert [s.req_id for s in step(sched).scheduled] == ["r0", "r1"]   # both finish here
    assert summary(step(sched)) == [("r2", 4, 0, True)]
    run_to_completion(sched)
    assert all(len(r.output_token_ids) == 2 for r in reqs)


# ---------------------------------------------------------------------------- KV admission
def test_waiting_request_is_admitted_only_when_its_blocks_are_free():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=32)
    a = make_request("a", 12, max_tokens=1)       # 3 blocks
    b = make_request("b", 8, max_tokens=1)        # 2 blocks, only 1 left
    add(sched, a, b)
    out = sched.schedule()
    assert summary(out) == [("a", 12, 0, True)]
    assert out.scheduled[0].block_table == [0, 1, 2]
    assert b.status is RequestStatus.WAITING and not sched.kv.holds("b")
    assert sched.kv.num_free_blocks == 1
    sched.update(out, fake_tokens(out, {}))        # a finishes, its blocks go to the back
    assert sched.kv.pool.free_block_ids() == [3, 0, 1, 2]
    out = step(sched)
    assert summary(out) == [("b", 8, 0, True)]
    assert out.scheduled[0].block_table == [3, 0]
    assert_all_blocks_free(sched)


# ---------------------------------------------------------------------------- preemption
def test_newest_running_request_is_preempted_and_later_recomputed():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=32)
    a = make_request("a", 7, max_tokens=3)
    b = make_request("b", 7, max_tokens=5)
    c = make_request("c", 5, max_tokens=1)
    add(sched, a, b)
    step(sched)                                    # a: [0, 1], b: [2, 3]; pool empty
    add(sched, c)
    assert summary(step(sched)) == [("a", 1, 7, True), ("b", 1, 7, True)]
    assert c.status is RequestStatus.WAITING       # no blocks for it

    # a needs a third block: b, the newest, is preempted and its blocks freed.
    out = step(sched)
    assert out.preempted_req_ids == ["b"]
    assert summary(out) == [("a", 1, 8, True)]
    assert out.scheduled[0].block_table == [0, 1, 2]
    assert list(sched.waiting) == [b, c]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and sched.num_preemptions == 1
    assert not sched.kv.holds("b")
    assert b.output_token_ids == generated(7, 2)   # what it generated is kept
    assert a.finish_reason is FinishReason.LENGTH  # a ended in that step
    assert sched.kv.pool.free_block_ids() == [3, 0, 1, 2]

    # b resumes: prompt + generated tokens are recomputed as one prefill that samples.
    out = step(sched)
    assert out.preempted_req_ids == []
    assert summary(out) == [("b", 9, 0, True)]
    assert out.scheduled[0].token_ids == b.prompt_token_ids + generated(7, 2)
    assert out.scheduled[0].block_table == [3, 0, 1]
    assert c.status is RequestStatus.WAITING

    run_to_completion(sched)
    assert b.finish_reason is FinishReason.LENGTH
    assert b.output_token_ids == generated(7, 5)
    assert c.output_token_ids == generated(5, 1)
    assert a.output_token_ids == generated(7, 3)


def test_request_needing_a_block_preempts_itself_when_it_is_the_newest():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=32)
    a = make_request("a", 7, max_tokens=3)        # 8 slots still fit in 2 blocks
    b = make_request("b", 8, max_tokens=3)        # 9 slots need a third block
    add(sched, a, b)
    step(sched)
    out = step(sched)
    assert out.preempted_req_ids == ["b"]
    assert summary(out) == [("a", 1, 7, True)]
    assert list(sched.waiting) == [b] and sched.running == [a]
    assert sched.kv.pool.free_block_ids() == [2, 3]
    run_to_completion(sched)
    assert a.output_token_ids == generated(7, 3)
    assert b.output_token_ids == generated(8, 3)
    assert b.num_preemptions == 1


# ---------------------------------------------------------------------------- finishing
def test_eos_stops_with_reason_stop_and_frees_blocks():
    sched = make_scheduler()
    req = make_request("a", 4, max_tokens=10)
    add(sched, req)
    step(sched)
    assert sched.kv.holds("a")
    step(sched, {"a": [EOS]})
    assert req.finish_reason is FinishReason.STOP and req.is_finished
    assert req.output_token_ids == [token_at(4), EOS]
    assert_all_blocks_free(sched)


def test_stop_token_id_stops_only_the_request_that_asked_for_it():
    sched = make_scheduler()
    a = make_request("a", 4, max_tokens=10, stop_token_ids=[77])
    b = make_request("b", 4, max_tokens=3)
    add(sched, a, b)
    step(sched, {"a": [77], "b": [77]})
    assert a.finish_reason is FinishReason.STOP and a.output_token_ids == [77]
    assert b.status is RequestStatus.RUNNING
    run_to_completion(sched)
    assert b.finish_reason is FinishReason.LENGTH
    assert b.output_token_ids == [77, token_at(5), token_at(6)]


def test_ignore_eos_keeps_generating_past_eos():
    sched = make_scheduler()
    req = make_request("a", 4, max_tokens=3, ignore_eos=True)
    add(sched, req)
    step(sched, {"a": [EOS]})
    step(sched, {"a": [EOS]})
    assert req.status is RequestStatus.RUNNING
    step(sched)
    assert req.finish_reason is FinishReason.LENGTH
    assert req.output_token_ids == [EOS, EOS, token_at(6)]
    assert_all_blocks_free(sched)


@pytest.mark.parametrize("max_tokens", [1, 2, 5])
def test_max_tokens_ends_with_reason_length(max_tokens):
    sched = make_scheduler()
    req = make_request("a", 4, max_tokens=max_tokens)
    add(sched, req)
    assert run_to_completion(sched) == max_tokens
    assert req.finish_reason is FinishReason.LENGTH
    assert req.output_token_ids == generated(4, max_tokens)


def test_max_model_len_ends_with_reason_length():
    sched = make_scheduler(max_model_len=10)
    req = make_request("a", 6, max_tokens=None)
    add(sched, req)
    run_to_completion(sched)
    assert req.finish_reason is FinishReason.LENGTH
    assert req.num_tokens == 10 and req.output_token_ids == generated(6, 4)


def test_abort_from_waiting():
    sched = make_scheduler(max_num_seqs=1)
    a, b = make_request("a", 4, max_tokens=2), make_request("b", 4, max_tokens=2)
    add(sched, a, b)
    step(sched)
    assert b.status is RequestStatus.WAITING
    assert sched.finish_request("b", FinishReason.ABORT) is b
    assert b.finish_reason is FinishReason.ABORT and b.is_finished
    assert list(sched.waiting) == [] and "b" not in sched.requests
    assert sched.finish_request("b", FinishReason.ABORT) is None
    run_to_completion(sched)
    assert b.output_token_ids == [] and a.output_token_ids == generated(4, 2)


def test_abort_from_running_frees_its_blocks():
    sched = make_scheduler(num_blocks=8, block_size=4)
    req = make_request("a", 10, max_tokens=5)
    add(sched, req)
    step(sched)
    assert sched.kv.num_free_blocks == 5
    assert sched.finish_request("a", FinishReason.ABORT) is req
    assert req.finish_reason is FinishReason.ABORT
    assert sched.running == [] and not sched.has_unfinished_requests()
    assert sched.kv.pool.free_block_ids() == [3, 4, 5, 6, 7, 0, 1, 2]
    # A second finish, of any reason, is harmless and changes nothing.
    assert sched.finish_request("a", FinishReason.STOP) is None
    assert req.finish_reason is FinishReason.ABORT
    assert_all_blocks_free(sched)


def test_abort_while_the_step_runs_drops_only_that_requests_tokens():
    sched = make_scheduler()
    a, b = make_request("a", 4, max_tokens=5), make_request("b", 4, max_tokens=5)
    add(sched, a, b)
    step(sched)
    out = sched.schedule()
    sched.finish_request("a", FinishReason.ABORT)
    updates = sched.update(out, StepResult([[555], [666]]))
    assert [(u.req.req_id, u.new_token_ids) for u in updates] == [("b", [666])]
    assert a.output_token_ids == [token_at(4)]
    assert b.output_token_ids == [token_at(4), 666]
    sched.finish_request("b", FinishReason.ABORT)
    assert_all_blocks_free(sched)


# ---------------------------------------------------------------------------- speculation
def prefilled(prompt_len: int = 6, **params) -> tuple[Scheduler, Request]:
    """A scheduler (block_size 4, 8 blocks) with one request past its prefill."""
    sched = make_scheduler(num_blocks=8, block_size=4, budget=16)
    req = make_request("a", prompt_len, **params)
    add(sched, req)
    step(sched)
    return sched, req


def test_draft_slots_count_in_the_budget_and_reserve_kv():
    sched, req = prefilled(6, max_tokens=10)
    assert sched.kv.block_table("a") == [0, 1]
    out = sched.schedule({"a": 3})
    check_plan(sched, out)
    [planned] = out.scheduled
    assert planned.token_ids == [token_at(6)] and planned.start_pos == 6
    assert planned.num_lookahead == 3 and planned.draft_token_ids == []
    assert planned.num_tokens == 4 and out.num_scheduled_tokens == 4
    assert planned.block_table == [0, 1, 2]        # slots 6..9 for the token and 3 drafts
    sched.finish_request("a", FinishReason.ABORT)
    assert_all_blocks_free(sched)


@pytest.mark.parametrize("num_accepted, blocks_left, free_queue", [
    (0, [0, 1], [3, 4, 5, 6, 7, 2]),
    (1, [0, 1], [3, 4, 5, 6, 7, 2]),
    (2, [0, 1, 2], [3, 4, 5, 6, 7]),
    (3, [0, 1, 2], [3, 4, 5, 6, 7]),
])
def test_rejected_drafts_are_rolled_back(num_accepted, blocks_left, free_queue):
    sched, req = prefilled(6, max_tokens=10)
    out = sched.schedule({"a": 3})
    accepted = generated(7, num_accepted)
    bonus = 900 + num_accepted
    updates = sched.update(out, StepResult([accepted + [bonus]]))
    assert [(u.req.req_id, u.new_token_ids) for u in updates] == [("a", accepted + [bonus])]
    assert req.num_computed_tokens == 7 + num_accepted
    assert req.num_tokens == 8 + num_accepted
    assert sched.kv.block_table("a") == blocks_left
    assert sched.kv.pool.free_block_ids() == free_queue
    check_kv(sched)
    # Next step feeds the bonus token at the first position not yet cached.
    assert summary(step(sched)) == [("a", 1, 7 + num_accepted, True)]
    sched.finish_request("a", FinishReason.ABORT)
    assert_all_blocks_free(sched)


def test_drafts_count_in_the_budget_ahead_of_prefill_chunks():
    sched = make_scheduler(num_blocks=16, block_size=4, budget=8)
    a = make_request("a", 3, max_tokens=50)   # budget, not max_tokens, caps k
    add(sched, a)
    step(sched)
    b = make_request("b", 10, max_tokens=1)
    add(sched, b)
    out = sched.schedule({"a": 3, "b": 5})
    check_plan(sched, out)
    assert summary(out) == [("a", 1, 3, True), ("b", 4, 0, False)]
    assert [s.num_lookahead for s in out.scheduled] == [3, 0]   # no drafts for prefill
    assert [s.block_table for s in out.scheduled] == [[0, 1], [2]]
    assert out.num_scheduled_tokens == 8
    sched.update(out, StepResult([[token_at(4), 901]]))
    # A verify is served before prefill chunks: k is cut to what the budget leaves (7),
    # and b's remaining prefill waits for the next step.
    out = sched.schedule({"a": 20})
    check_plan(sched, out)
    assert summary(out) == [("a", 1, 5, True)]
    assert [s.num_lookahead for s in out.scheduled] == [7]
    assert out.num_scheduled_tokens == 8
    assert sched.kv.block_table("a") == [0, 1, 3, 4]  # slots 0..12; b holds block 2
    sched.finish_request("a", FinishReason.ABORT)
    sched.finish_request("b", FinishReason.ABORT)
    assert_all_blocks_free(sched)


def test_stop_token_among_accepted_drafts_ends_the_request_there():
    sched, req = prefilled(6, max_tokens=10)
    out = sched.schedule({"a": 3})
    sched.update(out, StepResult([[token_at(7), EOS, token_at(9), 900]]))
    assert req.finish_reason is FinishReason.STOP
    assert req.output_token_ids == [token_at(6), token_at(7), EOS]
    assert_all_blocks_free(sched)


def test_max_tokens_reached_at_the_bonus_token_after_all_drafts_accepted():
    sched, req = prefilled(6, max_tokens=5)
    out = sched.schedule({"a": 3})
    assert out.scheduled[0].num_lookahead == 3
    sched.update(out, StepResult([generated(7, 3) + [900]]))
    assert req.finish_reason is FinishReason.LENGTH
    assert req.output_token_ids == generated(6, 4) + [900]
    assert_all_blocks_free(sched)


def test_drafts_never_reach_past_max_model_len():
    """Draft positions past max_model_len could never be kept; no KV is reserved for them."""
    sched = make_scheduler(num_blocks=8, block_size=4, budget=16, max_model_len=10)
    req = make_request("a", 8, max_tokens=None)
    add(sched, req)
    step(sched)                                    # 9 tokens, 8 computed
    out = sched.schedule({"a": 3})
    [planned] = out.scheduled
    assert planned.start_pos + planned.num_tokens <= sched.max_model_len
    assert len(planned.block_table) <= sched.kv.num_blocks_for(sched.max_model_len)
    sched.update(out, fake_tokens(out, {}))
    assert req.finish_reason is FinishReason.LENGTH and req.num_tokens == 10
    assert_all_blocks_free(sched)


# ---------------------------------------------------------------------------- randomized
@pytest.mark.parametrize("seed", range(8))
def test_random_workload_keeps_budget_and_ends_every_request_once(seed):
    rng = random.Random(seed)
    max_k = 4
    block_size = rng.choice([1, 2, 4, 8])
    max_model_len = rng.choice([40, 64])
    # The pool holds at least one request of the largest size (so progress is possible) and
    # is otherwise small enough to force preemptions.
    min_blocks = -(-(max_model_len + max_k) // block_size)
    sched = make_scheduler(num_blocks=min_blocks + rng.randint(0, min_blocks), block_size=block_size,
                           budget=rng.randint(4, 32), max_num_seqs=rng.randint(1, 6),
                           max_model_len=max_model_len)
    all_reqs: list[Request] = []
    aborted: set[str] = set()
    finished_seen: dict[str, FinishReason] = {}

    def abort(req_id: str) -> None:
        if sched.finish_request(req_id, FinishReason.ABORT) is not None:
            aborted.add(req_id)

    for step_no in range(3000):
        if step_no < 60 and rng.random() < 0.5:
            req = make_request(f"r{len(all_reqs)}", rng.randint(1, max_model_len - 1),
                               max_tokens=rng.randint(1, 12), stop_token_ids=[77],
                               ignore_eos=rng.random() < 0.2)
            all_reqs.append(req)
            sched.add_request(req)
        if step_no >= 60 and not sched.has_unfinished_requests():
            break
        if sched.requests and rng.random() < 0.03:
            abort(rng.choice(sorted(sched.requests)))

        drafts = {r.req_id: rng.randint(0, max_k) for r in sched.running
                  if r.num_tokens - r.num_computed_tokens == 1}
        out = sched.schedule(drafts)
        check_plan(sched, out)
        for s in out.scheduled:
            assert s.num_lookahead <= drafts.get(s.req_id, 0)
        if out.scheduled and rng.random() < 0.03:
            abort(rng.choice(out.scheduled).req_id)    # cancelled while the step runs
        result = []
        for s in out.scheduled:
            if not s.sample:
                continue
            num_accepted = rng.randint(0, s.num_lookahead)
            first = s.start_pos + len(s.token_ids)
            result.append([rng.choice([EOS, 77]) if rng.random() < 0.03 else token_at(p)
                           for p in range(first, first + num_accepted + 1)])
        sched.update(out, StepResult(result))
        check_kv(sched)
        for req in all_reqs:
            if req.is_finished and req.req_id not in finished_seen:
                finished_seen[req.req_id] = req.finish_reason
    assert not sched.has_unfinished_requests(), "workload did not drain"

    assert_all_blocks_free(sched)
    assert len(finished_seen) == len(all_reqs)
    for req in all_reqs:
        # Ended exactly once, for a reason its tokens explain.
        assert req.finish_reason is finished_seen[req.req_id]
        out_ids = req.output_token_ids
        if req.finish_reason is FinishReason.ABORT:
            assert req.req_id in aborted
        elif req.finish_reason is FinishReason.STOP:
            assert out_ids[-1] in req.stop_token_ids
            assert not set(out_ids[:-1]) & req.stop_token_ids
        else:
            assert req.finish_reason is FinishReason.LENGTH
            assert len(out_ids) == req.params.max_tokens or req.num_tokens == max_model_len
            assert len(out_ids) <= req.params.max_tokens and req.num_tokens <= max_model_len
            assert not set(out_ids) & req.stop_token_ids


def test_running_changes_log_joins_and_leaves_in_order(monkeypatch):
    """A reader of ``running_changes`` gets, after its version, every request that joined
    or left ``running`` in order (admission, abort, finish); None at its first call (the
    log starts then) and once it fell further behind than the log keeps."""
    monkeypatch.setattr("specserve.scheduler.RUNNING_LOG_MAX", 4)
    sched = make_scheduler(max_num_seqs=2)
    a, b, c = (make_request(name, 3, max_tokens=2, ignore_eos=True) for name in "abc")
    add(sched, a, b, c)
    assert sched.running_changes(sched.running_version) is None  # the first look
    seen = sched.running_version
    step(sched)  # a and b join
    assert sched.running_changes(seen) == [(a, True), (b, True)]
    seen = sched.running_version
    sched.finish_request("a", FinishReason.ABORT)
    assert sched.running_changes(seen) == [(a, False)]
    assert sched.running_changes(sched.running_version) == []
    seen = sched.running_version
    run_to_completion(sched)  # c joins (a's seat), b finishes, c finishes: within the log
    assert sched.running_changes(seen) == [(c, True), (b, False), (c, False)]
    d, e, f = (make_request(name, 3, max_tokens=1, ignore_eos=True) for name in "def")
    add(sched, d, e, f)
    run_to_completion(sched)  # 6 changes: past a log of 4
    assert sched.running_changes(seen) is None


def test_the_prefill_estimate_follows_the_admission_rule():
    """What the next step will run besides its decoding rows, by schedule's own rule: the
    running requests' prefill first, then waiting requests in order while the budget left
    after one token per running request and the free sequence slots allow."""
    sched = make_scheduler(budget=32, max_num_seqs=4)
    add(sched, make_request("a", 3), make_request("b", 3))
    step(sched)  # both prefilled: 2 running, decoding
    add(sched, make_request("c", 10), make_request("d", 25), make_request("e", 5))
    # room = 32 - 2 running = 30: c (10) fits, d (25) is admitted with what is left; 2 seats.
    assert sched.prefill_estimate(0) == (30, 2)
    assert sched.prefill_estimate(4) == (30, 2)  # 4 + 10 < 30: d still admitted, cut to the room
    assert sched.prefill_estimate(30) == (30, 0)  # the running prefill fills the room
    out = sched.schedule()
    assert [s.req_id for s in out.scheduled] == ["a", "b", "c", "d"]  # what schedule then admits
    assert out.num_scheduled_tokens == 2 + 30
    sched.update(out, fake_tokens(out, {}))
    assert sched.prefill_estimate(0) == (0, 0)  # no seat left for e


def test_the_prefill_estimate_leaves_out_a_cached_prefix_and_waiting_choices():
    """With prefix caching a waiting request computes only what the cache lacks, and a
    request waiting for another's prompt (n > 1) stops admission, as in schedule."""
    sched = Scheduler(KVCacheManager(64, 4, enable_prefix_caching=True), max_num_batched_tokens=64,
                      max_num_seqs=8, max_model_len=1024)
    add(sched, make_request("a", 21))
    step(sched)  # a's prompt computed: its 5 whole blocks cached
    b = make_request("b", 21)
    b.all_token_ids += [7, 8, 9]  # a's prompt and 3 more tokens: 20 of its 24 cached
    add(sched, b)
    assert sched.prefill_estimate(0) == (4, 1)
    other = [300 + i for i in range(10)]  # a prompt nobody has computed
    d = Request("d", other, SamplingParams(), eos_token_ids=frozenset({EOS}))
    c = Request("c", other, SamplingParams(), eos_token_ids=frozenset({EOS}), prompt_from="d")
    sched.waiting.appendleft(d)
    sched.requests["d"] = d
    add(sched, c)
    assert sched.prefill_estimate(0) == (10 + 4, 2)  # d and b; c waits for d
    out = sched.schedule()
    assert [s.req_id for s in out.scheduled] == ["a", "d", "b"]
    assert [len(s.token_ids) for s in out.scheduled] == [1, 10, 4]
