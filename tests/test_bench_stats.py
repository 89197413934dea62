"""Benchmark statistics, arrival processes, /metrics parsing and workloads: pure functions,
checked against values worked out by hand."""
from __future__ import annotations

import itertools
import json
import math
import statistics

import pytest

from specserve.bench.arrivals import arrival_times, parse_rates
from specserve.bench.client import RequestResult, SpecCounters, parse_spec_counters
from specserve.bench.serve_bench import Speculation, parse_speculation
from specserve.config import EngineConfig
from specserve.bench.stats import (
    calculate_metrics,
    count_good,
    max_concurrency,
    parse_goodput,
    format_draft_lengths,
    mean_draft_length,
    parse_percentiles,
    percentile,
    spec_decode_metrics,
    summarize,
)
from specserve.bench.workloads import (
    code_edit_prompts,
    load_jsonl,
    load_workload,
    random_requests,
    summarize_prompts,
)


def result(ttft, latency, output_len, itl=(), send=0.0, prompt_len=10, success=True) -> RequestResult:
    return RequestResult(success=success, prompt_len=prompt_len, output_len=output_len, send_time=send,
                         ttft=ttft, latency=latency, itl=list(itl), error="" if success else "boom")


# ---------------------------------------------------------------------- percentiles
def test_percentile_interpolates_linearly():
    values = list(range(1, 11))  # 1..10
    assert percentile(values, 50) == pytest.approx(5.5)
    assert percentile(values, 90) == pytest.approx(9.1)
    assert percentile(values, 99) == pytest.approx(9.91)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 99) == 0.0


def test_summarize_reports_milliseconds():
    out = summarize("ttft", [0.1, 0.2, 0.3, 0.4], [90, 99.5])
    assert out["mean_ttft_ms"] == pytest.approx(250.0)
    assert out["median_ttft_ms"] == pytest.approx(250.0)
    assert out["std_ttft_ms"] == pytest.approx(statistics.pstdev([100, 200, 300, 400]))
    assert out["p90_ttft_ms"] == pytest.approx(370.0)
    assert out["p99.5_ttft_ms"] == pytest.approx(398.5)
    assert summarize("itl", [], [99]) == {"mean_itl_ms": 0.0, "median_itl_ms": 0.0, "std_itl_ms": 0.0,
                                          "p99_itl_ms": 0.0}


def test_parse_percentiles():
    assert parse_percentiles("50,90,99.9") == [50.0, 90.0, 99.9]
    for bad in ("", "x", "0", "100", "90,101"):
        with pytest.raises(ValueError):
            parse_percentiles(bad)


# ---------------------------------------------------------------------- the metrics
def test_calculate_metrics_matches_hand_computation():
    results = [
        result(ttft=0.1, latency=1.1, output_len=11, itl=[0.1] * 10, send=0.0, prompt_len=5),
        result(ttft=0.3, latency=0.3, output_len=1, send=0.5, prompt_len=7),  # no TPOT
        result(ttft=0.2, latency=2.2, output_len=5, itl=[0.5] * 4, send=1.0, prompt_len=9),
        result(ttft=0.0, latency=0.0, output_len=0, send=1.5, success=False),
    ]
    m = calculate_metrics(results, duration_s=4.0, percentiles=[50])
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (21, 17)
    assert m["request_throughput"] == pytest.approx(0.75)
    assert m["output_throughput"] == pytest.approx(17 / 4)
    assert m["total_token_throughput"] == pytest.approx(38 / 4)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    # TPOT: (1.1 - 0.1) / 10 = 0.1 and (2.2 - 0.2) / 4 = 0.5; the 1-token request has none.
    assert m["mean_tpot_ms"] == pytest.approx(300.0)
    assert m["median_tpot_ms"] == pytest.approx(300.0)
    assert m["mean_itl_ms"] == pytest.approx((10 * 100 + 4 * 500) / 14)
    assert m["p50_e2el_ms"] == pytest.approx(1100.0)
    assert m["request_goodput"] is None
    assert m["max_concurrent_requests"] == 2  # 0-1.1 overlaps 0.5-0.8, then 1.0-3.2 overlaps 0-1.1


def test_goodput_counts_requests_meeting_every_objective():
    done = [result(0.1, 1.1, 11), result(0.3, 0.3, 1), result(0.2, 2.2, 5)]
    # TPOTs 100 ms, 0 (one token, as in vLLM), 500 ms.
    assert count_good(done, {"ttft": 250}) == 2
    assert count_good(done, {"tpot": 100}) == 2
    assert count_good(done, {"ttft": 250, "tpot": 100}) == 1
    assert count_good(done, {"e2el": 2200}) == 3
    m = calculate_metrics(done, 2.0, goodput={"ttft": 250, "tpot": 100})
    assert m["request_goodput"] == pytest.approx(0.5)


def test_parse_goodput():
    assert parse_goodput(["ttft:500", "tpot:50.5", "e2el:0"]) == {"ttft": 500, "tpot": 50.5, "e2el": 0}
    for bad in (["itl:5"], ["ttft"], ["ttft:abc"], ["ttft:-1"], ["ttft=5"]):
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput(bad)


