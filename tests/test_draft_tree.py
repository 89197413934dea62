"""Dynamic draft trees (``draft_tree_nodes``, ``spec/tree.py``): a greedy request verifies
its drafted chain and the draft's likeliest runner-up candidates in one pass with tree
attention; the path the target's greedy choices follow becomes its drafts. Exactness
against plain greedy decoding (float32), the pieces on their own, and the refusals."""
from __future__ import annotations

import collections
import re
from unittest import mock

import pytest
import torch

from specserve import LLMEngine, SamplingParams
from specserve.errors import SpecserveError
from specserve.spec.speculator import Drafts, Speculator
from specserve.spec.tree import Node, candidate_tree, choose, feed_rows, frontier, walk
from tiny_models import (LLM32, continuation_chi_square, exact_continuations, make_eagle_head, save_perturbed,
                         sharpened)

PROMPTS = ["a b c a b c a b c a b c", "def f(x): return x\ndef f(x):", "hello", "x = 1\ny = 2\nx = 1\n",
           "import os\nimport sys\nimport os\n"]
ENGINE = dict(block_size=4, num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=96)
KS = (4, 2, 4, 1, 3)
FIXED_TREES_BY_DEVICE = Speculator._fixed_trees  # (``chosen_trees`` replaces it in every test)


@pytest.fixture(autouse=True)
def chosen_trees():
    """This module's engines choose their trees from the candidates' chances on any device
    (on a GPU the engine grows trees of fixed shape, ``Speculator._fixed_trees``), so that
    a GPU runs the same checks of them; ``_fixed`` makes an engine of the GPU's kind."""
    with mock.patch.object(Speculator, "_fixed_trees", return_value=False):
        yield


# ---------------------------------------------------------------------- the pieces
def test_the_candidate_tree_is_the_chain_and_its_runner_ups_with_their_chances():
    chain = [10, 11, 12]
    candidates = [([10, 20, 30], [0.5, 0.3, 0.1]), ([11, 21, 31], [0.8, 0.1, 0.05]), ([12, 22, 32], [0.9, 0.05, 0.01])]
    nodes = candidate_tree(chain, candidates, end=100)
    assert [(n.parent, n.token, n.depth, n.chain, n.slot) for n in nodes[:3]] == \
        [(-1, 10, 0, True, 100), (0, 11, 1, True, 101), (1, 12, 2, True, None)]  # the last is not fed
    assert [n.chance for n in nodes[:3]] == pytest.approx([0.5, 0.4, 0.36])
    got = {(n.parent, n.token): n.chance for n in nodes[3:]}
    assert got == pytest.approx({(-1, 20): 0.3, (-1, 30): 0.1, (0, 21): 0.05, (0, 31): 0.025,
                                 (1, 22): 0.02, (1, 32): 0.004})
    # A tie that ranks the chain's own token second: the first is a runner-up.
    nodes = candidate_tree([20], [([10, 20, 30], [0.4, 0.4, 0.1])], end=0)
    assert [(n.token, n.chain) for n in nodes] == [(20, True), (10, False), (30, False)]


def test_expanding_feeds_the_likeliest_nodes_each_seeing_its_ancestors():
    chain = [10, 11, 12, 13]
    candidates = [([10, 20, 30], [0.5, 0.3, 0.1]), ([11, 21, 31], [0.8, 0.1, 0.05])] + \
        [([12, 22, 32], [0.9, 0.05, 0.01]), ([13, 23, 33], [0.9, 0.05, 0.01])]
    nodes = candidate_tree(chain, candidates, end=50)
    fed = frontier(nodes, 2, max_depth=3)
    assert [nodes[i].token for i in fed] == [20, 30]  # the likeliest runner-ups, both at depth 0
    positions, masks = feed_rows(nodes, fed, end=50, first_slot=53)  # chain fed at 50, 51, 52
    assert positions == [50, 50] and [nodes[i].slot for i in fed] == [53, 54]
    seq_len = 55
    for i, mask in zip(fed, masks):
        seen = {s for s in range(seq_len) if s < seq_len - 64 or (mask >> (seq_len - 1 - s)) & 1}
        assert seen == set(range(50)) | {nodes[i].slot}  # the context and itself, no chain node
    # A child of a runner-up at depth 1 sees its parent's slot and the chain's first token.
    nodes.append(Node(parent=next(i for i, n in enumerate(nodes) if n.token == 21), token=40, chance=0.01, depth=2))
    child = len(nodes) - 1
    nodes[nodes[child].parent].slot = 55
    positions, masks = feed_rows(nodes, [child], end=50, first_slot=56)
    seen = {s for s in range(57) if (masks[0] >> (56 - s)) & 1}
    assert positions == [52] and seen == set(range(50)) | {50, 55, 56}
    # Nothing deeper than the chain, nothing already expanded, nothing below the threshold.
    assert frontier(nodes, 9, max_depth=1, threshold=0.06) == [i for i, n in enumerate(nodes) if n.token in (20, 30)]


