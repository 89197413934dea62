"""Prefix caching: content-addressed blocks shared by reference count, their rules under
speculation (rollback, drafts, draft caches, draft paths), a randomized storm of the KV
manager and scheduler against a simulated cache, and greedy equality with caching on and
off for every drafter."""
from __future__ import annotations

import random

import pytest
from tiny_models import LLM32, make_eagle_head, save_perturbed

from specserve import SamplingParams
from specserve.errors import KVCacheError
from specserve.kv_cache import ROOT_HASH, KVCacheManager, block_hash
from specserve.request import FinishReason, Request
from specserve.scheduler import Scheduler, StepResult
from specserve.spec.paths import DraftPaths, PathEntry


def cached_kv(num_blocks: int = 16, block_size: int = 4, **kwargs) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size, enable_prefix_caching=True, **kwargs)


def run_request(kv: KVCacheManager, req_id: str, tokens: list[int], computed: int | None = None):
    """Admit ``tokens`` as a new request the way the scheduler does, commit ``computed``
    of them (all but the last by default); returns the hit."""
    hit = kv.find_prefix(req_id, tokens)
    assert kv.allocate_slots(req_id, len(tokens), hit)
    kv.commit(req_id, tokens, len(tokens) - 1 if computed is None else computed)
    return hit


# ---------------------------------------------------------------------------- hashing
def test_a_block_hash_chains_its_parent_and_its_tokens():
    first = block_hash(ROOT_HASH, [1, 2, 3, 4])
    assert first == block_hash(ROOT_HASH, (1, 2, 3, 4)) and len(first) == 16
    assert block_hash(first, [5, 6, 7, 8]) != block_hash(ROOT_HASH, [5, 6, 7, 8])
    assert block_hash(ROOT_HASH, [1, 2, 3, 4], b"lora-a") != first
    assert block_hash(ROOT_HASH, [1, 2, 3, 5]) != first


# ---------------------------------------------------------------------------- KV manager
def test_a_later_request_reuses_the_committed_blocks_of_its_prefix():
    kv = cached_kv()
    run_request(kv, "a", list(range(1, 11)))              # 10 tokens: blocks 0, 1 full, 2 partial
    assert kv.num_cached_blocks == 2
    hit = kv.find_prefix("b", list(range(1, 9)) + [99, 98, 97])
    assert hit.block_ids == kv.block_table("a")[:2]
    assert kv.allocate_slots("b", 11, hit)
    assert kv.block_table("b")[:2] == kv.block_table("a")[:2]
    assert kv.pool.ref_counts[kv.block_table("a")[0]] == 2
    # A prefix that differs inside the second block shares only the first.
    assert len(kv.find_prefix("c", [1, 2, 3, 4, 5, 6, 0, 8, 9]).block_ids) == 1
    kv.check_invariants()


def test_the_last_token_is_always_recomputed():
    """A prompt that ends exactly on a block boundary leaves its last block to compute: the
    last token's logits are needed."""
    kv = cached_kv()
    run_request(kv, "a", list(range(1, 14)), computed=12)  # blocks 0..2 committed
    assert len(kv.find_prefix("b", list(range(1, 13))).block_ids) == 2       # 12 tokens: 2 of 3
    assert len(kv.find_prefix("c", list(range(1, 14))).block_ids) == 3       # 13 tokens: all 3
    assert len(kv.find_prefix("d", list(range(1, 5))).block_ids) == 0        # 4 tokens: none


def test_freed_cached_blocks_wait_evictable_and_are_evicted_last_and_tail_first():
    kv = cached_kv(num_blocks=8)
    run_request(kv, "a", list(range(1, 14)), computed=12)  # 4 blocks, 3 of them cached
    cached = kv.block_table("a")[:3]
    kv.free("a")
    assert kv.num_free_blocks == 8 and kv.pool.evictable_block_ids() == cached[::-1]
    # Plain free blocks go first, then the prefix from its tail.
    assert kv.allocate_slots("x", 4 * 5)
    assert kv.num_cached_blocks == 3
    assert kv.allocate_slots("y", 4)
    assert kv.num_cached_blocks == 2 and kv.pool.evictable_block_ids() == cached[1::-1]
    hit = kv.find_prefix("b", list(range(1, 14)))
    assert hit.block_ids == cached[:2]
    kv.check_invariants()


