"""The draft-model drafter's device-resident loop: proposals stay on the device until the
rejection sampler's one copy, its catch-up and draft steps run through the CUDA-graph
padded path and its prefill through the ragged one (eagerly here, ``capture=False``),
and greedy output stays exactly that of speculation off."""
from __future__ import annotations

import pytest
import torch

from specserve import SamplingParams
from specserve.cuda_graphs import batch_buckets
from tiny_models import LLM32, make_eagle_head, save_perturbed

PROMPTS = ["a b c a b c a b c a b c", "def f(x): return x\ndef f(x):", "hello", "x = 1\ny = 2\nx = 1\n",
           "import os\nimport sys\nimport os\n"]
ENGINE = dict(block_size=4, num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=64)
# Per-request k: different lengths exercise the reordering of proposals, 0 a request
# whose draft cache only keeps up.
KS = (4, 2, 4, 0, 3)


@pytest.fixture(scope="module")
def near_draft(tmp_path_factory, tiny_model_dir):
    """The tiny target with slightly perturbed weights: it agrees often, not always."""
    return save_perturbed(tiny_model_dir("llama"), tmp_path_factory.mktemp("draft-near"), 0.004)


def draft_engine(tiny_model_dir, draft: str, graphs: bool, **kwargs):
    """``graphs``: the CUDA graphs' paths, run eagerly (on a GPU as well: no captures)."""
    llm = LLM32(str(tiny_model_dir("llama")), speculative_method="draft_model", draft_model=draft,
                num_speculative_tokens=4, enforce_eager=True, **ENGINE, **kwargs)
    if graphs:
        llm.engine.enable_graphs(capture=False)
    return llm


def greedy(k: int | None = None, max_tokens: int = 30) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, num_speculative_tokens=k)


@pytest.mark.parametrize("which", ["near", "target"])
def test_padded_graph_path_of_the_draft_model_equals_speculation_off(tiny_model_dir, near_draft, which):
    draft = near_draft if which == "near" else str(tiny_model_dir("llama"))
    plain = LLM32(str(tiny_model_dir("llama")), enforce_eager=True, **ENGINE)
    llm = draft_engine(tiny_model_dir, draft, graphs=True)
    graphs = llm.engine.speculator.drafter.runner.graphs
    calls = []
    run = graphs.run
    real = []  # requests each padded step really ran
    graphs.run = lambda *a: calls.append(graphs._shape(a[0].scheduled)) or real.append(len(a[0].scheduled)) \
        or run(*a)
    params = [greedy(k) for k in KS]
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0
    if which == "target":
        assert stats.acceptance_rate == 1.0
    padded = [(shape, n) for shape, n in zip(calls, real) if shape[0]]
    assert {q for (_, q), _ in padded} == {1, 2}  # draft steps, and catch-ups after full acceptance
    assert len(padded) < len(calls)  # the prompts' lockstep prefill: ragged graphs
    assert {b for (b, _), _ in padded} <= set(batch_buckets(8))
    assert any(n < b for (b, _), n in padded)  # padded up to a bucket (3 drafting past depth 2: 4)
    assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks


def test_padded_graph_path_of_the_draft_model_samples_as_eager(tiny_model_dir, near_draft):
    """Seeded sampling with drafts drawn from q: the graph path and the eager path agree
    token for token (same uniforms, same q rows in the same order)."""
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=i, max_tokens=25, ignore_eos=True,
                             num_speculative_tokens=k) for i, k in enumerate(KS)]
    eager = draft_engine(tiny_model_dir, near_draft, graphs=False).generate(PROMPTS, params, use_tqdm=False)
    llm = draft_engine(tiny_model_dir, near_draft, graphs=True)
    padded = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in padded] == [o.token_ids for o in eager]
    assert llm.engine.spec_stats.num_accepted_tokens > 0


SYNCS = ("tolist", "item", "cpu", "__bool__", "__int__", "__float__", "__index__")


