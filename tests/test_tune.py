"""``specserve tune``: the grid, pruning, the objectives, and an end-to-end run whose
config file loads back into ``specserve serve``."""
from __future__ import annotations

import json
import math

import pytest
import yaml

from specserve import cli
from specserve.tune import Objectives, Setting, _prune, best_config, score, settings_grid


def row(setting, tps, ttft=10.0, tpot=5.0):
    return {"setting": setting, "output_throughput": tps, "p99_ttft_ms": ttft, "p99_tpot_ms": tpot}


def test_grid_runs_k0_once_per_budget():
    grid = settings_grid(["ngram", "draft_model"], [0, 2, 4], [64, 128])
    assert [s for s in grid if s.k == 0] == [Setting("none", 0, 64), Setting("none", 0, 128)]
    assert len(grid) == 2 + 2 * 2 * 2


def test_grid_tries_draft_paths_only_where_asked():
    grid = settings_grid(["ngram", "draft_model"], [0, 4], [64], {"ngram": [1], "draft_model": [1, 2]})
    assert grid == [Setting("none", 0, 64), Setting("ngram", 4, 64), Setting("draft_model", 4, 64),
                    Setting("draft_model", 4, 64, 2)]
    assert grid[-1].label == "draft_model k=4 x 2 paths, budget 64"
    base = {"model": "m", "speculative_method": "draft_model", "num_draft_paths": 2}
    assert best_config(base, grid[-1])["num_draft_paths"] == 2
    assert "num_draft_paths" not in best_config(base, grid[2])
    assert "num_draft_paths" not in best_config(base, grid[0])


def test_objectives_and_score():
    objectives = Objectives(ttft_ms=100, tpot_ms=10)
    fast_but_late = row(Setting("ngram", 4, 512), 300, ttft=250)
    slower_on_time = row(Setting("ngram", 2, 256), 200, ttft=90)
    assert objectives.misses(fast_but_late) == pytest.approx(1.5)
    assert objectives.misses(slower_on_time) == 0
    assert score(slower_on_time, objectives) > score(fast_but_late, objectives)
    assert Objectives().misses(fast_but_late) == 0
    assert Objectives(tpot_ms=1).misses({"p99_tpot_ms": None}) == math.inf


def test_prune_keeps_what_could_win():
    objectives = Objectives()
    rows = [row(Setting("ngram", k, 128), tps) for k, tps in ((4, 100), (2, 95), (1, 60), (6, 50))]
    kept = _prune(rows, objectives, 0.85)
    assert [r["setting"].k for r in kept] == [4, 2]
    rows = [row(Setting("ngram", k, 128), 100) for k in range(1, 9)]
    assert len(_prune(rows, objectives, 0.85)) == 4  # at most half


def test_best_config_turns_speculation_off_for_k0():
    base = {"model": "m", "speculative_method": "ngram", "num_speculative_tokens": 6, "draft_model": None}
    assert best_config(base, Setting("none", 0, 256)) == {"model": "m", "speculative_method": "none",
                                                          "max_num_batched_tokens": 256}
    assert best_config(base, Setting("ngram", 2, 64))["num_speculative_tokens"] == 2


def test_tune_end_to_end_writes_a_config_serve_loads(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "best.yaml"
    code = cli.main(["tune", "--model", str(tiny_model_dir("llama")), "--workload", "random",
                     "--input-len", "12", "--num-prompts", "8", "--output-len", "6",
                     "--num-speculative-tokens-list", "0,2", "--max-num-batched-tokens-list", "32,64",
                     "--request-rate", "200", "--tpot-slo-ms", "5000", "--dtype", "float32",
                     "--num-kv-blocks", "128", "--block-size", "4", "-q", "--output", str(out),
                     "--result-json", str(tmp_path / "runs.json")])
    printed = capsys.readouterr().out
    assert code == 0 and "| setting |" in printed and "best:" in printed
    runs = json.loads((tmp_path / "runs.json").read_text())
    assert runs and all("_detail" not in run and run["completed"] > 0 for run in runs)
    saved = yaml.safe_load(out.read_text())
    assert saved["max_num_batched_tokens"] in (32, 64)
    assert saved["speculative_method"] in ("none", "ngram")
    parser = cli.build_parser()
    argv = ["serve", "--config", str(out)]
    args = cli._apply_config_file(parser, parser.parse_args(argv), argv)
    assert args.max_num_batched_tokens == saved["max_num_batched_tokens"]
    assert args.model == str(tiny_model_dir("llama"))


@pytest.mark.parametrize("flags, message", [
    (["--num-speculative-tokens-list", "a,b"], "comma-separated integers"),
    (["--max-num-batched-tokens-list", "0"], ">= 1"),
    (["--speculative-methods", "magic"], "unknown drafter"),
    (["--request-rate", "0"], "--request-rate"),
    (["--workload", "nope"], "unknown workload"),
    (["--num-draft-paths-list", "1,3"], "draft paths need draft_model or layerskip"),
])
def test_tune_bad_flags_are_usage_errors(tiny_model_dir, capsys, flags, message):
    code = cli.main(["tune", "--model", str(tiny_model_dir("llama")), "-q", "--num-kv-blocks", "64",
                     "--block-size", "4", *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err


def test_tune_tries_draft_paths_on_the_scheduler_and_saves_the_winner(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """Draft paths vary on one loaded engine (the scheduler's forks) like the budget; the
    winner's count is what the config file says."""
    from specserve import tune as tune_module

    seen, run = [], tune_module._run

    def spy(engines, token_ids, requests, setting, *args):
        result = run(engines, token_ids, requests, setting, *args)
        seen.append((setting.paths, len(engines[setting.method].speculator.paths.forks)))
        return result

    monkeypatch.setattr(tune_module, "_run", spy)
    out = tmp_path / "best.yaml"
    code = cli.main(["tune", "--model", str(tiny_model_dir("llama")), "--workload", "random",
                     "--input-len", "12", "--num-prompts", "4", "--output-len", "6",
                     "--speculative-methods", "layerskip", "--layerskip-layers", "1",
                     "--num-speculative-tokens-list", "2", "--max-num-batched-tokens-list", "64",
                     "--num-draft-paths-list", "1,3", "--dtype", "float32", "--num-kv-blocks", "128",
                     "--block-size", "4", "-q", "--output", str(out)])
    printed = capsys.readouterr().out
    assert code == 0 and "layerskip k=2 x 3 paths, budget 64" in printed
    assert {paths for paths, _ in seen} == {1, 3}
    assert all(forks == paths - 1 for paths, forks in seen)
    saved = yaml.safe_load(out.read_text())
    assert saved.get("num_draft_paths", 1) in (1, 3) and saved["speculative_method"] == "layerskip"
