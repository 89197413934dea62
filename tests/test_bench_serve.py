"""``specserve bench``, end to end on the tiny model: the serving benchmark against the
servers it starts and against a URL, the offline benchmark, the speculation sweep, and
the command line's help and errors."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specserve import LLM
from specserve.bench.offline import run_offline
from specserve.bench.serve_bench import InProcessServer, engine_args
from specserve.bench.workloads import load_workload
from specserve.cli import main
from specserve.config import EngineConfig

ENGINE = ["--dtype", "float32", "--block-size", "4", "--num-kv-blocks", "512", "--max-model-len", "256"]
VLLM_KEYS = ["duration", "completed", "total_input_tokens", "total_output_tokens", "request_throughput",
             "request_goodput", "output_throughput", "total_token_throughput", "input_lens", "output_lens",
             "ttfts", "itls", "errors", "num_prompts", "request_rate", "burstiness", "max_concurrency",
             *(f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
               for stat in ("mean", "median", "std", "p90", "p99"))]
SPEC_KEYS = ["spec_decode_acceptance_rate", "spec_decode_acceptance_length", "spec_decode_num_drafts",
             "spec_decode_draft_tokens", "spec_decode_accepted_tokens",
             "spec_decode_per_position_acceptance_rates"]


@pytest.fixture(scope="module")
def repetitive_set(tmp_path_factory):
    """Prompts the n-gram drafter finds matches in, with two output lengths."""
    path = tmp_path_factory.mktemp("bench") / "set.jsonl"
    path.write_text(json.dumps({"prompt": "a b c a b c a b c a b c a b c"}) + "\n"
                    + json.dumps({"prompt": "x = 1\ny = 2\nx = 1\ny = 2\nx = 1\n", "max_tokens": 10}) + "\n")
    return path


def bench(capsys, *argv):
    code = main(["bench", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_serving_benchmark_with_its_own_servers(capsys, tiny_model_dir, repetitive_set, tmp_path):
    result_path, plots = tmp_path / "result.json", tmp_path / "plots"
    code, out, err = bench(capsys, "serve", "--model", str(tiny_model_dir("llama")), *ENGINE, "-q",
                           "--workload", str(repetitive_set), "--num-prompts", "12", "--output-len", "16",
                           "--request-rate", "20", "--speculation", "none,ngram:3",
                           "--goodput", "ttft:60000", "--save-detailed",
                           "--result-json", str(result_path), "--plot-dir", str(plots))
    assert code == 0, err
    payload = json.loads(result_path.read_text())
    off, ngram = payload["runs"]
    assert "cpu" in payload["machine"]
    assert off["server"]["mode"] == "process" and off["server"]["dtype"] == "float32"
    assert (off["speculative_method"], ngram["speculative_method"]) == ("none", "ngram")
    for run in (off, ngram):
        assert [k for k in VLLM_KEYS if k not in run] == []
        assert run["completed"] == 12 and run["failed"] == 0 and run["request_rate"] == 20
        assert run["request_goodput"] == pytest.approx(run["request_throughput"])  # a 60 s TTFT objective
        assert run["total_output_tokens"] == 6 * 16 + 6 * 10  # greedy, float32: no EOS on these prompts
        for ttft, e2el, itl in zip(run["ttfts"], run["latencies"], run["itls"]):
            assert 0 < ttft <= e2el
            assert sum(itl) == pytest.approx(e2el - ttft, abs=0.05)
    assert [k for k in SPEC_KEYS if k in off] == []  # speculation off: absent, not zero
    assert [k for k in SPEC_KEYS if k not in ngram] == []
    assert ngram["speculation"] == "ngram k=3" and ngram["spec_decode_num_drafts"] > 0
    assert 1 < ngram["spec_decode_acceptance_length"] <= 4
    per_pos = ngram["spec_decode_per_position_acceptance_rates"]
    assert 0 < len(per_pos) <= 3 and all(0 <= a <= 1 for a in per_pos)
    assert per_pos == sorted(per_pos, reverse=True)  # accepting position j needs every one before it
    assert "Serving Benchmark Result" in out and "| ngram k=3 | 20.0 | 12/12 |" in out
    assert sorted(p.name for p in plots.iterdir()) == ["acceptance_per_position.png", "latency_cdfs.png"]


def test_a_server_that_cannot_start_is_a_usage_error(capsys, repetitive_set):
    code, _out, err = bench(capsys, "serve", "--model", "/no/such/model", "-q", "--workload",
                            str(repetitive_set))
    assert code == 2
    assert err.startswith("specserve: error: the benchmark's server did not start: /no/such/model: no such")
    assert err.count("\n") == 1


def test_serving_benchmark_against_a_url_with_a_rate_sweep(capsys, tiny_model_dir, tmp_path):
    config = EngineConfig(model=str(tiny_model_dir("llama")), dtype="float32", block_size=4,
                          num_kv_blocks=512, max_model_len=256)
    result_path, plots = tmp_path / "result.json", tmp_path / "plots"
    with InProcessServer(config) as server:
        code, _out, err = bench(capsys, "serve", "--base-url", server.url, "--model", str(tiny_model_dir("llama")),
                               "--workload", "random", "--input-len", "12", "--output-len", "6",
                               "--ignore-eos", "--num-prompts", "6", "--request-rate-sweep", "50,inf",
                               "--max-concurrency", "3", "-q", "--result-json", str(result_path),
                               "--plot-dir", str(plots))
    assert code == 0, err
    runs = json.loads(result_path.read_text())["runs"]
    assert [r["request_rate"] for r in runs] == [50, "inf"]
    for run in runs:
        assert run["completed"] == 6 and run["total_input_tokens"] == 6 * 12
        assert run["total_output_tokens"] == 6 * 6
        assert run["max_concurrent_requests"] <= 3 and run["max_concurrency"] == 3
        assert "ttfts" not in run  # per-request lists only with --save-detailed
    assert (plots / "rate_sweep.png").stat().st_size > 0


def test_offline_benchmark_and_speculation_sweep(capsys, tiny_model_dir, repetitive_set, tmp_path):
    model = str(tiny_model_dir("llama"))
    code, out, err = bench(capsys, "offline", "--model", model, *ENGINE, "-q", "--workload",
                           str(repetitive_set), "--num-prompts", "4", "--output-len", "8",
                           "--max-concurrency", "2", "--result-json", str(tmp_path / "offline.json"))
    assert code == 0, err
    run = json.loads((tmp_path / "offline.json").read_text())
    assert run["completed"] == 4 and run["total_output_tokens"] == 2 * 8 + 2 * 10  # a line's own max_tokens
    assert 0 < run["mean_ttft_ms"] <= run["mean_e2el_ms"] and run["max_concurrent_requests"] <= 2
    # A rate sweep over speculation settings, each engine loaded once, without HTTP.
    code, out, err = bench(capsys, "offline", "--model", model, *ENGINE, "-q", "--workload",
                           str(repetitive_set), "--num-prompts", "4", "--output-len", "8",
                           "--speculation", "none,ngram:3:adaptive", "--request-rate-sweep", "50,inf",
                           "--result-json", str(tmp_path / "sweep_offline.json"),
                           "--plot-dir", str(tmp_path / "plots"))
    assert code == 0, err
    runs = json.loads((tmp_path / "sweep_offline.json").read_text())["runs"]
    assert [(r["speculation"], r["request_rate"]) for r in runs] == [
        ("spec off", 50.0), ("ngram k=3 adaptive", 50.0), ("spec off", "inf"), ("ngram k=3 adaptive", "inf")]
    ran = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Run:")]
    assert ran == ["spec off @ 50 req/s", "ngram k=3 adaptive @ 50 req/s",  # each rate starts with the next
                   "ngram k=3 adaptive @ inf req/s", "spec off @ inf req/s"]
    assert all(r["completed"] == 4 for r in runs)
    assert "spec_decode_draft_lengths" not in runs[0]
    for run in runs[1::2]:  # the controller's choices, counted per run
        assert sum(run["spec_decode_draft_lengths"].values()) >= run["total_output_tokens"] / 4
        assert set(run["spec_decode_draft_lengths"]) <= {"0", "1", "2", "3"}
    assert "| ngram k=3 adaptive | inf | 4/4 |" in out and "Draft length chosen" in out
    assert (tmp_path / "plots" / "rate_sweep.png").stat().st_size > 0
    code, out, err = bench(capsys, "spec-sweep", "--model", model, *ENGINE, "-q", "--workload",
                           str(repetitive_set), "--num-prompts", "2", "--output-len", "8", "--ks", "1,2",
                           "--concurrency", "1,2", "--result-json", str(tmp_path / "sweep.json"),
                           "--plot", str(tmp_path / "sweep.png"))
    assert code == 0, err
    rows = json.loads((tmp_path / "sweep.json").read_text())["rows"]
    assert [(r["concurrency"], r["drafter"], r["k"]) for r in rows] == [
        (1, "off", None), (1, "ngram", 1), (1, "ngram", 2), (2, "off", None), (2, "ngram", 1), (2, "ngram", 2)]
    assert all(r["same_as_off"] == "2/2" for r in rows)  # float32 greedy: lossless
    assert rows[0]["speedup"] == 1.0 and all(r["speedup"] > 0 for r in rows)
    assert "| 2 | ngram | 2 |" in out and (tmp_path / "sweep.png").stat().st_size > 0


def test_offline_rounds_take_turns_and_report_each_setting_against_off(capsys, tiny_model_dir, repetitive_set,
                                                                        tmp_path):
    """``--rounds 2``: every rate runs twice, each round and rate starting with another
    setting; each speculative run is reported against speculation off's run of the same
    round and rate, round by round and as their median."""
    model = str(tiny_model_dir("llama"))
    code, out, err = bench(capsys, "offline", "--model", model, *ENGINE, "-q", "--workload",
                           str(repetitive_set), "--num-prompts", "4", "--output-len", "8",
                           "--speculation", "none,ngram:3:adaptive", "--request-rate-sweep", "50,inf",
                           "--rounds", "2", "--result-json", str(tmp_path / "rounds.json"))
    assert code == 0, err
    runs = json.loads((tmp_path / "rounds.json").read_text())["runs"]
    assert [(r["speculation"], r["request_rate"], r["round"]) for r in runs] == [
        (s, rate, n) for n in (1, 2) for rate in (50.0, "inf") for s in ("spec off", "ngram k=3 adaptive")]
    ran = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Run:")]
    assert [r.split(" @ ")[0] + r.rsplit(",", 1)[1] for r in ran] == [
        "spec off round 1", "ngram k=3 adaptive round 1", "ngram k=3 adaptive round 1", "spec off round 1",
        "ngram k=3 adaptive round 2", "spec off round 2", "spec off round 2", "ngram k=3 adaptive round 2"]
    off = {(r["round"], r["request_rate"]): r["output_throughput"] for r in runs if r["speculation"] == "spec off"}
    ratios = {}
    for r in runs:
        if r["speculation"] != "spec off":
            assert r["output_throughput_vs_off"] == pytest.approx(
                r["output_throughput"] / off[r["round"], r["request_rate"]])
            ratios.setdefault(r["request_rate"], []).append(r["output_throughput_vs_off"])
        else:
            assert "output_throughput_vs_off" not in r
    for rate, (first, second) in ratios.items():
        assert (f"| ngram k=3 adaptive | {rate} | {first:.2f}x, {second:.2f}x | {(first + second) / 2:.2f}x |"
                in out)
    assert "| spec off (round 2) | inf |" in out


def test_the_shared_prefix_workloads_and_the_prefix_cache_hit_rate(capsys, chat_model_dir, tmp_path):
    chat_model = str(chat_model_dir)
    """A later turn of a chat is sent once the answer it continues has come, with that
    answer in its prompt; the benchmarks report the prefix cache's hit rate."""
    shared = load_workload("shared-prefix", 5, output_len=5)
    assert len({json.dumps(r.messages[0]) for r in shared}) == 1 and len({r.messages[1]["content"] for r in shared}) == 5
    assert shared[0].messages[0]["role"] == "system" and len(shared[0].messages[0]["content"]) > 4000
    requests = load_workload("multi-turn", 6, output_len=5)
    assert [r.follows for r in requests] == [None, None, 0, 1, 2, 3]
    llm = LLM(chat_model, dtype="float32", block_size=4, num_kv_blocks=1024)
    run = run_offline(llm.engine, requests, progress=False, ignore_eos=True)
    engine, outs = llm.engine, run["output_token_ids"]
    third = [*requests[0].messages, {"role": "assistant", "content": llm.tokenizer.decode(outs[0])},
             *requests[2].messages]
    assert run["_detail"]["input_lens"][2] == len(engine.apply_chat_template(third))
    assert 30 < run["prefix_cache_hit_rate"] < 100  # later turns find earlier ones
    code, out, err = bench(capsys, "offline", "--model", chat_model, *ENGINE, "-q", "--workload", "multi-turn",
                           "--num-prompts", "6", "--output-len", "4", "--max-concurrency", "2",
                           "--speculation", "none,ngram:2", "--result-json", str(tmp_path / "offline.json"))
    assert code == 0, err
    for result in json.loads((tmp_path / "offline.json").read_text())["runs"]:
        assert result["completed"] == 6 and result["prefix_cache_hit_rate"] > 30
    assert "Prefix cache hit rate (%):" in out
    code, out, err = bench(capsys, "serve", "--model", chat_model, *ENGINE, "-q", "--server-mode", "thread",
                           "--workload", "multi-turn", "--num-prompts", "6", "--output-len", "4",
                           "--ignore-eos", "--save-detailed", "--result-json", str(tmp_path / "serve.json"))
    assert code == 0, err
    served = json.loads((tmp_path / "serve.json").read_text())  # one run: the run itself
    assert served["completed"] == 6 and served["prefix_cache_hit_rate"] > 30
    lens = served["input_lens"]  # each later turn holds the answer before it
    assert all(lens[i + 2] > lens[i] + 4 for i in range(4))
    assert "Prefix cache hit rate (%):" in out