def test_choose_takes_the_likeliest_nodes_whose_parents_are_taken():
    trees = {0: [Node(-1, 1, 0.9, 0, chain=True), Node(-1, 2, 0.5, 0), Node(1, 3, 0.45, 1), Node(-1, 4, 0.2, 0)],
             1: [Node(-1, 5, 0.8, 0, chain=True), Node(-1, 6, 0.4, 0), Node(1, 7, 0.6, 1)]}
    # Request 1's node 2 ranks above its parent (never so in a real tree): skipped, as its
    # parent is not taken when it comes up.
    assert choose(trees, 2, 10) == {0: (1, [1, 2]), 1: (1, [1])}
    assert choose(trees, 5, 2) == {0: (1, [1, 2])}
    assert choose(trees, 5, 10, threshold=0.42) == {0: (1, [1, 2])}


def test_a_greedy_chain_shares_its_verify_budget_with_likelier_candidates():
    """Chain 0.9 -> 0.3 -> 0.1; a runner-up of 0.5 at depth 0 and its child of 0.4. With one
    further node the chain of 3 and the candidates share 4 places: the runner-up and its
    child take the place of the chain's last node. A chain not ``cuttable`` (a sampling
    request's) stays whole; the chain needs no threshold, the candidates do."""
    nodes = [Node(-1, 1, 0.9, 0, chain=True), Node(0, 2, 0.3, 1, chain=True), Node(1, 3, 0.1, 2, chain=True),
             Node(-1, 4, 0.5, 0), Node(3, 5, 0.4, 1)]
    assert choose({0: nodes}, 1, 10, cuttable={0}) == {0: (2, [3, 4])}
    assert choose({0: nodes}, 1, 10) == {0: (3, [3])}
    assert choose({0: nodes}, 2, 10, cuttable={0}) == {0: (3, [3, 4])}  # room for all
    assert choose({0: nodes}, 1, 10, threshold=0.45, cuttable={0}) == {0: (3, [3])}
    assert choose({0: nodes}, 1, 1, cuttable={0}) == {0: (3, [3])}  # the step's budget: one further node
    more = nodes + [Node(-1, 6, 0.35, 0)]
    assert choose({0: more}, 1, 10, cuttable={0}) == {0: (1, [3, 4, 5])}


def test_walk_follows_the_targets_argmax_through_the_tree():
    # chain 0 -> 1 -> 2 (tokens 10, 11, 12); leaf 3 (token 20) beside node 0, leaf 4 (21) beside node 1.
    tokens, parents = [10, 11, 12, 20, 21], [-1, 0, 1, -1, 0]
    assert walk(tokens, parents, [10, 11, 12, 99, 0, 0]) == [0, 1, 2]       # the whole chain
    assert walk(tokens, parents, [10, 21, 0, 0, 0, 7]) == [0, 4]            # off the chain at depth 1
    assert walk(tokens, parents, [20, 0, 0, 0, 0, 0]) == [3]                # a leaf at depth 0
    assert walk(tokens, parents, [99, 0, 0, 0, 0, 0]) == []                 # nothing
    # Two children with the same token: the first (the chain's) is followed.
    assert walk([10, 10], [-1, -1], [10, 5, 6]) == [0]