def test_max_concurrency():
    assert max_concurrency([]) == 0
    assert max_concurrency([result(0, 1, 2, send=0), result(0, 1, 2, send=1)]) == 1  # back to back
    assert max_concurrency([result(0, 5, 2, send=t) for t in range(4)]) == 4


# ---------------------------------------------------------------------- speculation
def test_spec_decode_metrics_are_counter_deltas():
    before = SpecCounters(10, 30, 12, {0: 8, 1: 4})
    after = SpecCounters(30, 90, 42, {0: 24, 1: 14, 2: 4})
    m = spec_decode_metrics(before, after)
    assert m["spec_decode_num_drafts"] == 20
    assert m["spec_decode_draft_tokens"] == 60
    assert m["spec_decode_accepted_tokens"] == 30
    assert m["spec_decode_acceptance_rate"] == pytest.approx(50.0)
    assert m["spec_decode_acceptance_length"] == pytest.approx(2.5)
    assert m["spec_decode_per_position_acceptance_rates"] == pytest.approx([0.8, 0.5, 0.2])
    assert spec_decode_metrics(after, after) == {}  # nothing drafted: absent, not zero
    assert spec_decode_metrics(None, after) == {}


def test_draft_lengths_chosen_are_deltas_too():
    before = SpecCounters(10, 30, 12, {0: 8}, {0: 5, 4: 10})
    after = SpecCounters(12, 38, 14, {0: 10}, {0: 11, 2: 1, 4: 11})
    m = spec_decode_metrics(before, after)
    assert m["spec_decode_draft_lengths"] == {"0": 6, "2": 1, "4": 1}
    assert mean_draft_length(m) == pytest.approx(6 / 8)
    assert format_draft_lengths(m) == "k=0 75%  k=2 12%  k=4 12%"
    # An adaptive engine that chose k = 0 throughout drafted nothing, but chose something.
    idle = spec_decode_metrics(after, SpecCounters(12, 38, 14, {0: 10}, {0: 31, 2: 1, 4: 11}))
    assert idle == {"spec_decode_draft_lengths": {"0": 20}}


PROMETHEUS = """\
# HELP {p}:spec_decode_num_drafts_total Drafts.
# TYPE {p}:spec_decode_num_drafts_total counter
{p}:spec_decode_num_drafts_total{{model_name="m"}} 12.0
# TYPE {p}:spec_decode_num_draft_tokens_total counter
{p}:spec_decode_num_draft_tokens_total{{model_name="m"}} 40.0
# TYPE {p}:spec_decode_num_accepted_tokens_total counter
{p}:spec_decode_num_accepted_tokens_total{{model_name="m"}} 21.0
# TYPE {p}:spec_decode_num_accepted_tokens_per_pos_total counter
{p}:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="0"}} 11.0
{p}:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="1"}} 10.0
# TYPE {p}:generation_tokens_total counter
{p}:generation_tokens_total{{model_name="m"}} 99.0
# TYPE {p}:spec_decode_draft_length histogram
{p}:spec_decode_draft_length_bucket{{model_name="m",le="0.0"}} 3.0
{p}:spec_decode_draft_length_bucket{{model_name="m",le="1.0"}} 3.0
{p}:spec_decode_draft_length_bucket{{model_name="m",le="2.0"}} 8.0
{p}:spec_decode_draft_length_bucket{{model_name="m",le="+Inf"}} 8.0
{p}:spec_decode_draft_length_count{{model_name="m"}} 8.0
{p}:spec_decode_draft_length_sum{{model_name="m"}} 10.0
"""


@pytest.mark.parametrize("prefix", ["specserve", "vllm"])
def test_parse_spec_counters_reads_specserve_and_vllm_names(prefix):
    counters = parse_spec_counters(PROMETHEUS.format(p=prefix))
    assert counters == SpecCounters(12, 40, 21, {0: 11, 1: 10}, {0: 3, 1: 0, 2: 5})
    assert parse_spec_counters('# TYPE x counter\nx_total 1.0\n') is None


def test_parse_speculation():
    assert parse_speculation("none,ngram:4,layerskip") == [
        Speculation("none"), Speculation("ngram", 4), Speculation("layerskip")]
    assert [s.label for s in parse_speculation("none,ngram:4")] == ["spec off", "ngram k=4"]
    assert parse_speculation("draft_model:4:adaptive:tree=10,draft_model:adaptive") == [
        Speculation("draft_model", 4, True, 10), Speculation("draft_model", adaptive=True)]
    assert parse_speculation("draft_model:4:tree=5")[0].label == "draft_model k=4 tree=5"
    plan = parse_speculation("ngram:4:adaptive:stop=plan")[0]
    assert plan == Speculation("ngram", 4, True, stop="plan") and plan.label == "ngram k=4 adaptive stop=plan"
    assert plan.apply(EngineConfig()).draft_stopping == "plan"
    assert parse_speculation("ngram:4:adaptive")[0].apply(EngineConfig()).draft_stopping == "auto"
    for bad in ("eagle", "ngram:0", "ngram:x", "none:2", "none:adaptive", "draft_model:4:tree=0",
                "draft_model:4:tree", "draft_model:4:wide", "draft_model:4:adaptive:adaptive",
                "ngram:4:adaptive:stop=never", "ngram:4:adaptive:stop=plan:stop=plan", "none:stop=plan",
                "ngram:4:stop=plan"):
        with pytest.raises(ValueError, match="--speculation"):
            parse_speculation(bad)