@pytest.mark.parametrize("method", ["draft_model", "eagle", "ngram", "none"])
@pytest.mark.parametrize("graphs", [False, True, pytest.param("captured", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="captures real CUDA graphs"))])
def test_an_engine_step_reads_the_device_once(tiny_model_dir, near_draft, tmp_path, monkeypatch, method, graphs):
    """Outside the model's forward (where the CPU attention backend plans on the host),
    a step reads device values exactly once: the rejection sampler's packed copy, which
    also brings a draft model's proposals back (an EAGLE head's too, its features kept on
    the device). ``graphs``: eager, the graphs' paths run eagerly, or captured (CUDA)."""
    kwargs = dict(speculative_method=method, num_speculative_tokens=4)
    if method == "draft_model":
        kwargs["draft_model"] = near_draft
    elif method == "eagle":
        kwargs.update(speculative_method="draft_model",
                      draft_model=make_eagle_head(tiny_model_dir("llama"), [1], tmp_path)[0])
    llm = LLM32(str(tiny_model_dir("llama")), enforce_eager=graphs != "captured", **ENGINE, **kwargs)
    engine = llm.engine
    if graphs is True:
        engine.enable_graphs(capture=False)
    reads, in_model = [], [False]
    draft_model = getattr(engine.speculator.drafter, "model", None)
    for model in {id(engine.runner.model): engine.runner.model, id(draft_model): draft_model}.values():
        if model is not None:
            forward = model.forward

            def quiet(*args, _forward=forward, **kw):
                in_model[0] = True
                try:
                    return _forward(*args, **kw)
                finally:
                    in_model[0] = False

            monkeypatch.setattr(model, "forward", quiet)
    for name in SYNCS:
        real = getattr(torch.Tensor, name)

        def counted(self, *args, _real=real, _name=name, **kw):
            if not in_model[0]:
                reads.append(_name)
            return _real(self, *args, **kw)

        monkeypatch.setattr(torch.Tensor, name, counted)
    for prompt, k in zip(PROMPTS, KS):
        engine.add_request(prompt, greedy(k, max_tokens=12))
    per_step = []
    while engine.has_unfinished_requests():
        reads.clear()
        outputs = engine.step()
        per_step.append((len(reads), bool(outputs)))
    monkeypatch.undo()
    assert all(n == 1 for n, sampled in per_step if sampled), per_step
    assert all(n <= 1 for n, _ in per_step), per_step
    if method != "none":
        assert engine.spec_stats.num_drafts > 0


def test_proposals_come_back_with_the_sampled_tokens(tiny_model_dir):
    """The draft's proposals stay on the device through the step; afterwards each planned
    request's draft_token_ids hold their values (here the draft is the target, so every
    proposal is what the request then got)."""
    target = str(tiny_model_dir("llama"))
    llm = draft_engine(tiny_model_dir, target, graphs=True)
    engine = llm.engine
    seen = []
    update = engine.scheduler.update

    def record(output, result):
        seen.extend((list(p.draft_token_ids), tokens) for p, tokens in
                    zip([p for p in output.scheduled if p.sample], result.new_token_ids))
        return update(output, result)

    engine.scheduler.update = record
    llm.generate(PROMPTS[:3], greedy(4), use_tqdm=False)
    verified = [(drafts, tokens) for drafts, tokens in seen if drafts]
    assert verified
    assert all(tokens[:len(drafts)] == drafts and len(tokens) == len(drafts) + 1
               for drafts, tokens in verified)


