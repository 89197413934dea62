"""Drafters, installed as ``specserve.drafts``: one class per way of proposing draft
tokens, all behind the ``Drafter`` protocol (``specserve/spec/drafter.py``);
``build_drafter`` maps the configured method to one.

Under tensor parallelism every drafter runs on rank 0, beside the scheduler. n-gram
lookup is host-only. A draft checkpoint is loaded whole (replicated, not split) on rank
0's GPU: a draft is small enough that splitting it saves little memory and would add an
all-reduce per layer to every one of its k sequential steps, and running it on rank 0
alone needs no broadcast per draft token — the other ranks only take part in the
target's verify pass. Layer-skip drafting runs the target's own (sharded) first layers,
so it goes through the target's runner and its step broadcast like any target pass.
"""
from __future__ import annotations

import copy
import json
import logging

import torch

from specserve.attention import get_backend
from specserve.config import AUTO_DRAFT_QUANTIZATION
from specserve.drafts.eagle import EagleDrafter
from specserve.drafts.medusa import MedusaDrafter
from specserve.drafts.model_drafter import ModelDrafter
from specserve.drafts.ngram import NgramDrafter
from specserve.drafts.shipped import (is_eagle3_head, is_eagle_head, published_layout, shares_target_embeddings,
                                      shipped_draft_for)
from specserve.errors import ModelLoadError, SpecserveError
from specserve.kernels import cpu_ops
from specserve.loader import (build_model, checkpoint_names, load_hf_config, load_tokenizer, quantized_gguf,
                              read_tensors, resolve_model)
from specserve.models.eagle import Eagle3ForCausalLM, EagleForCausalLM, MtpForCausalLM, eagle3_feature_layers
from specserve.models.medusa import HEAD_FILE as MEDUSA_HEAD_FILE
from specserve.models.medusa import is_medusa_checkpoint, load_medusa_heads
from specserve.models.quantized import QuantLinear

logger = logging.getLogger("specserve")


def build_drafter(config, target_model, target_hf_config, target_tokenizer,
                  device: torch.device, dtype: torch.dtype):
    """The drafter for ``config.speculative_method``, or None when speculation is off."""
    if not config.speculation_enabled:
        return None
    return _BUILDERS[config.speculative_method](config, target_model, target_hf_config,
                                               target_tokenizer, device, dtype)


def _ngram(config, *_):
    return NgramDrafter(config.prompt_lookup_max, config.prompt_lookup_min)