# ---------------------------------------------------------------------- arrivals
def test_arrivals_are_seeded_and_start_at_zero():
    a = arrival_times(50, 4.0, seed=3)
    assert a == arrival_times(50, 4.0, seed=3)
    assert a != arrival_times(50, 4.0, seed=4)
    assert a[0] == 0.0 and all(x <= y for x, y in itertools.pairwise(a))
    assert arrival_times(5, math.inf) == [0.0] * 5
    assert arrival_times(0, 1.0) == []


@pytest.mark.parametrize("burstiness, cv", [(1.0, 1.0), (0.25, 2.0), (4.0, 0.5)])
def test_arrival_gaps_have_the_rate_and_burstiness_asked_for(burstiness, cv):
    """Gamma gaps with shape b and mean 1/rate have coefficient of variation 1/sqrt(b)."""
    times = arrival_times(40_001, 2.0, burstiness, seed=0)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(0.5, rel=0.03)
    assert statistics.pstdev(gaps) / mean == pytest.approx(cv, rel=0.05)


def test_bad_rates_and_burstiness():
    for rate in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="rate"):
            arrival_times(3, rate)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_times(3, 1.0, burstiness=0)
    assert parse_rates("0.5, 1,inf") == [0.5, 1.0, math.inf]
    for bad in ("1,x", "0", "1,,2"):
        with pytest.raises(ValueError):
            parse_rates(bad)


# ---------------------------------------------------------------------- workloads
def test_jsonl_format(tmp_path):
    path = tmp_path / "set.jsonl"
    path.write_text('{"prompt": "hello"}\n\n'
                    '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}\n'
                    '{"prompt": [1, 2, 3], "other": "ignored"}\n')
    reqs = load_jsonl(path, output_len=16)
    assert [(r.prompt, r.is_chat, r.max_tokens) for r in reqs] == [
        ("hello", False, 16), (None, True, 5), ([1, 2, 3], False, 16)]
    assert reqs[1].prompt_text() == "hi"
    cycled = load_workload(str(path), 7, output_len=16)
    assert len(cycled) == 7 and cycled[3] == reqs[0]


@pytest.mark.parametrize("line, message", [
    ("not json", "set.jsonl:2:"),
    ('["a"]', "JSON object"),
    ('{"prompt": "a", "messages": []}', "exactly one"),
    ("{}", "exactly one"),
    ('{"prompt": ""}', "non-empty"),
    ('{"prompt": "a", "max_tokens": 0}', "max_tokens"),
    ('{"messages": [{"content": "no role"}]}', "messages"),
])
def test_jsonl_errors_name_the_line(tmp_path, line, message):
    path = tmp_path / "set.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError, match=message) as info:
        load_jsonl(path, 8)
    assert f"{path}:2:" in str(info.value)


def test_missing_or_empty_files_and_unknown_names(tmp_path):
    with pytest.raises(ValueError, match="No such file"):
        load_workload(str(tmp_path / "none.jsonl"), 2, output_len=8)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        load_workload(str(tmp_path / "empty.jsonl"), 2, output_len=8)
    with pytest.raises(ValueError, match="unknown workload"):
        load_workload("sharegpt", 2, output_len=8)


def test_random_prompts_have_exact_lengths_and_no_special_tokens(tiny_tokenizer):
    reqs = random_requests(tiny_tokenizer, 5, input_len=33, output_len=7, seed=1)
    assert [len(r.prompt) for r in reqs] == [33] * 5 and all(r.max_tokens == 7 for r in reqs)
    special = set(tiny_tokenizer.all_special_ids)
    assert not any(t in special for r in reqs for t in r.prompt)
    assert reqs == random_requests(tiny_tokenizer, 5, input_len=33, output_len=7, seed=1)
    assert json.dumps([r.prompt for r in reqs])  # token ids travel as JSON


def test_builtin_workloads():
    code = load_workload("code-edit", 30, output_len=64)
    assert len(code) == 30 and all(r.is_chat and r.max_tokens == 64 for r in code)
    assert all("```python" in p for p in code_edit_prompts()) and len(code_edit_prompts()) >= 24
    assert "Add type hints" in code[0].messages[0]["content"]  # the README's set comes first
    assert len(summarize_prompts()) >= 20 and all(p.startswith(("Summarise", "Write a short summary"))
                                                   for p in summarize_prompts())
    assert len(load_workload("chat", 3, output_len=8)) == 3
