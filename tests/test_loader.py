"""Model resolution, conversion cache and one-line errors."""
from __future__ import annotations

import json
import shutil

import pytest

from tiny_models import LLM32
import torch
from safetensors.torch import load_file, save_file

from specserve.errors import ModelLoadError
from specserve import loader


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        LLM32(str(tmp_path / "nope"))


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        LLM32(str(tmp_path))


def test_non_gguf_file(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match=".gguf"):
        LLM32(str(path))


def test_unsupported_architecture(tmp_path, tiny_model_dir):
    model = copy_model(tiny_model_dir("llama"), tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unsupported architecture.*LlamaForCausalLM"):
        LLM32(str(model))


def test_corrupt_safetensors(tmp_path, tiny_model_dir):
    model = copy_model(tiny_model_dir("llama"), tmp_path / "m")
    (model / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ModelLoadError, match="corrupt"):
        LLM32(str(model))


def test_missing_tensor(tmp_path, tiny_model_dir):
    model = copy_model(tiny_model_dir("llama"), tmp_path / "m")
    tensors = load_file(model / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, model / "model.safetensors")
    with pytest.raises(ModelLoadError, match="lacks 1 tensors.*qkv_proj"):
        LLM32(str(model))


def test_wrong_shape(tmp_path, tiny_model_dir):
    model = copy_model(tiny_model_dir("llama"), tmp_path / "m")
    tensors = load_file(model / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, model / "model.safetensors")
    with pytest.raises(ModelLoadError, match="model.norm.weight.*shape"):
        LLM32(str(model))


def test_corrupt_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\x01" * 64)
    with pytest.raises(ModelLoadError, match="could not read this GGUF"):
        loader.resolve_model(str(path))
    assert not list((tmp_path / "cache" / "converted").glob("*/model.safetensors"))


def test_hub_id_without_network_is_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="hub could not provide it") as info:
        loader.resolve_model("no-such-org/no-such-model")
    assert "\n" not in str(info.value)


def test_eos_ids_merge_generation_config(tmp_path, tiny_model_dir, tiny_tokenizer):
    model = copy_model(tiny_model_dir("llama"), tmp_path / "m")
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    files = loader.ModelFiles("m", model)
    config = loader.load_hf_config(files)
    assert loader.eos_token_ids(files, config, tiny_tokenizer) == {2, 7}


@pytest.mark.slow
def test_default_model_is_converted_once(default_model_path, monkeypatch):
    """A second start reuses the cached safetensors instead of dequantising again."""
    def fail(*args):
        raise AssertionError("converted twice")

    monkeypatch.setattr(loader, "_write_converted", fail)
    files = loader.resolve_model(None)
    assert files.path == default_model_path
    assert (files.path / "model.safetensors").is_file() and (files.path / "tokenizer.json").is_file()
    config = loader.load_hf_config(files)
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