def test_a_step_without_drafts_skips_only_a_drafter_that_need_not_see_it(tiny_model_dir, near_draft):
    """No request drafts (k = 0 each): the n-gram drafter is not asked at all (the step is
    speculation off's), a draft checkpoint still sees every step (its cache keeps up)."""
    want = LLM32(str(tiny_model_dir("llama")), **ENGINE).generate(PROMPTS, greedy(), use_tqdm=False)
    for method, draft, asked in (("ngram", None, False), ("draft_model", near_draft, True)):
        llm = LLM32(str(tiny_model_dir("llama")), speculative_method=method, draft_model=draft,
                    num_speculative_tokens=4, **ENGINE)
        calls = []
        propose = llm.engine.speculator.drafter.propose
        llm.engine.speculator.drafter.propose = lambda *a, _propose=propose: calls.append(1) or _propose(*a)
        got = llm.generate(PROMPTS, greedy(0), use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert bool(calls) == asked and llm.engine.draft_length_counts[0] > 0



def test_a_draft_model_is_fed_after_the_targets_pass_only_in_steps_without_drafts(tiny_model_dir, near_draft,
                                                                                  tmp_path):
    """A step where nobody drafts (prompts; a lone request with k = 0) feeds a draft
    checkpoint's cache once the target's pass is under way (on a GPU its host work then
    overlaps the device's); a step with drafts drafts first (its proposals are what the
    pass verifies), and an EAGLE head, fed the features of the target's last pass, always
    goes first. The cache keeps up: the same drafts are proposed and accepted as with the
    draft fed first (``feed_after_target`` False), and greedy output is speculation off's.
    Fed after the target's pass in steps without drafts, a drafted step's catch-up is what
    drafting costs (counted in its draft time); fed first, a cost of every step (not).
    (Drafting stops by the plan, as on a GPU: every step feeds the draft.)"""
    params = [greedy(k) for k in KS]
    want = [o.token_ids for o in LLM32(str(tiny_model_dir("llama")), **ENGINE).generate(PROMPTS, params,
                                                                                       use_tqdm=False)]
    eagle = make_eagle_head(tiny_model_dir("llama"), [1], tmp_path)[0]
    for name, draft in (("draft model", near_draft), ("eagle", eagle)):
        stats = {}
        for after in (True, False):
            llm = LLM32(str(tiny_model_dir("llama")), speculative_method="draft_model", draft_model=draft,
                        num_speculative_tokens=4, draft_stopping="plan", **ENGINE)
            engine, order, draft_s = llm.engine, [], []
            engine.speculator.feed_after_target = after
            drafter, execute = engine.speculator.drafter, engine.runner.execute
            propose = drafter.propose

            def propose_noted(scheduled, *a, _propose=propose, _drafter=drafter, _order=order):
                _order.append(("draft", any(p.num_lookahead for p in scheduled)))
                proposal = _propose(scheduled, *a)
                _drafter.last_catch_up_s = 1e3  # a catch-up of 1000 s: where it is counted shows
                return proposal

            def speculate(*a, _speculate=engine.speculator.propose, _draft_s=draft_s):
                drafts = _speculate(*a)
                if drafts.drafted:
                    _draft_s.append(drafts.draft_s)
                return drafts

            def execute_noted(*a, _execute=execute, _order=order, **kw):
                _order.append(("target", None))
                return _execute(*a, **kw)

            drafter.propose, engine.speculator.propose, engine.runner.execute = propose_noted, speculate, execute_noted
            assert [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == want
            steps = [tuple(order[i:i + 2]) for i in range(0, len(order), 2)]
            assert all(len(step) == 2 and {step[0][0], step[1][0]} == {"draft", "target"} for step in steps)
            fed_after = [step[0][0] == "target" for step in steps]
            drafting = [next(d for who, d in step if who == "draft") for step in steps]
            assert any(drafting) and not all(drafting)
            assert fed_after == [after and name == "draft model" and not d for d in drafting], steps
            assert draft_s and all((s > 0) == (after and name == "draft model") for s in draft_s)
            s = engine.spec_stats
            stats[after] = (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens)
        assert stats[True] == stats[False]
        if name == "draft model":
            assert stats[True][2] > 0.5 * stats[True][1]


def test_a_catch_up_of_exactly_the_targets_step_replays_on_the_targets_inputs(tiny_model_dir, near_draft):
    """A step without drafts fed after the target's pass, through the graphs' paths
    (eagerly here), whose catch-up feeds each request its pending token or its prompt
    chunk where the target's pass starts: with ``shares_target_inputs`` the draft's graph replays on the target's
    inputs, copied from its static buffers (``GraphRunner.replay_inputs_of``), not built
    again: padded where every request decodes, ragged where a prompt chunk is in the step.
    What the draft's cache then holds is what building its own inputs writes (the whole
    cache, bit for bit, sharing off), the drafts and their acceptance are the same, and
    greedy output is speculation off's. Where the catch-up is not the target's step it
    builds its own: one right after drafts were accepted (every third step drafts nothing
    here), whose catch-up also feeds the last draft (two tokens where the target's pass
    has one); and one whose prompt logits are asked for (a request added once only
    requests without drafts run): the target runs it eagerly, and its buffers hold the
    step before."""
    long_prompt = " ".join(f"w{i % 37}" for i in range(90))
    prompts = PROMPTS + ["one two three four five six"]
    params = [greedy(k, max_tokens=30 if k else 60) for k in KS + (0,)]
    late = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, num_speculative_tokens=0, prompt_logprobs=1)
    later = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, num_speculative_tokens=0)

    def run(engine) -> dict[str, list[int]]:
        ids = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params)]
        tokens, added = {}, []
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens[out.req_id] = out.token_ids
            if not added and all(i in tokens for i, p in zip(ids, params) if p.num_speculative_tokens):
                # Only k = 0 requests run now: prompt chunks after the draft's catch-ups began.
                added = [engine.add_request(long_prompt, late), engine.add_request("z " + long_prompt, later)]
        return [tokens[i] for i in ids + added]

    want = run(LLM32(str(tiny_model_dir("llama")), **ENGINE).engine)
    caches, stats = {}, {}
    for shared in (True, False):
        llm = draft_engine(tiny_model_dir, near_draft, graphs=True, draft_stopping="plan")  # fed in lockstep
        speculator = llm.engine.speculator
        speculator.feed_after_target = True
        drafter, replays = speculator.drafter, []
        drafter.shares_target_inputs = shared
        graphs = drafter.runner.graphs
        graphs.replay_inputs_of = lambda other, planned, _replay=graphs.replay_inputs_of, _replays=replays: \
            _replays.append((len(planned), other.last_inputs is not None and other.last_inputs[0][0] == 0,
                             _replay(other, planned))) or _replays[-1][2]
        lagging, eager = [], []  # steps without drafts: the catch-up feeds more than the target's pass; eager
        propose = drafter.propose

        def noted(scheduled, requests, *a, _propose=propose, _drafter=drafter, _lagging=lagging, _eager=eager):
            if not any(p.num_lookahead for p in scheduled):
                _lagging.append(any(_drafter._fed.get(p.req_id, 0) < p.start_pos for p in scheduled))
                _eager.append(any(p.prompt_logits for p in scheduled))
            return _propose(scheduled, requests, *a)

        drafter.propose = noted
        plan, planned = speculator.plan, []

        def every_third_plain(scheduler, _plan=plan, _planned=planned):
            chosen = _plan(scheduler)
            _planned.append(1)
            return dict.fromkeys(chosen, 0) if chosen and len(_planned) % 3 == 0 else chosen

        speculator.plan = every_third_plain
        assert run(llm.engine) == want
        assert any(lagging) and any(eager)
        if shared:  # both k = 0 requests, once the drafting ones are done, and the last alone
            assert {n for n, _, replayed in replays if replayed} >= {1, 2}
            assert any(replayed for _, ragged, replayed in replays if ragged)  # the prompt chunks' steps
            assert not all(replayed for *_, replayed in replays)  # the lagging ones, the eager one
        else:
            assert not replays
        caches[shared] = drafter.runner.kv_storage.clone()
        s = llm.engine.spec_stats
        stats[shared] = (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens)
        assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks
    assert stats[True] == stats[False] and stats[True][2] > 0
    assert torch.equal(caches[True], caches[False])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA stream of the drafter's own")