def test_candidates_ranked_after_the_last_pass_are_each_passs_own():
    """A drafter keeps each pass's logits and ranks every pass's rows in one go
    (``ModelDrafter._add_candidates``): each row's candidates at each depth it kept are
    that pass's likeliest tokens for that row, as ranking pass by pass gives them; rows
    that stopped early (a shorter pass) and rows that may not grow a tree are right too."""
    from specserve.drafts.model_drafter import ModelDrafter, _likeliest
    from specserve.scheduler import ScheduledRequest
    from specserve.spec.drafter import DraftProposal
    from specserve.spec.tree import TREE_RANKS

    g = torch.Generator().manual_seed(0)
    rows = [3, 3, 2, 1]  # rows still drafting at each pass (a prefix of the drafting order)
    logits = [torch.randn(n, 50, generator=g) for n in rows]
    greedy, grammar = SamplingParams(temperature=0), SamplingParams(temperature=0, structured_outputs={"regex": "a"})
    scheduled = [ScheduledRequest(str(i), [1], 5, [0], params) for i, params in
                 enumerate([greedy, greedy, grammar, greedy])]
    order = [3, 0, 2]        # drafting rows, longest k first; scheduled[1] drafts nothing
    kept = {3: 4, 0: 3, 2: 2, 1: 0}
    ids = torch.arange(100, 100 + sum(kept.values()))

    def proposal():
        return DraftProposal([[0] * kept[i] for i in range(len(scheduled))], draft_ids=ids.clone())

    got, want = proposal(), proposal()
    ModelDrafter._add_candidates(None, got, scheduled, order, [t.clone() for t in logits])
    ModelDrafter._add_candidates(None, want, scheduled, order, [_likeliest(t, TREE_RANKS + 1) for t in logits])
    assert got.draft_token_ids == want.draft_token_ids == [[100, 101, 102], [], [103, 104], [105, 106, 107, 108]]
    assert got.candidates == want.candidates
    assert got.candidates[1] == got.candidates[2] == []  # no drafts; a grammar's
    for r, i in enumerate(order):
        if i == 2:
            continue
        for depth, (tokens, probs) in enumerate(got.candidates[i]):
            assert tokens == logits[depth][r].topk(TREE_RANKS + 1).indices.tolist()
            assert probs == pytest.approx(logits[depth][r].softmax(-1).topk(TREE_RANKS + 1).values.tolist())


def test_a_fixed_tree_takes_every_depths_runner_up_then_the_next_rank():
    from types import SimpleNamespace

    from specserve.spec.tree import fixed_shape

    assert fixed_shape(3, 4) == [(0, 1), (1, 1), (2, 1), (0, 2)]
    assert fixed_shape(2, 10, ranks=3) == [(0, 1), (1, 1), (0, 2), (1, 2), (0, 3), (1, 3)]
    assert fixed_shape(4, 0) == [] and fixed_shape(0, 5) == []
    fixed = {kind: FIXED_TREES_BY_DEVICE(SimpleNamespace(runner=SimpleNamespace(device=torch.device(kind))))
             for kind in ("cpu", "cuda")}
    assert fixed == {"cpu": False, "cuda": True}


# ---------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def near_draft(tmp_path_factory, tiny_model_dir):
    """The tiny target with perturbed weights: its best guess is often wrong, its runner-up
    often right."""
    return save_perturbed(tiny_model_dir("llama"), tmp_path_factory.mktemp("draft-tree"), 0.01)


def _greedy(k: int, max_tokens: int = 40, **extra) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, num_speculative_tokens=k, **extra)


@pytest.fixture(scope="module")
def plain_outputs(tiny_model_dir):
    return [o.token_ids for o in LLM32(str(tiny_model_dir("llama")), **ENGINE).generate(
        PROMPTS, [_greedy(k) for k in KS], use_tqdm=False)]


