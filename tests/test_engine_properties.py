"""Property-based engine tests (hypothesis): random mixes of prompt lengths, arrival
steps, sampling parameters, per-request draft lengths, stop strings and aborts at random
steps, on every drafter, with a KV pool small enough to force preemption. Invariants:

- every request ends exactly once, and nothing is emitted for it afterwards;
- no KV block leaks: once all requests have ended, every block is free;
- greedy output (float32) equals plain greedy decoding of the request alone, whatever
  ran beside it, was drafted, preempted or aborted.

``SPECSERVE_PROPERTY_EXAMPLES`` sets the examples per drafter (CI: the default)."""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specserve import LLMEngine, SamplingParams

EXAMPLES = int(os.environ.get("SPECSERVE_PROPERTY_EXAMPLES", "25"))
ENGINE = dict(dtype="float32", block_size=4, num_kv_blocks=26, max_num_batched_tokens=24, max_num_seqs=6,
              max_model_len=96, num_speculative_tokens=4)
RUNS: dict[str, dict[str, int]] = {}  # drafter -> examples, requests, preemptions, aborts


@pytest.fixture(scope="module")
def engines(tiny_model_dir, tmp_path_factory):
    from tiny_models import make_hf_model, make_tokenizer

    draft = tmp_path_factory.mktemp("property-draft")
    make_hf_model("llama", seed=1, num_hidden_layers=1).save_pretrained(draft)
    make_tokenizer(512).save_pretrained(draft)
    target = str(tiny_model_dir("llama"))
    settings_ = {"none": {}, "ngram": dict(speculative_method="ngram"),
                 "layerskip": dict(speculative_method="layerskip", layerskip_layers=1),
                 "draft_model": dict(speculative_method="draft_model", draft_model=str(draft))}
    built = {name: LLMEngine(model=target, **ENGINE, **kw) for name, kw in settings_.items()}
    built["reference"] = LLMEngine(model=target, **{**ENGINE, "num_kv_blocks": 256, "max_num_seqs": 1})
    yield built
    print("\nproperty runs: " + "; ".join(f"{d}: " + ", ".join(f"{v} {k}" for k, v in r.items())
                                          for d, r in RUNS.items()))
    for engine in built.values():
        engine.shutdown()


@st.composite
def workloads(draw):
    requests = []
    for _ in range(draw(st.integers(1, 6))):
        length = draw(st.integers(1, 40))
        prompt = draw(st.lists(st.integers(3, 500), min_size=length, max_size=length))
        if draw(st.booleans()):
            prompt = prompt + prompt[: len(prompt) // 2]  # repeats: n-gram drafts find matches
        params = dict(max_tokens=draw(st.integers(1, 32)), ignore_eos=draw(st.booleans()),
                      temperature=draw(st.sampled_from([0.0, 0.0, 0.8])),
                      seed=draw(st.none() | st.integers(0, 99)),
                      num_speculative_tokens=draw(st.none() | st.integers(0, 4)),
                      stop=draw(st.sampled_from([[], ["a"], ["e", " t"]])))
        requests.append(dict(prompt=prompt, params=params, arrive=draw(st.integers(0, 6)),
                             abort=draw(st.none() | st.integers(0, 10))))
    return requests


_solo_cache: dict = {}


def solo(reference: LLMEngine, prompt: list[int], params: dict) -> tuple[list[int], str]:
    """Plain greedy decoding of one request alone (no drafter, nothing beside it)."""
    key = (tuple(prompt), tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in params.items())))
    if key not in _solo_cache:
        req_id = reference.add_request(prompt, SamplingParams(**params))
        final = None
        while reference.has_unfinished_requests():
            for out in reference.step():
                if out.finished and out.req_id == req_id:
                    final = out
        _solo_cache[key] = (final.token_ids, final.finish_reason)
    return _solo_cache[key]


@pytest.mark.parametrize("drafter", ["none", "ngram", "layerskip", "draft_model"])
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(workload=workloads())
def test_requests_end_once_free_their_blocks_and_greedy_equals_alone(engines, drafter, workload):
    engine = engines[drafter]
    stats = RUNS.setdefault(drafter, {"examples": 0, "requests": 0, "preemptions": 0, "aborts": 0})
    preemptions_before = engine.scheduler.num_preemptions
    ids: dict[int, str] = {}
    finals: dict[str, object] = {}
    step = 0
    while len(ids) < len(workload) or engine.has_unfinished_requests():
        for i, req in enumerate(workload):
            if i not in ids and req["arrive"] <= step:
                ids[i] = engine.add_request(req["prompt"], SamplingParams(**req["params"]))
            if i in ids and req["abort"] is not None and req["arrive"] + req["abort"] == step:
                if engine.abort(ids[i]):
                    stats["aborts"] += 1
        for out in engine.step():
            assert out.req_id not in finals, f"{out.req_id} emitted after it ended"
            if out.finished:
                finals[out.req_id] = out
        step += 1
        assert step < 2000, "the engine stopped making progress"
    assert sorted(finals) == sorted(ids.values())  # each ended, exactly once
    assert engine.num_free_blocks == engine.kv.num_blocks  # nothing leaked
    for i, req in enumerate(workload):
        out = finals[ids[i]]
        if req["params"]["temperature"] == 0 and out.finish_reason != "abort":
            assert (out.token_ids, out.finish_reason) == solo(engines["reference"], req["prompt"], req["params"])
    stats["examples"] += 1
    stats["requests"] += len(workload)
    stats["preemptions"] += engine.scheduler.num_preemptions - preemptions_before