def test_taking_a_hit_on_evictable_blocks_counts_them_against_the_free_ones():
    kv = cached_kv(num_blocks=6)
    run_request(kv, "a", list(range(1, 10)), computed=8)  # 3 blocks, 2 cached
    kv.free("a")
    assert kv.allocate_slots("x", 4 * 3)                  # 3 of the 6 are left, 2 of them cached
    hit = kv.find_prefix("b", list(range(1, 10)) + [50] * 6)
    assert len(hit.block_ids) == 2
    # 15 tokens: the 2 cached blocks + 2 new ones, but only 1 block is free besides them.
    assert not kv.allocate_slots("b", 15, hit)
    assert not kv.holds("b") and kv.num_free_blocks == 3
    assert kv.allocate_slots("b", 12, hit)                # 2 cached + 1 new: exactly what is free
    assert kv.num_free_blocks == 0
    kv.check_invariants()


def test_rollback_never_reaches_a_shared_or_committed_block():
    kv = cached_kv()
    run_request(kv, "a", list(range(1, 10)), computed=8)  # blocks 0, 1 committed; 2 its own
    tail = kv.block_table("a")[2]
    with pytest.raises(KVCacheError, match="shared or committed"):
        kv.truncate("a", 4)
    assert kv.truncate("a", 8) == [tail]
    kv.check_invariants()


def test_a_stop_token_among_accepted_drafts_commits_only_the_request_tokens():
    kv = cached_kv()
    hit = kv.find_prefix("a", [1, 2, 3])
    kv.allocate_slots("a", 3 + 6, hit)
    # Positions up to 9 were computed (drafts accepted), but the request stopped at 7 tokens.
    kv.commit("a", [1, 2, 3, 4, 5, 6, 7], 9)
    assert kv.num_cached_blocks == 1
    kv.check_invariants()


def test_the_draft_cache_rules_of_a_hit():
    tokens = list(range(1, 18))  # 4 full blocks + 1 token
    for rule, want in ((None, (4, 0)), ("tokens", (4, 2)), ("features", (2, 2))):
        kv = cached_kv(draft_cache=rule)
        run_request(kv, "a", tokens, computed=16)
        kv.mark_draft_valid("a", 10)                      # the draft holds blocks 0 and 1
        hit = kv.find_prefix("b", tokens)
        assert (len(hit.block_ids), hit.num_draft_valid) == want, rule
    # An EAGLE head valid everywhere still stops a block short: the head's entry at a
    # block's last position pairs it with the next block's first token.
    kv = cached_kv(draft_cache="features")
    run_request(kv, "a", tokens, computed=16)
    kv.mark_draft_valid("a", 16)
    hit = kv.find_prefix("b", tokens)
    assert (len(hit.block_ids), hit.num_draft_valid) == (3, 3)


def test_a_reused_block_forgets_its_draft_entries():
    kv = cached_kv(num_blocks=4, draft_cache="tokens")
    run_request(kv, "a", list(range(1, 10)), computed=8)
    kv.mark_draft_valid("a", 8)
    kv.free("a")
    assert kv.allocate_slots("x", 16)                     # evicts everything
    assert not any(kv.pool.draft_valid) and kv.num_cached_blocks == 0


def test_draft_paths_share_blocks_by_reference_count():
    kv = cached_kv()
    run_request(kv, "a", list(range(1, 11)), computed=9)
    table = list(kv.block_table("a"))
    src, dst = kv.fork("a", 1, 8, 14)
    assert src == table[2] and kv.branch_block_table("a", 1)[:2] == table[:2]
    assert [kv.pool.ref_counts[b] for b in table[:2]] == [2, 2]
    kv.check_invariants()
    kv.merge("a", 1)
    assert kv.block_table("a")[:2] == table[:2] and kv.block_table("a")[2] == dst
    assert [kv.pool.ref_counts[b] for b in table[:2]] == [1, 1]
    kv.check_invariants()
    kv.free("a")
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_invariants()