@pytest.mark.parametrize("method, graphs", [("draft_model", False), ("layerskip", False), ("draft_model", True)])
def test_greedy_with_a_draft_tree_equals_speculation_off(tiny_model_dir, near_draft, plain_outputs, method, graphs):
    """Fixed k per request and up to 0, 3 or 8 further nodes: the same tokens as plain
    greedy decoding, every block back, and the runner-ups win steps and lengthen them.
    ``graphs``: through the CUDA graphs' static buffers (run eagerly), where tree steps
    take the ragged layout with its mask buffer, and so do the draft model's passes over
    tree nodes, which then grow the same trees as the eager passes."""
    target = str(tiny_model_dir("llama"))
    drafter = dict(draft_model=near_draft) if method == "draft_model" else dict(layerskip_layers=1)
    stats = {}
    for nodes in (0, 3, 8):
        llm = LLM32(target, speculative_method=method, num_speculative_tokens=4, speculative_adaptive=False,
                    draft_tree_nodes=nodes, **drafter, **ENGINE)
        trees_in_graphs, expanded_in_graphs = [], []
        if graphs:
            llm.engine.enable_graphs(capture=False)
            for runner, seen, key in ((llm.engine.runner.graphs, trees_in_graphs, "draft_parents"),
                                      (llm.engine.speculator.drafter.runner.graphs, expanded_in_graphs, "tree_nodes")):
                def spy(planned, *args, ragged=runner._prepare_ragged, seen=seen, key=key):
                    seen.append(any(getattr(p, key) is not None for p in planned))
                    return ragged(planned, *args)

                runner._prepare_ragged = spy
        cuts = []  # chains cut where their candidates were likelier than the tail
        cut = Drafts.cut
        with mock.patch.object(Drafts, "cut", lambda self, keep: (cuts.append(keep), cut(self, keep))):
            got = llm.generate(PROMPTS, [_greedy(k) for k in KS], use_tqdm=False)
        assert bool(cuts) == bool(nodes), nodes
        assert not graphs or any(trees_in_graphs) == bool(nodes)
        assert not graphs or any(expanded_in_graphs) == bool(nodes)
        assert [o.token_ids for o in got] == plain_outputs, nodes
        assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks
        stats[nodes] = llm.engine.spec_stats
    if graphs:  # the same trees grown as without graphs
        eager = LLM32(target, speculative_method=method, num_speculative_tokens=4, speculative_adaptive=False,
                      draft_tree_nodes=8, **drafter, **ENGINE)
        eager.generate(PROMPTS, [_greedy(k) for k in KS], use_tqdm=False)
        assert (eager.engine.spec_stats.num_path_wins, eager.engine.spec_stats.num_accepted_tokens) == \
            (stats[8].num_path_wins, stats[8].num_accepted_tokens)
    assert stats[0].num_path_wins == 0
    # Runner-ups win with either size (a larger tree may win a step less, taking another
    # path: 37 against 38 and 18 against 19 on an H100).
    assert stats[3].num_path_wins > 0 and stats[8].num_path_wins > 0
    assert stats[8].mean_acceptance_length > stats[0].mean_acceptance_length
    assert stats[8].num_draft_tokens > stats[0].num_draft_tokens  # every verified node counts


def _fixed(**kwargs):
    """An engine whose draft trees take a fixed shape (a GPU's way) on any device."""
    with mock.patch.object(Speculator, "_fixed_trees", return_value=True):
        return LLM32(**kwargs)


@pytest.mark.parametrize("method, graphs", [("draft_model", False), ("layerskip", False), ("draft_model", True)])
def test_greedy_with_a_fixed_tree_equals_speculation_off(tiny_model_dir, near_draft, plain_outputs, method, graphs):
    """Trees of fixed shape (every depth's runner-up, then the next rank, up to N nodes),
    their tokens left on the device until the verify pass's argmax brings them back: the
    same tokens as plain greedy decoding, every block back; the runner-ups win steps, every
    verified node counts, and the drafts reach the host once a step (with the argmax)."""
    from specserve.drafts.model_drafter import ModelDrafter

    target = str(tiny_model_dir("llama"))
    drafter = {"draft_model": near_draft} if method == "draft_model" else {"layerskip_layers": 1}
    stats = {}
    for nodes in (3, 8):
        llm = _fixed(model=target, speculative_method=method, num_speculative_tokens=4, speculative_adaptive=False,
                     draft_tree_nodes=nodes, **drafter, **ENGINE)
        assert llm.engine.speculator.drafter.fixed_trees
        if graphs:
            llm.engine.enable_graphs(capture=False)
        with mock.patch.object(ModelDrafter, "_add_candidates", side_effect=AssertionError("host candidates")), \
                mock.patch.object(Drafts, "to_host", side_effect=AssertionError("a second copy")):
            got = llm.generate(PROMPTS, [_greedy(k) for k in KS], use_tqdm=False)
        assert [o.token_ids for o in got] == plain_outputs, nodes
        assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks
        stats[nodes] = llm.engine.spec_stats
    chain = LLM32(target, speculative_method=method, num_speculative_tokens=4, speculative_adaptive=False,
                  **drafter, **ENGINE)
    chain.generate(PROMPTS, [_greedy(k) for k in KS], use_tqdm=False)
    assert stats[3].num_path_wins > 0 and stats[8].num_path_wins >= stats[3].num_path_wins
    assert stats[8].mean_acceptance_length > chain.engine.spec_stats.mean_acceptance_length
    assert stats[8].num_draft_tokens > stats[3].num_draft_tokens > chain.engine.spec_stats.num_draft_tokens


