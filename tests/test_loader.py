"""Model resolution, conversion cache and one-line errors."""
from __future__ import annotations

import json
import shutil

import pytest

from tiny_models import LLM32
import torch
from safetensors.torch import load_file, save_file

from specserve import SamplingParams
from specserve.errors import ModelLoadError
from specserve import loader


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def edited_checkpoint(tiny_model_dir, path, edit):
    """The tiny llama's checkpoint copied to ``path`` with ``edit(tensors)`` applied."""
    model = copy_model(tiny_model_dir("llama"), path)
    tensors = load_file(model / "model.safetensors")
    edit(tensors)
    save_file(tensors, model / "model.safetensors")
    return model


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
    model = edited_checkpoint(tiny_model_dir, tmp_path / "m",
                              lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ModelLoadError, match="lacks 1 tensors.*qkv_proj"):
        LLM32(str(model))


def test_wrong_shape(tmp_path, tiny_model_dir):
    model = edited_checkpoint(tiny_model_dir, tmp_path / "m", lambda t: t.update({"model.norm.weight": torch.ones(3)}))
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


# quantization_config as each library writes it, for schemes that do not run here (those
# that do: tests/test_checkpoint_quant.py), each refused by name and, where the method
# runs in another form, by what differs.
QUANTIZED = {
    "fp8_e5m2": ({"quant_method": "fp8", "fmt": "e5m2", "activation_scheme": "dynamic"},
                 r"quant_method 'fp8' \(fmt 'e5m2'\)\) that specserve does not run \(fmt 'e5m2'"),
    "compressed-tensors int4": ({"quant_method": "compressed-tensors", "format": "pack-quantized",
                                 "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                     "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                                     "symmetric": True}}}},
                                r"quant_method 'compressed-tensors' \(format 'pack-quantized', "
                                r"weights 4-bit int per group\)\) that specserve does not run \(format"),
    "compressed-tensors int8": ({"quant_method": "compressed-tensors", "format": "int-quantized",
                                 "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                     "num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}}}},
                                r"quant_method 'compressed-tensors' \(format 'int-quantized'"),
    "awq gemv": ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv", "zero_point": True},
                 r"quant_method 'awq' \(bits 4\)\) that specserve does not run \(version 'gemv'"),
    "gptq 8-bit": ({"quant_method": "gptq", "bits": 8, "group_size": 128, "desc_act": False},
                   r"quant_method 'gptq' \(bits 8\)\) that specserve does not run \(8 bits"),
    "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
                     r"quant_method 'bitsandbytes'\) that specserve does not run; it runs fp8"),
}


@pytest.mark.parametrize("scheme", sorted(QUANTIZED))
def test_a_quantized_checkpoint_is_refused_by_its_scheme(scheme, tmp_path, tiny_model_dir):
    model = copy_model(tiny_model_dir("llama"), tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    quant, message = QUANTIZED[scheme]
    (model / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    with pytest.raises(ModelLoadError, match=f"a quantized checkpoint \\(config.json's quantization_config: {message}"):
        LLM32(str(model))


def fp8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' FP8 layout: float8_e4m3fn values and one float32 scale per row."""
    scale = weight.abs().amax(dim=1, keepdim=True) / 448
    return (weight / scale).to(torch.float8_e4m3fn), scale.float()


def test_fp8_weights_without_a_config_are_refused_not_cast(tmp_path, tiny_model_dir):
    """The defect: FP8 values with their scales, and no quantization_config, were cast to
    the model's dtype with the scales dropped (weights 448 where they should be 0.3)."""
    name = "model.layers.0.self_attn.q_proj.weight"
    model = edited_checkpoint(tiny_model_dir, tmp_path / "m", lambda t: t.update(
        zip((name, name + "_scale"), fp8_per_channel(t[name]))))
    with pytest.raises(ModelLoadError, match=f"tensor '{name}' is float8_e4m3fn, a quantized layout"):
        LLM32(str(model))


def test_packed_int4_weights_are_refused_by_dtype(tmp_path, tiny_model_dir):
    """AWQ/GPTQ's packed layout (int32 ``qweight``) without its config: named, not 'unexpected'."""
    model = edited_checkpoint(tiny_model_dir, tmp_path / "m", lambda t: t.update(
        {"model.layers.0.mlp.down_proj.qweight": torch.zeros(16, 64, dtype=torch.int32)}))
    with pytest.raises(ModelLoadError, match="'model.layers.0.mlp.down_proj.qweight' is int32, a quantized layout"):
        LLM32(str(model))


def test_a_scale_beside_a_float_weight_is_never_dropped(tmp_path, tiny_model_dir):
    model = edited_checkpoint(tiny_model_dir, tmp_path / "m", lambda t: t.update(
        {"model.layers.0.self_attn.o_proj.weight_scale": torch.ones(64)}))
    with pytest.raises(ModelLoadError, match="unexpected tensor 'model.layers.0.self_attn.o_proj.weight_scale'"):
        LLM32(str(model))


def test_int8_rows_load_whichever_comes_first_the_weight_or_its_scale():
    weight = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    values, scale = loader.quantize_int8_rows(weight)
    state = {"a.weight_scale": scale, "a.weight": values, "b.weight": weight}
    got = loader.dequantize_int8_state(state, "test")
    assert list(got) == ["a.weight", "b.weight"]
    torch.testing.assert_close(got["a.weight"], values.float() * scale[:, None])


def test_pytorch_bin_weights_load_like_safetensors(tmp_path, tiny_model_dir):
    """A checkpoint as ``pytorch_model.bin`` shards with their index (read weights_only)
    gives the same model as its safetensors."""
    model = copy_model(tiny_model_dir("llama"), tmp_path / "m")
    tensors = load_file(model / "model.safetensors")
    (model / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
    for shard, keys in shards.items():
        torch.save({k: tensors[k] for k in keys}, model / shard)
    (model / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}))
    prompt = [[5, 9, 11, 40, 2, 7]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = LLM32(str(tiny_model_dir("llama"))).generate(prompt, params, use_tqdm=False)[0].token_ids
    assert LLM32(str(model)).generate(prompt, params, use_tqdm=False)[0].token_ids == want
    (model / next(iter(shards))).write_bytes(b"not a pickle")
    with pytest.raises(ModelLoadError, match="unreadable pytorch_model-00001-of-00002.bin"):
        LLM32(str(model))


def test_a_model_is_built_without_initializers_and_without_importing_dynamo(tiny_model_dir):
    """Built on the meta device, a model's initializers do nothing (every parameter is then
    loaded or the load refused): on meta tensors they would run torch's reference ops, the
    first of which imports torch._dynamo. Loading leaves torch.nn.init as it was."""
    import subprocess
    import sys

    code = ("import sys, torch; from specserve import LLM; init = dict(vars(torch.nn.init)); "
            f"llm = LLM(model={str(tiny_model_dir())!r}, device='cpu', dtype='float32'); "
            "print('torch._dynamo' in sys.modules, dict(vars(torch.nn.init)) == init, "
            "llm.generate([[5, 6, 7]], __import__('specserve').SamplingParams(temperature=0, max_tokens=3))"
            "[0].token_ids != [])")
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert ran.stdout.split() == ["False", "True", "True"], ran.stderr[-2000:]