def test_caching_off_hashes_nothing():
    kv = KVCacheManager(8, 4)
    run_request(kv, "a", list(range(1, 10)))
    assert kv.num_cached_blocks == 0 and not kv.find_prefix("b", list(range(1, 10))).block_ids


# ---------------------------------------------------------------------------- the storm
class SimulatedCaches:
    """What the runners would write: per block, the token each slot's target and draft
    entries were computed for (None: never written), so the storm can check that a shared
    block is never written, a rollback never loses a committed entry, and every hit is
    exactly what the request would have computed."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.target = [[None] * block_size for _ in range(num_blocks)]
        self.draft = [[None] * block_size for _ in range(num_blocks)]

    def write(self, cache, table: list[int], start: int, tokens: list[int], kv: KVCacheManager) -> None:
        for pos, token in enumerate(tokens, start):
            block = table[pos // self.bs]
            if kv.pool.hashes[block] is not None or kv.pool.ref_counts[block] > 1:
                # Only a draft catching up on what it lacks may touch a shared block, and
                # only with the token the block was computed for.
                assert cache is self.draft and self.target[block][pos % self.bs] == token, \
                    f"a shared or cached block {block} written at {pos}"
            cache[block][pos % self.bs] = token

    def copy(self, src: int, dst: int) -> None:
        self.target[dst] = list(self.target[src])
        self.draft[dst] = list(self.draft[src])

    def holds(self, cache, table: list[int], tokens: list[int]) -> bool:
        return all(cache[table[p // self.bs]][p % self.bs] == t for p, t in enumerate(tokens))


@pytest.mark.parametrize("seed", range(6))
def test_storm_of_admits_drafts_forks_preemptions_and_aborts(seed):
    rng = random.Random(seed)
    bs, num_blocks = 4, 30
    kv = KVCacheManager(num_blocks, bs, enable_prefix_caching=True, draft_cache="tokens")
    sched = Scheduler(kv, max_num_batched_tokens=24, max_num_seqs=6, max_model_len=96)
    paths = DraftPaths(kv, ((0, 1), (1, 1)))
    caches = SimulatedCaches(num_blocks, bs)
    draft_fed: dict[str, int] = {}
    stems = [[rng.randrange(1, 50) for _ in range(rng.randrange(3, 20))] for _ in range(4)]
    ids = iter(range(10**6))
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    hits = 0

    def continuation(tokens: list[int]) -> int:  # the "model": the next token depends on the prefix
        return (sum(tokens[-3:]) * 7 + len(tokens)) % 50 + 1

    for _ in range(200):
        if rng.random() < 0.5 and len(sched.requests) < 12:
            stem = rng.choice(stems)
            prompt = stem[:rng.randrange(1, len(stem) + 1)] + [rng.randrange(1, 50) for _ in range(rng.randrange(0, 6))]
            if rng.random() < 0.3:  # a resent conversation: a finished request's whole text
                prompt = stem + [continuation(stem)] * 3
            sched.add_request(Request(f"r{next(ids)}", prompt, greedy, frozenset()))
        if sched.requests and rng.random() < 0.1:
            sched.finish_request(rng.choice(list(sched.requests)), FinishReason.ABORT)
        drafts = {r.req_id: rng.randrange(0, 4) for r in sched.running}
        before = kv.num_hit_tokens
        out = sched.schedule(drafts)
        hits += kv.num_hit_tokens - before
        for planned in out.scheduled:  # a hit is exactly the request's tokens
            req = sched.requests[planned.req_id]
            assert caches.holds(caches.target, planned.block_table, req.all_token_ids[:planned.start_pos])
            if planned.draft_cache_valid is not None:
                assert caches.holds(caches.draft, planned.block_table, req.all_token_ids[:planned.draft_cache_valid])
                draft_fed[planned.req_id] = planned.draft_cache_valid
        # Further draft paths fork first (their first block copied in both caches), then
        # the draft catches up every entry, a path from where its request's own does, and
        # proposes (the right token or not).
        paths.add(out, sched.max_num_batched_tokens - out.num_scheduled_tokens)
        for src, dst in out.block_copies:
            caches.copy(src, dst)
        fed_before = {}
        for planned in out.scheduled:
            req = sched.requests[planned.req_id]
            end = planned.start_pos + len(planned.token_ids)
            fed = fed_before.setdefault(planned.req_id, min(draft_fed.get(planned.req_id, 0), planned.start_pos))
            caches.write(caches.draft, planned.block_table, fed, req.all_token_ids[fed:end], kv)
            draft_fed[planned.req_id] = end
            if not isinstance(planned, PathEntry):
                kv.mark_draft_valid(planned.req_id, end)
            planned.draft_token_ids = [continuation(req.all_token_ids) if rng.random() < 0.6 else 0
                                       for _ in range(planned.num_lookahead)]
        kv.check_invariants()
        new_tokens = []
        for planned in out.scheduled:  # the target's pass writes every fed token and draft
            req = sched.requests[planned.req_id]
            fed = planned.token_ids + planned.draft_token_ids
            caches.write(caches.target, planned.block_table, planned.start_pos, fed, kv)
            if planned.sample:
                tokens, sampled = list(req.all_token_ids), []
                for draft in planned.draft_token_ids:
                    if draft != continuation(tokens):
                        break
                    sampled.append(draft)
                    tokens.append(draft)
                new_tokens.append(sampled + [continuation(tokens)])
        scheduled, result = paths.keep_best(out, StepResult(new_tokens))[:2]
        sched.update(scheduled, result)
        kv.check_invariants()
        for req in sched.running:  # what a request computed is still its own
            table = kv.block_table(req.req_id)
            assert caches.holds(caches.target, table, req.all_token_ids[:req.num_computed_tokens])
        for block, key in enumerate(kv.pool.hashes):  # a cached block holds its hash's tokens
            if key is not None:
                assert caches.target[block] == list(kv.pool.contents[block][1])
                if kv.pool.draft_valid[block]:
                    assert caches.draft[block] == list(kv.pool.contents[block][1])
    for req_id in list(sched.requests):
        sched.finish_request(req_id, FinishReason.ABORT)
    kv.check_invariants()
    assert kv.num_free_blocks == num_blocks and all(count == 0 for count in kv.pool.ref_counts)
    assert sched.num_preemptions > 0 and hits > 0 and kv.pool.num_evictions > 0


# ---------------------------------------------------------------------------- the engine
SMALL = dict(block_size=4, num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=16)
STEM = [5, 17, 99, 230, 17, 99, 7, 8, 9, 7, 8, 9, 10, 11, 12, 13]  # 4 blocks of 4


def shared_prefix_rounds() -> list[list[list[int]]]:
    """Rounds of prompts sharing prefixes of several lengths with earlier ones (one ends
    exactly on a block boundary), sent one round after the other so later rounds find what
    earlier ones committed. ``None`` stands for the previous round's first prompt and
    answer: the next turn of a chat, resent whole."""
    first = [STEM + [40, 41, 40, 41, 40], [3, 4, 5, 6, 7, 8, 9, 3, 4, 5]]
    second = [None, STEM[:8], STEM[:6] + [77, 78, 77, 78], [3, 4, 5, 6, 7, 8, 9, 3, 4, 5, 6, 7, 8, 9]]
    third = [None, STEM[:12] + [1, 2], STEM[:8]]
    return [first, second, third]


def generate_rounds(llm, max_tokens: int = 23):  # the first chat turn ends on a block boundary
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    answers, previous = [], None
    for prompts in shared_prefix_rounds():
        prompts = [previous + [2, 3, 2] if p is None else p for p in prompts]
        outs = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        previous = prompts[0] + outs[0]
        answers.append(outs)
    return answers


@pytest.fixture(scope="module")
def drafts(tmp_path_factory, tiny_model_dir):
    """method -> extra engine options, for every drafter, on the tiny smollm2-like target."""
    target = tiny_model_dir("smollm2_tied_gqa3")
    near = save_perturbed(target, tmp_path_factory.mktemp("near"), 0.004)
    head_dir = make_eagle_head(target, [1], tmp_path_factory.mktemp("eagle"))[0]
    return target, {
        "off": {},
        "ngram": dict(speculative_method="ngram"),
        "draft_model": dict(speculative_method="draft_model", draft_model=str(near)),
        "eagle": dict(speculative_method="draft_model", draft_model=str(head_dir)),
        "layerskip": dict(speculative_method="layerskip", layerskip_layers=1),
    }


@pytest.mark.parametrize("method", ["off", "ngram", "draft_model", "eagle", "layerskip"])
def test_greedy_output_is_the_same_with_prefix_caching_on_and_off(method, drafts):
    target, options = drafts
    spec = dict(num_speculative_tokens=3, speculative_adaptive=False) if options[method] else {}
    on = LLM32(str(target), **SMALL, **spec, **options[method])
    off = LLM32(str(target), **SMALL, **spec, **options[method], enable_prefix_caching=False)
    found, unseen = [], []
    real = on.engine.kv.find_prefix
    on.engine.kv.find_prefix = lambda req_id, tokens, *root: found.append(real(req_id, tokens, *root)) or found[-1]
    if method == "eagle":  # the head must get the target's features for every entry it makes
        drafter = on.engine.speculator.drafter
        rows = drafter._feature_rows

        def feature_rows(req_id, lo, hi):
            first, kept = drafter._features.get(req_id, (0, None))
            if kept is None or not first <= lo <= hi <= first + kept.shape[0]:
                unseen.append((req_id, lo, hi))
            return rows(req_id, lo, hi)
        drafter._feature_rows = feature_rows
    assert generate_rounds(on) == generate_rounds(off)
    kv = on.engine.kv
    assert kv.num_hit_tokens > 0 and off.engine.kv.num_hit_tokens == 0
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_invariants()
    if method in ("draft_model", "eagle"):  # the draft's own cache was reused, not rebuilt
        assert any(hit.num_draft_valid for hit in found)
    assert not unseen, f"the EAGLE head drafted from features the target never computed: {unseen}"
    # How each drafter's own cache takes a hit (KVCacheManager): the draft model catches up
    # on what it lacks, an EAGLE head's hit stops where the target must recompute features.
    assert kv.draft_cache == {"draft_model": "tokens", "eagle": "features"}.get(method)
    if method != "off":  # drafts as good as without the cache: nothing collapsed
        with_cache, without = on.engine.spec_stats, off.engine.spec_stats
        assert with_cache.num_accepted_tokens / with_cache.num_draft_tokens >= \
            0.9 * without.num_accepted_tokens / without.num_draft_tokens


def test_outputs_report_their_cached_prompt_tokens(drafts):
    target, _ = drafts
    llm = LLM32(str(target), **SMALL)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = llm.generate([STEM + [1]], params, use_tqdm=False)[0]
    again = llm.generate([STEM + [1], STEM[:6] + [2, 3]], params, use_tqdm=False)
    assert first.num_cached_tokens == 0
    assert [o.num_cached_tokens for o in again] == [16, 4]
    assert again[0].token_ids == first.token_ids


def test_a_preempted_request_finds_its_committed_blocks_again(drafts):
    target, _ = drafts
    prompts = [STEM + [i, i + 1, i + 2] for i in range(1, 7)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tight = LLM32(str(target), **{**SMALL, "num_kv_blocks": 24})
    got = [o.token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.kv.num_hit_tokens > 0
    want = [o.token_ids for o in LLM32(str(target), **SMALL, enable_prefix_caching=False)
            .generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert tight.engine.num_free_blocks == tight.engine.kv.num_blocks


def test_a_request_aborted_while_waiting_leaves_nothing_behind(drafts):
    target, _ = drafts
    engine = LLM32(str(target), **SMALL).engine
    req_id = engine.add_request(STEM + [1], SamplingParams(max_tokens=2))
    engine.kv.find_prefix(req_id, STEM + [1])  # looked up, never admitted
    engine.abort(req_id)
    engine.step()
    assert not engine.kv._hashes and engine.kv.num_free_blocks == engine.kv.num_blocks


def test_choices_of_one_prompt_compute_it_once(drafts):
    """A request with ``prompt_from`` waits until that request has computed the prompt,
    then takes its whole blocks from the cache (n > 1 in the API)."""
    target, _ = drafts
    engine = LLM32(str(target), **SMALL).engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = STEM + [1, 2, 3, 4, 5]  # 21 tokens: a 16-token budget computes it in two steps
    engine.add_request(prompt, params, "a")
    engine.add_request(prompt, params, "b", prompt_from="a")
    engine.add_request(prompt, params, "c", prompt_from="a")
    outs, admitted = {}, []
    while engine.has_unfinished_requests():
        running = {r.req_id for r in engine.scheduler.running}
        for out in engine.step():
            if out.finished:
                outs[out.req_id] = out
        admitted.append({r.req_id for r in engine.scheduler.running} - running)
    assert admitted[0] == {"a"} and admitted[1] == set()  # b and c wait while a computes the prompt
    assert [outs[r].num_cached_tokens for r in "abc"] == [0, 20, 20]
    assert outs["a"].token_ids == outs["b"].token_ids == outs["c"].token_ids
    off = LLM32(str(target), **SMALL, enable_prefix_caching=False).engine  # nothing to wait for
    off.add_request(prompt[:6], params, "a")
    off.add_request(prompt[:6], params, "b", prompt_from="a")
    off.step()
    assert {r.req_id for r in off.scheduler.running} == {"a", "b"}


def test_a_waiting_choice_holds_back_nobody_else(drafts):
    """A choice waiting for its first's prompt is passed over: a request behind it in the
    queue is admitted as soon as the budget allows. (With an EAGLE head the choice waits a
    step after the first's prefill, for the head's entries.)"""
    target, options = drafts
    engine = LLM32(str(target), **SMALL, num_speculative_tokens=3, **options["eagle"]).engine
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompt = STEM + [1, 2, 3, 4, 5]  # 21 tokens: a's prefill takes two steps of 16
    engine.add_request(prompt, params, "a")
    engine.add_request(prompt, params, "b", prompt_from="a")
    engine.add_request([7, 8, 9], params, "r")
    joined, outs = [], {}
    while engine.has_unfinished_requests():
        before = {r.req_id for r in engine.scheduler.running}
        outs.update({o.req_id: o for o in engine.step() if o.finished})
        joined.append(sorted({r.req_id for r in engine.scheduler.running} - before))
    # r joins while b waits: for a's prefill, then for the head to catch up on it (the head
    # runs a step behind the target and marks its blocks while proposing, after admission).
    assert joined[:4] == [["a"], ["r"], [], ["b"]]
    assert outs["b"].num_cached_tokens == 16  # the head's rule: a block short of its entries


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_choices_share_the_prompt_with_a_draft_cache(method, drafts):
    """With a drafter's own cache the later choice waits until that cache holds the prompt's
    blocks too (an EAGLE head's a step after the target's), then takes them."""
    target, options = drafts
    engine = LLM32(str(target), **SMALL, num_speculative_tokens=3, **options[method]).engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = STEM + [1, 2, 3, 4, 5]
    engine.add_request(prompt, params, "a")
    engine.add_request(prompt, params, "b", prompt_from="a")
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.req_id: o for o in engine.step() if o.finished})
    assert outs["b"].num_cached_tokens >= 16 and outs["a"].token_ids == outs["b"].token_ids


def test_prompt_from_must_name_a_request_with_the_same_prompt(drafts):
    """A choice naming a request with another prompt is refused; one naming a request that
    has ended (the client's later choices can come after the first's end) waits for nothing."""
    target, _ = drafts
    engine = LLM32(str(target), **SMALL).engine
    params = SamplingParams(max_tokens=2)
    engine.add_request([1, 2, 3], params, "a")
    with pytest.raises(ValueError, match="prompt_from"):
        engine.add_request([1, 2], params, "z", prompt_from="a")
    assert list(engine.scheduler.requests) == ["a"]
    engine.add_request([1, 2, 3], params, "y", prompt_from="gone")
    assert engine.scheduler.requests["y"].prompt_from is None