def _layerskip(config, target_model, target_hf_config, _tokenizer, device, dtype):
    total = target_hf_config.num_hidden_layers
    layers = config.layerskip_layers or max(1, total // 4)
    if layers >= total:
        raise SpecserveError(f"layerskip_layers must be below the target's {total} layers, got {layers}")
    return ModelDrafter("layerskip", target_model, config, device, dtype, num_layers=layers,
                        shares_target_cache=True)


def _draft_model(config, target, target_hf_config, target_tokenizer, device, dtype):
    """A draft checkpoint: the one named, else the draft shipped for this target."""
    if config.draft_model is not None:
        try:
            files = resolve_model(config.draft_model)
        except ModelLoadError as exc:  # say which flag named it: --model may be fine
            raise ModelLoadError(f"--draft-model {exc}") from None
    else:
        files = shipped_draft_for(config.model)
        if files is None:
            raise SpecserveError("speculative_method 'draft_model' needs a draft checkpoint "
                                 "(--draft-model); only the embedded default model has one built in")
    if is_medusa_checkpoint(files.path):
        _no_draft_quantization(config, files, "Medusa heads")
        return _medusa(files, config, target_hf_config, device, dtype)
    draft_config = load_hf_config(files, draft=True)
    found = published_layout(checkpoint_names(files))
    if found is not None:
        draft_config.specserve_draft = {**(getattr(draft_config, "specserve_draft", None) or {}), **found}
    if draft_config.vocab_size != target_hf_config.vocab_size:
        raise SpecserveError(f"draft model {files.name} has a vocabulary of {draft_config.vocab_size} "
                             f"tokens, the target {target_hf_config.vocab_size}: they must share one")
    if any((files.path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        if load_tokenizer(files).get_vocab() != target_tokenizer.get_vocab():
            raise SpecserveError(f"draft model {files.name} uses a different tokenizer "
                                 "vocabulary from the target's")
    shared = None
    if shares_target_embeddings(draft_config):
        if target.tp.size > 1:
            raise SpecserveError(f"draft model {files.name} shares the target's embeddings and LM "
                                 "head, which tensor parallelism splits over the ranks; use a draft "
                                 "with its own, or speculative_method ngram or layerskip")
        if draft_config.hidden_size != target_hf_config.hidden_size:
            raise SpecserveError(f"draft model {files.name} shares its target's embeddings but has "
                                 f"hidden size {draft_config.hidden_size}, the target "
                                 f"{target_hf_config.hidden_size}: it was trained for another model")
        shared = {"model.embed_tokens": target.model.embed_tokens, "lm_head": target.lm_head}
        if is_eagle3_head(draft_config):  # its LM head is its own, over its draft vocabulary
            del shared["lm_head"]
    # Never the deterministic kernels: a draft's numerics only change which tokens are
    # proposed, never the output, which the target's verification decides alone.
    backend = get_backend(config.attention_backend, device)
    if is_eagle_head(draft_config):
        _no_draft_quantization(config, files, "EAGLE heads")
        if shared is None:
            raise SpecserveError(f"draft model {files.name} is an EAGLE head without "
                                 "shares_target_embeddings: it must use the target's embeddings")
        if not is_eagle3_head(draft_config):
            model = build_model(files, draft_config, dtype, device, backend, shared_modules=shared,
                                model_class=EagleForCausalLM)
            _restrict_vocab(model, files)
            return EagleDrafter(model, config, device, dtype)
        layers = eagle3_feature_layers(draft_config, target_hf_config.num_hidden_layers)
        model = build_model(files, draft_config, dtype, device, backend, shared_modules=shared,
                            model_class=Eagle3ForCausalLM)
        _restrict_vocab(model, files)
        return EagleDrafter(model, config, device, dtype, feature_layers=layers)
    from_blocks = quantized_gguf(files, "auto", device)
    quantize = _draft_quantization(config, target, files, from_blocks, device)
    try:
        model = build_model(files, draft_config, dtype, device, backend, shared_modules=shared,
                            quantized=from_blocks, quantize=quantize)
    except ModelLoadError as exc:
        if config.draft_quantization != "auto" or quantize is None:
            raise
        logger.info("draft model %s runs unquantized: %s", files.name, exc)
        model = build_model(files, draft_config, dtype, device, backend, shared_modules=shared)
    _restrict_vocab(model, files)
    return ModelDrafter("draft_model", model, config, device, dtype)


def _draft_quantization(config, target, files, from_blocks: bool, device: torch.device) -> str | None:
    """The GGUF kind a draft checkpoint's float linears are quantized to at load
    (``EngineConfig.draft_quantization``), or None. ``auto``: the draft follows its target,
    quantized where the target runs from quantized weights on a CPU (the default model's
    Q4_1 file), so that a draft step reads a few bits per weight, not 16, and runs one C++
    call per layer. A kind named outright is refused in one line where it cannot apply."""
    choice = config.draft_quantization
    if choice == "none" or from_blocks:
        if from_blocks and choice not in ("auto", "none"):
            raise SpecserveError(f"draft_quantization {choice}: draft model {files.name} is a GGUF file run from "
                                 "its own blocks; quantizing at load applies to float checkpoints")
        return None
    runs_here = device.type == "cpu" and cpu_ops.available()
    if choice == "auto":
        target_quantized = any(isinstance(m, QuantLinear) for m in target.modules())
        return AUTO_DRAFT_QUANTIZATION if runs_here and target_quantized else None
    if not runs_here:
        where = f"on {device.type}" if device.type != "cpu" else "here: the C++ CPU kernels are unavailable (see the log)"
        raise SpecserveError(f"draft_quantization {choice} runs the draft on the C++ CPU kernels, which it "
                             f"cannot {where}; use 'none' or 'auto'")
    return choice


def _no_draft_quantization(config, files, kind: str) -> None:
    if config.draft_quantization not in ("auto", "none"):
        raise SpecserveError(f"draft_quantization {config.draft_quantization}: draft model {files.name} holds "
                             f"{kind}, which run unquantized; quantizing at load applies to draft models")


def _medusa(files, config, target_hf_config, device, dtype):
    """Medusa heads over the target's final hidden states (``models/medusa.py``)."""
    tensors = None if (files.path / MEDUSA_HEAD_FILE).is_file() else read_tensors(files)
    heads = load_medusa_heads(files.name, files.path, tensors, target_hf_config.hidden_size,
                              target_hf_config.vocab_size, dtype, device)
    return MedusaDrafter(heads, config, device, dtype)


def _mtp(config, target, target_hf_config, _tokenizer, device, dtype):
    """The target checkpoint's own multi-token-prediction layer as its draft (MiMo's
    ``model.mtp_layers.0``; ``models/eagle.py`` ``MtpForCausalLM``), drafting from the
    target's final hidden states as an EAGLE head does, with the target's embeddings and
    LM head."""
    files = resolve_model(config.model)
    layers = getattr(target_hf_config, "num_nextn_predict_layers", 0) or 0
    if not target.mtp_prefix or layers < 1:
        raise SpecserveError(f"speculative_method 'mtp' drafts with the multi-token-prediction layers a target "
                             f"checkpoint carries (MiMo's model.mtp_layers); {files.name} has none")
    if files.gguf is not None:
        raise SpecserveError(f"speculative_method 'mtp': {files.name} is a GGUF file, which carries no MTP layers")
    if target.tp.size > 1:
        raise SpecserveError("speculative_method 'mtp' shares the target's embeddings and LM head, which "
                             "tensor parallelism splits over the ranks")
    draft_config = copy.deepcopy(target_hf_config)
    draft_config.num_hidden_layers = 1
    if getattr(draft_config, "layer_types", None):
        draft_config.layer_types = draft_config.layer_types[:1]
    draft_config.specserve_draft = {"kind": "eagle", "layout": "mtp", "input_norms": True,
                                    "shares_target_embeddings": True}
    shared = {"model.embed_tokens": target.model.embed_tokens, "lm_head": target.lm_head}
    model = build_model(files, draft_config, dtype, device, get_backend(config.attention_backend, device),
                        shared_modules=shared, model_class=MtpForCausalLM)
    drafter = EagleDrafter(model, config, device, dtype)
    drafter.name = "mtp"
    return drafter


def _quantized(config, target, target_hf_config, _tokenizer, device, dtype):
    """The target drafting for itself from a quantized copy of its weights: a GGUF's own
    blocks where the target came from one (it then runs dequantised itself), else its
    linear layers quantized to Q4_1 at load. It shares the target's embeddings, has its
    own KV cache, and reads 6 to 12 bits per weight a draft step instead of 16."""
    if device.type != "cpu":
        raise SpecserveError("speculative_method 'quantized' runs on the CPU (its kernels are the C++ CPU kernels)")
    if target.tp.size > 1:
        raise SpecserveError("speculative_method 'quantized' runs without tensor parallelism")
    files = resolve_model(config.model)
    shared = {"model.embed_tokens": target.model.embed_tokens}
    backend = get_backend(config.attention_backend, device)
    from_blocks = quantized_gguf(files, "auto", device)
    try:
        model = build_model(files, target_hf_config, dtype, device, backend, shared_modules=shared,
                            quantized=from_blocks, quantize=None if from_blocks else "Q4_1")
    except ModelLoadError as exc:
        raise SpecserveError(f"speculative_method 'quantized': {exc}") from None
    return ModelDrafter("quantized", model, config, device, dtype)


def _restrict_vocab(model, files) -> None:
    """A checkpoint's ``draft_vocab.json`` (token ids, written by ``python -m
    specserve.training --draft-vocab``): the draft proposes among those only."""
    path = files.path / "draft_vocab.json"
    if not path.is_file():
        return
    try:
        ids = torch.tensor(json.loads(path.read_text()), dtype=torch.int64)
    except (ValueError, TypeError) as exc:
        raise SpecserveError(f"draft model {files.name}: draft_vocab.json is not a list of token ids ({exc})") from None
    if ids.dim() != 1 or not len(ids) or int(ids.min()) < 0 or int(ids.max()) >= model.config.vocab_size:
        raise SpecserveError(f"draft model {files.name}: draft_vocab.json must list token ids below "
                             f"{model.config.vocab_size}")
    if not model.restrict_vocab(ids):
        logger.warning("draft model %s: its draft vocabulary needs the LM head's weights, which are "
                       "prepacked here; drafting over the whole vocabulary", files.name)


_BUILDERS = {"ngram": _ngram, "layerskip": _layerskip, "draft_model": _draft_model, "quantized": _quantized,
             "mtp": _mtp}