def test_fixed_trees_beside_logprobs_penalties_sampling_and_a_grammar_stay_exact(tiny_model_dir, near_draft):
    """A fixed tree's greedy requests beside one with logprobs and one with a penalty (both
    verified by the sampler), a seeded sampling request (its chain only) and one with a
    grammar (its drafts brought to the host before the pass): each greedy one gets the
    tokens (and logprobs) it gets without speculation."""
    target = str(tiny_model_dir("llama"))
    params = [_greedy(4), _greedy(4, logprobs=2), _greedy(4, repetition_penalty=1.3),
              SamplingParams(temperature=0.9, seed=5, max_tokens=40, ignore_eos=True, num_speculative_tokens=4),
              SamplingParams(temperature=0, max_tokens=12, structured_outputs={"regex": "(ab|b)+"},
                             num_speculative_tokens=4), _greedy(2)]
    prompts = PROMPTS[:6] if len(PROMPTS) >= 6 else (PROMPTS * 2)[:6]
    plain = LLM32(target, **ENGINE).generate(prompts, params, use_tqdm=False)
    llm = _fixed(model=target, speculative_method="draft_model", draft_model=near_draft, num_speculative_tokens=4,
                 speculative_adaptive=False, draft_tree_nodes=6, **ENGINE)
    outs = llm.generate(prompts, params, use_tqdm=False)
    # (A sampling request's tokens depend on where its drafts were verified: it must finish.)
    assert [outs[i].token_ids for i in (0, 1, 2, 4, 5)] == [plain[i].token_ids for i in (0, 1, 2, 4, 5)]
    assert len(outs[3].token_ids) == 40
    for mine, theirs in zip(outs[1].logprobs, plain[1].logprobs):
        assert mine.token_id == theirs.token_id and [t for t, _ in mine.top] == [t for t, _ in theirs.top]
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
    assert llm.engine.spec_stats.num_path_wins > 0
    assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.parametrize("fixed", [False, True])
def test_a_graph_step_after_a_tree_attends_causally(tiny_model_dir, near_draft, plain_outputs, fixed):
    """Through the CUDA graphs' static buffers (run eagerly): a request prefilled after
    another's tree steps gets plain greedy's tokens, so the masks a tree step wrote into
    the ragged graphs' buffer are cleared before the next ragged step reads it."""
    target = str(tiny_model_dir("llama"))
    llm = (_fixed if fixed else LLM32)(model=target, speculative_method="draft_model", draft_model=near_draft,
                                       num_speculative_tokens=4, speculative_adaptive=False, draft_tree_nodes=8,
                                       **ENGINE)
    llm.engine.enable_graphs(capture=False)
    for i in (1, 3, 0):  # one at a time: each prompt's chunk is the step after a tree's
        assert llm.generate([PROMPTS[i]], _greedy(KS[i]), use_tqdm=False)[0].token_ids == plain_outputs[i]
    assert llm.engine.spec_stats.num_path_wins > 0


def test_adaptive_trees_with_penalties_and_sampling_beside_them_stay_exact(tiny_model_dir, near_draft):
    """Adaptive k with drafting stopped by confidence (its prices choose the nodes), a
    greedy request with a repetition penalty (the walk reads raw logits, the sampler the
    processed ones), and a seeded sampling request (a chain) beside them: each gets the
    tokens it gets without speculation."""
    target = str(tiny_model_dir("llama"))
    params = [_greedy(None), _greedy(None, repetition_penalty=1.3),
              SamplingParams(temperature=0.9, seed=5, max_tokens=40, ignore_eos=True), _greedy(None)]
    plain = [o.token_ids for o in LLM32(target, **ENGINE).generate(PROMPTS[:4], params, use_tqdm=False)]
    llm = LLM32(target, speculative_method="draft_model", draft_model=near_draft, num_speculative_tokens=4,
                draft_stopping="confidence", draft_tree_nodes=6, **ENGINE)
    got = [o.token_ids for o in llm.generate(PROMPTS[:4], params, use_tqdm=False)]
    # The sampling request's tokens depend on where drafts were verified (its k is adaptive),
    # so only the greedy ones are compared with plain decoding; it must finish all the same.
    assert [got[i] for i in (0, 1, 3)] == [plain[i] for i in (0, 1, 3)]
    assert len(got[2]) == 40
    assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks
    # (Whether a priced leaf is taken follows measured step times: not asserted.)