# ---------------------------------------------------------------------- the command line
def test_engine_args_rebuild_the_config():
    from specserve.cli import ENGINE_FLAGS, build_parser

    config = EngineConfig(model="/m", dtype="float32", max_model_len=256, kv_cache_memory_gib=0.5,
                          speculative_method="ngram", num_speculative_tokens=3, speculative_adaptive=True)
    args = build_parser().parse_args(["serve", *engine_args(config)])
    assert EngineConfig(**{k: getattr(args, k) for k in ENGINE_FLAGS}) == config


def test_bench_help(capsys):
    done = subprocess.run([sys.executable, "-m", "specserve.cli", "bench", "serve", "--help"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "--request-rate-sweep" in done.stdout and "--goodput" in done.stdout
    for argv, flag in ((["bench", "--help"], "spec-sweep"), (["bench", "offline", "--help"], "--max-concurrency"),
                       (["bench", "spec-sweep", "--help"], "--ks")):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 0 and flag in capsys.readouterr().out


def test_bad_flag_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "serve", "--no-such-flag"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["serve", "--request-rate", "0"], "request rates must be > 0"),
    (["serve", "--request-rate-sweep", "1,fast"], "bad request rate"),
    (["serve", "--request-rate", "1", "--request-rate-sweep", "1,2"], "not both"),
    (["serve", "--burstiness", "0"], "burstiness"),
    (["serve", "--goodput", "latency:5"], "goodput"),
    (["serve", "--speculation", "eagle"], "--speculation"),
    (["serve", "--speculation", "ngram:2", "--base-url", "http://127.0.0.1:9"], "--base-url"),
    (["serve", "--base-url", "http://127.0.0.1:9", "--workload", "chat"], "cannot reach"),
    (["serve", "--workload", "/no/such.jsonl"], "No such file"),
    (["serve", "--workload", "random", "--model", "/no/such/model"], "no such file or directory"),
    (["serve", "--max-num-seqs", "0", "--workload", "chat"], "max_num_seqs"),
    (["serve", "--num-prompts", "0"], "--num-prompts"),
    (["serve", "--metric-percentiles", "99,100"], "percentiles"),
    (["offline", "--rounds", "0"], "--rounds"),
    (["spec-sweep", "--drafters", "eagle"], "unknown drafter"),
    (["spec-sweep", "--ks", "0"], "--ks"),
])
def test_bad_input_is_one_line_exit_2(capsys, argv, message):
    code, _out, err = bench(capsys, *argv, "-q")
    assert code == 2, err
    assert err.startswith("specserve: error:") and message in err and err.count("\n") == 1
