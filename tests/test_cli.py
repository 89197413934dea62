"""`specserve` CLI: streaming generate, --json, and one-line errors with exit code 2."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specserve import __version__
from specserve.cli import main

TINY_ARGS = ["--num-kv-blocks", "64", "--block-size", "4", "-q"]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and __version__ in capsys.readouterr().out


def test_generate_json_and_stream_agree(capsys, tiny_model_dir):
    model = str(tiny_model_dir("llama"))
    code, out, err = run(capsys, "generate", "def step(self):", "--model", model, "--max-tokens", "7",
                         "--ignore-eos", "--json", *TINY_ARGS)
    assert code == 0
    result = json.loads(out)
    assert result["num_output_tokens"] == 7 and result["finish_reason"] == "length"
    code, out, err = run(capsys, "generate", "def step(self):", "--model", model, "--max-tokens", "7",
                         "--ignore-eos", *TINY_ARGS)
    assert code == 0 and out == result["text"] + "\n"
    assert "7 tokens" in err and "tokens/s" in err
    assert "acceptance length" not in err  # speculation off drafts nothing (#35)


@pytest.mark.parametrize("argv, message", [
    (["--model", "/no/such/model"], "no such file or directory"),
    (["--temperature", "-1"], "temperature"),
    (["--presence-penalty", "3"], "presence_penalty"),
    (["--speculative-method", "draft_model", "--draft-model", "/no/such/draft"],
     "--draft-model /no/such/draft: no such file"),
    (["--max-num-seqs", "0"], "max_num_seqs"),
    (["--device", "tpu"], "device"),
])
def test_bad_input_is_one_line_exit_2(capsys, tiny_model_dir, argv, message):
    argv = ["--model", str(tiny_model_dir("llama"))] + argv if argv[0] != "--model" else argv
    code, out, err = run(capsys, "generate", "hi", *argv, *TINY_ARGS)
    assert code == 2
    assert err.startswith("specserve: error:") and message in err and err.count("\n") == 1


def test_console_script_has_no_traceback(tiny_model_dir):
    done = subprocess.run([sys.executable, "-m", "specserve.cli", "generate", "hi", "--model",
                           str(tiny_model_dir("llama")), "--max-tokens", "0", *TINY_ARGS],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "max_tokens" in done.stderr


@pytest.mark.slow
def test_generate_default_model_end_to_end(default_model_path):
    """The quick start's main job: no --model, chat template applied, streamed to stdout."""
    done = subprocess.run([sys.executable, "-m", "specserve.cli", "generate",
                           "What is the capital of France?", "--max-tokens", "16"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
    assert "SmolLM2-135M-Instruct" in done.stderr and "KV cache" in done.stderr


def test_config_types_are_checked():
    from specserve import EngineConfig

    for bad in (dict(max_model_len="10"), dict(kv_cache_memory_gib="1"), dict(num_kv_blocks=2.5),
                dict(gpu_memory_utilization=None), dict(seed="x"), dict(kv_cache_memory_gib=float("inf")),
                dict(speculative_method="magic"), dict(num_speculative_tokens=-1),
                dict(draft_model="x"), dict(prompt_lookup_min=5)):
        with pytest.raises(ValueError):
            EngineConfig(**bad)


def test_the_draft_length_cap_left_unset_follows_the_device_and_drafter():
    from specserve import EngineConfig
    from specserve.config import (
        DEFAULT_DRAFT_TOKENS,
        PLANNED_GPU_DRAFT_TOKENS,
        default_draft_tokens,
    )

    assert PLANNED_GPU_DRAFT_TOKENS > DEFAULT_DRAFT_TOKENS
    planned = {"method": "draft_model", "adaptive": True, "draft_stopping": "auto", "num_draft_paths": 1,
               "draft_tree_nodes": 0}
    assert default_draft_tokens("cuda", **planned) == PLANNED_GPU_DRAFT_TOKENS
    assert default_draft_tokens("cuda", **{**planned, "draft_stopping": "plan"}) == PLANNED_GPU_DRAFT_TOKENS
    for other in ({"adaptive": False}, {"draft_stopping": "confidence"}, {"method": "ngram"},
                  {"num_draft_paths": 2}, {"draft_tree_nodes": 8}):
        assert default_draft_tokens("cuda", **{**planned, **other}) == DEFAULT_DRAFT_TOKENS, other
    assert default_draft_tokens("cpu", **planned) == DEFAULT_DRAFT_TOKENS

    config = EngineConfig(device="cpu", speculative_method="draft_model")
    assert config.num_speculative_tokens is None and config.max_draft_tokens == DEFAULT_DRAFT_TOKENS
    assert config.speculation_enabled
    assert EngineConfig(device="cpu", speculative_method="draft_model", num_speculative_tokens=7).max_draft_tokens == 7
    assert not EngineConfig(device="cpu", speculative_method="ngram", num_speculative_tokens=0).speculation_enabled


def test_a_failed_generation_exits_1_with_one_line(capsys, tiny_model_dir, monkeypatch):
    from specserve.model_runner import ModelRunner

    def broken(self, *args, **kwargs):
        raise RuntimeError("out of device memory")

    monkeypatch.setattr(ModelRunner, "execute", broken)
    code, out, err = run(capsys, "generate", "hi", "--model", str(tiny_model_dir("llama")), *TINY_ARGS)
    assert code == 1
    assert "specserve: error: generation failed: RuntimeError: out of device memory" in err


def test_config_file_sets_flags_and_command_line_wins(capsys, tiny_model_dir, tmp_path):
    model = str(tiny_model_dir("llama"))
    config = tmp_path / "tuned.yaml"
    config.write_text(f"model: {model}\nmax-tokens: 5\nignore_eos: true\nnum_kv_blocks: 64\n"
                      "block_size: 4\nspeculative_method: ngram\nnum_speculative_tokens: 3\n")
    code, out, _ = run(capsys, "generate", "abc", "--config", str(config), "--json", "-q")
    assert code == 0 and json.loads(out)["num_output_tokens"] == 5
    code, out, _ = run(capsys, "generate", "abc", "--config", str(config), "--json", "-q",
                       "--max-tokens", "3")
    assert code == 0 and json.loads(out)["num_output_tokens"] == 3
    as_json = tmp_path / "tuned.json"
    as_json.write_text(json.dumps({"model": model, "max_tokens": 2, "ignore_eos": True,
                                   "num_kv_blocks": 64, "block_size": 4}))
    code, out, _ = run(capsys, "generate", "abc", "--config", str(as_json), "--json", "-q")
    assert code == 0 and json.loads(out)["num_output_tokens"] == 2


@pytest.mark.parametrize("text, message", [
    ("bogus: 1\n", "unknown setting 'bogus'"),
    ("- a\n- b\n", "must hold a mapping"),
    ("max_tokens: [1\n", "not valid YAML"),
    ("max_tokens: lots\n", "invalid value"),
    ("speculative_method: magic\n", "must be one of"),
    ("cuda_graph_max_tokens: -1\n", "cuda_graph_max_tokens must be an integer >= 0"),
])
def test_bad_config_file_is_a_usage_error(capsys, tmp_path, text, message):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    code, _, err = run(capsys, "generate", "abc", "--config", str(config))
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("value", ["inf", "nan"])
def test_serve_refuses_a_shutdown_timeout_that_is_not_finite(capsys, monkeypatch, value):
    # inf crashed the abort timer at SIGTERM; nan aborted everything at once.
    import specserve.server

    def serve(*_args, **_kwargs):
        raise AssertionError("served with a shutdown timeout that is not finite")

    monkeypatch.setattr(specserve.server, "serve", serve)
    code, _, err = run(capsys, "serve", "--shutdown-timeout", value)
    assert code == 2 and "--shutdown-timeout" in err and err.count("\n") == 1


def test_missing_config_file_is_a_usage_error(capsys, tmp_path):
    code, _, err = run(capsys, "serve", "--config", str(tmp_path / "none.yaml"))
    assert code == 2 and "cannot read config file" in err


@pytest.mark.parametrize("argv, message", [
    (["--num-speculative-tokens", "-1", "--speculative-method", "ngram"], "num_speculative_tokens"),
    (["--max-num-batched-tokens", "0"], "max_num_batched_tokens"),
    (["--speculative-method", "magic"], "invalid choice: 'magic'"),
    (["--max-tokens", "many"], "invalid int value"),
])
def test_bad_flags_are_one_line_exit_2(capsys, tiny_model_dir, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        code = main(["generate", "hi", "--model", str(tiny_model_dir("llama")), *argv, *TINY_ARGS])
        raise SystemExit(code)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.startswith("specserve: error:") and message in err and err.count("\n") == 1


def test_draft_model_with_another_vocabulary_is_refused(capsys, tiny_model_dir, tmp_path):
    from tiny_models import make_hf_model

    other = tmp_path / "draft"
    make_hf_model("llama", vocab_size=300).save_pretrained(other)
    capsys.readouterr()  # drop save_pretrained's progress bar
    code, _, err = run(capsys, "generate", "hi", "--model", str(tiny_model_dir("llama")),
                       "--speculative-method", "draft_model", "--draft-model", str(other), *TINY_ARGS)
    assert code == 2 and "vocabulary" in err and err.count("\n") == 1


def test_generate_equals_the_python_api(capsys, tiny_model_dir):
    from specserve import SamplingParams
    from tiny_models import LLM32

    model = str(tiny_model_dir("llama"))
    code, out, _ = run(capsys, "generate", "def step(self):", "--model", model, "--max-tokens", "9",
                       "--ignore-eos", "--json", "--dtype", "float32", "--no-chat", *TINY_ARGS)
    api = LLM32(model, num_kv_blocks=64, block_size=4).generate(
        "def step(self):", SamplingParams(temperature=0, max_tokens=9, ignore_eos=True), use_tqdm=False)[0]
    assert code == 0 and json.loads(out)["token_ids"] == api.token_ids
    assert json.loads(out)["text"] == api.text
    penalties = dict(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.5, min_tokens=3,
                     bad_words=["self"])
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in penalties.items() if k != "bad_words"] + ["--bad-word", "self"]
    code, out, _ = run(capsys, "generate", "def step(self):", "--model", model, "--max-tokens", "9",
                       "--ignore-eos", "--json", "--dtype", "float32", "--no-chat", *flags, *TINY_ARGS)
    api = LLM32(model, num_kv_blocks=64, block_size=4).generate(
        "def step(self):", SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, **penalties),
        use_tqdm=False)[0]
    assert code == 0 and json.loads(out)["token_ids"] == api.token_ids