@pytest.mark.parametrize("fixed", [False, True])
def test_greedy_trees_are_decided_in_settling_unless_the_sampler_has_work(tiny_model_dir, near_draft, fixed):
    """Fixed k with a tree, three greedy requests: a plain one's path and the target's token
    after it are its tokens (decided in settling; the sampler never sees its tree steps), one
    with logprobs and one with a repetition penalty go through the sampler. Tokens and
    logprobs are those of plain decoding; the trees won steps."""
    target = str(tiny_model_dir("llama"))
    params = [_greedy(4), _greedy(4, logprobs=2), _greedy(4, repetition_penalty=1.3)]
    plain = LLM32(target, **ENGINE).generate(PROMPTS[:3], params, use_tqdm=False)
    llm = (_fixed if fixed else LLM32)(model=target, speculative_method="draft_model", draft_model=near_draft,
                                       num_speculative_tokens=4, speculative_adaptive=False, draft_tree_nodes=8,
                                       **ENGINE)
    seen, sample = [], llm.engine.sampler.sample

    def spy(logits, requests, *args, **kwargs):
        seen.extend(r.req_id for r in requests)
        return sample(logits, requests, *args, **kwargs)

    llm.engine.sampler.sample = spy
    steps = collections.Counter()
    settle = llm.engine.speculator.trees.settle

    def count(drafts, logits):
        steps.update(p.req_id for p in drafts.scheduled.scheduled if p.draft_parents is not None)
        return settle(drafts, logits)

    llm.engine.speculator.trees.settle = count
    outs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert llm.engine.spec_stats.num_path_wins > 0
    ids = [o.req_id for o in outs]
    assert steps[ids[0]] > 0 and steps[ids[1]] > 0 and steps[ids[2]] > 0
    runs = collections.Counter(seen)
    assert runs[ids[0]] < runs[ids[1]] and runs[ids[0]] < runs[ids[2]]  # its tree steps left out
    assert len(outs[1].logprobs) == 40
    for mine, theirs in zip(outs[1].logprobs, plain[1].logprobs):
        assert mine.token_id == theirs.token_id and [t for t, _ in mine.top] == [t for t, _ in theirs.top]
        assert [mine.logprob, *(lp for _, lp in mine.top)] == \
            pytest.approx([theirs.logprob, *(lp for _, lp in theirs.top)], abs=1e-4)
    assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.parametrize("fixed", [False, True])