def test_a_draft_model_fed_beside_the_targets_pass_gives_speculation_offs_tokens_on_cuda(tiny_model_dir,
                                                                                          near_draft, monkeypatch):
    """On a GPU with captured graphs, steps without drafts (prompt chunks; a request with
    k = 0 alone) feed the draft on a stream of its own, beside the target's pass, and the
    passes after them wait for it: greedy float32 tokens equal speculation off's, and the
    drafts and their acceptance equal those of the draft fed on the target's stream, and
    of the draft building its own inputs where it could replay on the target's (events
    order that copy both ways; tokens would rarely show a race). The target's graphs,
    the draft's and the draft's feed each run on a CUDA stream of their own (raw handles
    compared; ``cuda_graphs.stream_of_its_own``): with one shared, cuBLAS's workspace
    likely is too, which this tiny model's GEMMs would not show."""
    kwargs = {"device": "cuda", "block_size": 16, "num_kv_blocks": 256, "max_num_seqs": 4,
              "max_num_batched_tokens": 32}
    captured, graph = [], torch.cuda.graph
    monkeypatch.setattr(torch.cuda, "graph", lambda *a, stream=None, **kw: captured.append(
        None if stream is None else stream.cuda_stream) or graph(*a, stream=stream, **kw))
    prompts = PROMPTS + ["one two three four five six seven eight nine ten " * 4]
    params = [greedy(k, max_tokens=40) for k in KS + (2,)]
    want = [o.token_ids for o in LLM32(str(tiny_model_dir("llama")), **kwargs).generate(prompts, params,
                                                                                       use_tqdm=False)]
    stats = {}
    for own, shared in ((True, True), (False, True), (True, False)):
        captured.clear()  # (the graphs of the engines before)
        llm = LLM32(str(tiny_model_dir("llama")), speculative_method="draft_model", draft_model=near_draft,
                    num_speculative_tokens=4, **kwargs)
        drafter, fed, replays = llm.engine.speculator.drafter, [], []
        counts = [len(runner.graphs._graphs) for runner in (llm.engine.runner, drafter.runner)]
        target_streams, draft_streams = set(captured[:counts[0]]), set(captured[counts[0]:sum(counts)])
        assert len(captured) == sum(counts) and len(target_streams) == len(draft_streams) == 1
        assert None not in target_streams | draft_streams and target_streams != draft_streams
        drafter.own_stream, drafter.shares_target_inputs = own, shared
        drafter.feed = lambda *a, _feed=drafter.feed, _fed=fed: _fed.append(1) or _feed(*a)
        graphs = drafter.runner.graphs
        graphs.replay_inputs_of = lambda *a, _replay=graphs.replay_inputs_of, _replays=replays: \
            _replays.append(_replay(*a)) or _replays[-1]
        assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
        assert fed and (drafter._stream is not None) == own and any(replays) == shared
        assert not own or drafter._stream.cuda_stream not in target_streams | draft_streams
        s = llm.engine.spec_stats
        stats[own, shared] = (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens)
        assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks
    assert len(set(stats.values())) == 1 and stats[True, True][2] > 0



