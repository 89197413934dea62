"""Draft checkpoints shipped inside the package, each trained for one target model.

A shipped draft stores only its own decoder layers and final norm (bf16 safetensors);
its ``config.json`` declares ``"specserve_draft": {"shares_target_embeddings": true}``, and
the loader then hands it the target's embedding and LM head modules, same storage, so it
costs no memory for them and its file stays small. ``python -m specserve.training`` writes this format.
"""
from __future__ import annotations

from pathlib import Path

from specserve.errors import ModelLoadError
from specserve.loader import DEFAULT_MODEL_NAME, ModelFiles

# Target -> folder beside this file. The key None is the embedded default model.
SHIPPED_DRAFTS: dict[str | None, str] = {None: "smollm2_draft"}


def shipped_draft_for(model: str | None) -> ModelFiles | None:
    """The draft shipped for target ``model`` (None: the embedded default model), if any."""
    folder = SHIPPED_DRAFTS.get(model)
    if folder is None:
        return None
    path = Path(__file__).resolve().parent / folder
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise ModelLoadError(f"the built-in draft for {model or DEFAULT_MODEL_NAME} is missing from "
                             f"{path}: reinstall specserve")
    return ModelFiles(f"{model or DEFAULT_MODEL_NAME} draft (built in)", path)


def is_eagle_head(config) -> bool:
    """Whether a draft checkpoint is an EAGLE-style head (``"kind": "eagle"``): it drafts
    from the target's hidden states (``models/eagle.py``)."""
    return (getattr(config, "specserve_draft", None) or {}).get("kind") == "eagle"


def is_eagle3_head(config) -> bool:
    """Whether a draft checkpoint is an EAGLE-3 head (``models/eagle.py``
    ``Eagle3ForCausalLM``): it reads three of its target's layers."""
    return (getattr(config, "specserve_draft", None) or {}).get("layout") == "eagle3"


def shares_target_embeddings(config) -> bool:
    """Whether a draft checkpoint's config says it takes the target's embeddings and LM head."""
    return bool((getattr(config, "specserve_draft", None) or {}).get("shares_target_embeddings"))


def published_layout(names: list[str]) -> dict | None:
    """The ``specserve_draft`` entries of a published draft head found by its tensor names,
    or None for a checkpoint in our own layouts (``models/eagle.py``):
    - an EAGLE-3 head: ``midlayer.*`` (its first layer), ``fc.weight`` over three target
      layers' states, ``norm``, its own ``lm_head`` and ``d2t``/``t2d``, as the EAGLE
      repository's ``eagle/model/cnets.py`` saves it and vLLM's ``llama_eagle3.py`` loads it;
    - an EAGLE-1/EAGLE-2 head: ``fc.weight`` and ``layers.N.*`` with no ``model.`` prefix,
      as ``eagle/model/cnets.py`` saved it before EAGLE-3.
    (Medusa heads are found before, by ``models/medusa.is_medusa_checkpoint``.)"""
    if any(n.startswith("midlayer.") for n in names):
        return {"kind": "eagle", "layout": "eagle3", "shares_target_embeddings": True}
    if "d2t" in names or "t2d" in names:
        raise ModelLoadError("a draft head with d2t/t2d but no midlayer.*: not a layout specserve knows "
                             "(EAGLE-3 heads store their first layer as midlayer.*)")
    if "fc.weight" in names and not any(n.startswith("model.") for n in names):
        return {"kind": "eagle", "layout": "eagle1", "shares_target_embeddings": True,
                "fc_bias": "fc.bias" in names}
    return None