def test_a_tree_moves_its_paths_kv_to_the_chains_slots(tiny_model_dir, near_draft, fixed):
    """After a step whose path left the chain, the target's cache holds at the path's
    positions what a plain pass over the emitted tokens stores there, and the draft's
    own cache is valid only up to the runner-up."""
    target = str(tiny_model_dir("llama"))
    llm = (_fixed if fixed else LLM32)(model=target, speculative_method="draft_model", draft_model=near_draft,
                                       num_speculative_tokens=4, speculative_adaptive=False, draft_tree_nodes=8,
                                       enable_prefix_caching=False, **ENGINE)
    engine = llm.engine
    engine.add_request(PROMPTS[1], _greedy(4, max_tokens=200), req_id="a")
    plain = LLM32(target, enable_prefix_caching=False, enforce_eager=True, **ENGINE).engine  # (its pass's rows kept)
    won = False
    for _ in range(30):
        wins = engine.spec_stats.num_path_wins
        engine.step()
        req = engine.scheduler.requests.get("a")
        if req is None:
            break
        if engine.spec_stats.num_path_wins > wins:
            won = True
            n = req.num_computed_tokens
            # The path ended on a runner-up, its last token: the draft cache holds entries
            # for the chain's tokens before it and forgot the rest (they are fed again).
            assert engine.speculator.drafter.cached_tokens("a") == n - 1
            plain.add_request(req.all_token_ids[:n], SamplingParams(temperature=0, max_tokens=3), req_id="p")
            plain.step()
            mine, theirs = engine.runner, plain.runner
            pos = torch.arange(n)
            for runner, table in ((mine, engine.kv.block_table("a")), (theirs, plain.kv.block_table("p"))):
                slots = torch.tensor(table)[pos // 4] * 4 + pos % 4
                runner.seen = runner.kv_storage.flatten(2, 3)[:, :, slots]
            torch.testing.assert_close(mine.seen, theirs.seen, atol=1e-4, rtol=1e-4)
            plain.abort("p")
            plain.step()
            break
    assert won


def test_trees_are_refused_where_they_cannot_run(tiny_model_dir, tmp_path):
    target = str(tiny_model_dir("llama"))
    from test_medusa import make_medusa_heads  # lazy: another test module's checkpoint maker

    heads = make_medusa_heads(target, tmp_path / "medusa")[0]
    with pytest.raises(SpecserveError, match="does not grow draft trees"):
        LLM32(target, speculative_method="draft_model", draft_model=heads, draft_tree_nodes=4, **ENGINE)
    with pytest.raises(SpecserveError, match="draft_tree_nodes 4 needs speculative_method"):
        LLM32(target, speculative_method="ngram", draft_tree_nodes=4, **ENGINE)
    with pytest.raises(SpecserveError, match="choose one"):
        LLM32(target, speculative_method="layerskip", num_draft_paths=2, draft_tree_nodes=4, **ENGINE)
    with pytest.raises(SpecserveError, match=r"draft_tree_nodes must be in \[0, 32\]"):
        LLM32(target, speculative_method="layerskip", draft_tree_nodes=33, **ENGINE)


def test_a_tree_beside_a_grammar_and_a_sampling_request_in_one_step(tiny_model_dir, near_draft):
    """A grammar cuts its request's drafts and a sampling request's q rows travel with
    the step while a greedy request verifies a tree: q's rows stay each request's (a
    tree's further nodes have none), the greedy request's tokens are plain greedy's, the
    structured one matches its grammar and every block comes back."""
    target = str(tiny_model_dir("llama"))
    params = [_greedy(4), SamplingParams(temperature=0, max_tokens=12, structured_outputs={"regex": "(ab|b)+"}),
              SamplingParams(temperature=0.9, seed=3, max_tokens=30, ignore_eos=True, num_speculative_tokens=4)]
    plain = LLM32(target, **ENGINE).generate(PROMPTS[:1], params[:1], use_tqdm=False)[0].token_ids
    llm = LLM32(target, speculative_method="draft_model", draft_model=near_draft, num_speculative_tokens=4,
                speculative_adaptive=False, draft_tree_nodes=6, **ENGINE)
    got = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    assert got[0].token_ids == plain
    assert re.fullmatch("(ab|b)+", got[1].text) and len(got[2].token_ids) == 30
    assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks


@pytest.fixture(scope="module")
def unsure(tmp_path_factory, tiny_model_dir):
    """The target itself, sharpened: the same candidates as the target's, in other
    proportions, so that drafts are rejected often and the residuals matter."""
    return sharpened(save_perturbed(tiny_model_dir("llama"), tmp_path_factory.mktemp("tree-unsure"), 0.0), 12.0)


@pytest.mark.parametrize("top_k, length, outcomes, limit", [(2, 4, 16, 37.7), (3, 3, 27, 54.05)])
def test_sampling_through_trees_has_the_target_distribution(tiny_model_dir, unsure, top_k, length, outcomes, limit):
    """Continuations (top_k 2 or 3: 16 or 27 outcomes, exact from transformers) sampled
    through trees: each depth's drafted token and others drawn without replacement,
    verified by recursive rejection without replacement. Chi-square within its degrees of
    freedom (p = 0.001); trees grew and their runner-ups were kept. (Accepting a runner-up
    against p itself rather than the residual left by the rejected chain token gives a
    chi-square in the hundreds, and with top_k 3 so does keeping a rejected token in q:
    checked.)"""
    target = str(tiny_model_dir("llama"))
    prompt, sp = [5, 17, 99, 230, 17, 99], dict(temperature=1.0, top_k=top_k)
    exact = exact_continuations(target, prompt, length, sp)
    engine = LLMEngine(dtype="float32", model=target, speculative_method="draft_model", draft_model=unsure,
                       num_speculative_tokens=3, speculative_adaptive=False, draft_tree_nodes=4,
                       max_num_batched_tokens=4096, max_num_seqs=512, block_size=16, num_kv_blocks=2000)
    chi2 = continuation_chi_square(engine, prompt, sp, exact, 3000)
    assert len(exact) == outcomes and chi2 < limit, chi2
    stats = engine.spec_stats
    assert stats.num_path_wins > 100, stats
    assert engine.num_free_blocks == engine.kv.num_blocks


def test_metrics_show_the_tree_sizes(chat_model_dir):
    """``/metrics`` has a histogram of the further nodes each request-step verified, and
    counts the steps whose path left the chain."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from specserve.async_engine import AsyncLLMEngine
    from specserve.server import ThreadedServer
    from specserve.server.app import create_app

    engine = AsyncLLMEngine(LLMEngine(model=str(chat_model_dir), dtype="float32", block_size=4, num_kv_blocks=256,
                                      speculative_method="layerskip", layerskip_layers=1,
                                      speculative_adaptive=False, draft_tree_nodes=3))
    with ThreadedServer(create_app(engine, served_model_name="tiny")) as srv:
        out = httpx.post(srv.url + "/v1/completions", json={"prompt": "a b c a b c", "temperature": 0,
                                                            "max_tokens": 24, "ignore_eos": True}).json()
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)}
    steps = out["usage"]["speculation"]["num_drafts"]
    samples = {s.name: s.value for s in families["specserve:spec_decode_tree_nodes"].samples}
    assert 0 < samples["specserve:spec_decode_tree_nodes_count"] <= steps
    # (A greedy chain of 4 and its candidates share 4 + 3 places; the chain keeps one at least.)
    assert 0 < samples["specserve:spec_decode_tree_nodes_sum"] <= (4 + 3 - 1) * steps


@pytest.mark.parametrize("fixed", [False, True])
def test_an_eagle_head_grows_trees_and_reads_the_features_of_the_path(tiny_model_dir, plain_outputs, tmp_path,
                                                                      fixed):
    """An EAGLE head's tree (its runner-ups, not expanded; chosen, or of fixed shape):
    greedy output equals plain decoding, every block comes back, runner-ups win, and after
    a step whose path left the chain the head reads the target's hidden states of the
    path's positions, as a plain pass over the emitted tokens computes them."""
    target = str(tiny_model_dir("llama"))
    head = sharpened(make_eagle_head(target, [1], tmp_path)[0], 12.0)
    llm = (_fixed if fixed else LLM32)(model=target, speculative_method="draft_model", draft_model=head,
                                       num_speculative_tokens=4, speculative_adaptive=False, draft_tree_nodes=6,
                                       **ENGINE)
    assert llm.engine.speculator.drafter.fixed_trees == fixed
    got = llm.generate(PROMPTS, [_greedy(k) for k in KS], use_tqdm=False)
    assert [o.token_ids for o in got] == plain_outputs
    assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks and llm.engine.spec_stats.num_path_wins > 0
    engine = llm.engine
    engine.add_request(PROMPTS[1], _greedy(4, max_tokens=200), req_id="a")
    plain = LLM32(target, enable_prefix_caching=False, enforce_eager=True, **ENGINE).engine  # (its pass's rows kept)
    plain.runner.keep_hidden = True
    for _ in range(40):
        wins = engine.spec_stats.num_path_wins
        engine.step()
        req = engine.scheduler.requests.get("a")
        assert req is not None
        if engine.spec_stats.num_path_wins == wins:
            continue
        (planned,) = engine.runner.last_pass  # the step as settled: the path as a chain
        rows = engine.runner.last_hidden
        first, n = planned.start_pos, len(planned.token_ids) + len(planned.draft_token_ids)
        plain.add_request(req.all_token_ids[:first + n], SamplingParams(temperature=0, max_tokens=2), req_id="p")
        plain.step()
        torch.testing.assert_close(rows, plain.runner.last_hidden[first:first + n], atol=1e-4, rtol=1e-4)
        return
    raise AssertionError("no runner-up won")