@pytest.mark.parametrize("failures", [1, 3])
def test_a_feed_after_the_targets_pass_that_fails_costs_the_requests_nothing(tiny_model_dir, failures):
    """Fault injection: the catch-up fed after the target's pass raises. The step goes on
    (its requests' tokens are the target's), the drafter forgets the step's requests and
    catches them up afresh when they next draft (the target as its own draft then accepts
    every draft), every block comes back; after MAX_DRAFTER_FAILURES failed feeds in a row
    speculation is off for good and the engine serves on. (Forced on a CPU, where a step
    feeds the draft first by default.)"""
    from specserve.spec.speculator import MAX_DRAFTER_FAILURES

    model = str(tiny_model_dir("llama"))
    want = [o.token_ids for o in LLM32(model, **ENGINE).generate(PROMPTS, greedy(), use_tqdm=False)]
    llm = LLM32(model, speculative_method="draft_model", draft_model=model, num_speculative_tokens=4,
                draft_stopping="plan", **ENGINE)
    engine = llm.engine
    engine.speculator.feed_after_target = True
    drafter = engine.speculator.drafter
    raised = []

    def flaky(*args, _feed=drafter.feed):
        if len(raised) < failures:
            raised.append(1)
            raise RuntimeError("draft fell over")
        return _feed(*args)

    drafter.feed = flaky
    # Prompts first (a step without drafts); with one failure the requests then draft, with
    # MAX_DRAFTER_FAILURES they draft nothing (k = 0), so every step feeds after the pass.
    # (k = 4 asked for: a plan on another machine might choose not to draft at all)
    params = greedy(4) if failures < MAX_DRAFTER_FAILURES else greedy(0)
    got = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == want and len(raised) == failures
    assert engine.num_free_blocks == engine.kv.num_blocks
    if failures < MAX_DRAFTER_FAILURES:
        assert engine.speculator.drafter is drafter and engine.spec_stats.num_drafts > 0
        assert engine.spec_stats.acceptance_rate == 1.0
    else:
        assert engine.speculator.drafter is None
        assert [o.token_ids for o in llm.generate(PROMPTS[:1], greedy(), use_tqdm=False)] == want[:1]


def test_an_adaptive_engine_whose_drafter_keeps_failing_serves_on_without_it(tiny_model_dir):
    """MAX_DRAFTER_FAILURES steps in a row whose drafter raises (once drafts have been
    verified, so the controller has lessons pending) turn speculation off under adaptive
    speculation too: the lessons go with the controller (learning them would need it),
    and the step and the ones after it give the target's tokens."""
    from specserve.spec.speculator import MAX_DRAFTER_FAILURES

    model = str(tiny_model_dir("llama"))
    want = [o.token_ids for o in LLM32(model, **ENGINE).generate(PROMPTS, greedy(), use_tqdm=False)]
    llm = LLM32(model, speculative_method="draft_model", draft_model=model, num_speculative_tokens=4,
                draft_stopping="plan", **ENGINE)
    engine, raised = llm.engine, []

    def flaky(scheduled, *args, _propose=engine.speculator.drafter.propose):
        if engine.spec_stats.num_drafts and len(raised) < MAX_DRAFTER_FAILURES:
            raised.append(1)
            raise RuntimeError("draft fell over")
        return _propose(scheduled, *args)

    engine.speculator.drafter.propose = flaky
    # (k = 4 asked for: drafts whatever the plan would choose on this machine)
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(4), use_tqdm=False)] == want
    assert len(raised) == MAX_DRAFTER_FAILURES and engine.speculator.drafter is None
    assert engine.num_free_blocks == engine.kv.num_blocks
