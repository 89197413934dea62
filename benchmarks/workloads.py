"""Prompt sets that exist offline: code editing built from Python's standard-library
sources, and chat questions written for this project. Each prompt is a user message; the
benchmarks apply the model's chat template.

They live in ``specserve.bench.prompt_sets`` (with the generated training set and its
held-out split, so draft training can never see them); this module keeps the benchmarks'
names."""
from __future__ import annotations

from specserve.bench.prompt_sets import (
    CHAT,
    CODE_EDITING,
    WORKLOADS,
    chat_prompts,
    held_out_prompts,
)

__all__ = ["CHAT", "CODE_EDITING", "WORKLOADS", "chat_prompts", "drafter_settings", "held_out_prompts"]


def drafter_settings(spec: str) -> dict:
    """A benchmark's drafter: a speculative method (``none`` for speculation off), or
    ``draft_model@PATH`` for a draft checkpoint other than the built-in one; options after
    it, each after a ``:`` — ``paths=N`` verifies N draft paths per request
    (``num_draft_paths``), ``tree=N`` a draft tree of N further nodes (``draft_tree_nodes``),
    ``k=N`` drafts N tokens where the benchmark's own k would be used
    (``num_speculative_tokens``)."""
    spec, *options = spec.split(":")
    method, _, path = spec.partition("@")
    settings = {"speculative_method": method, **({"draft_model": path} if path else {})}
    names = {"paths": "num_draft_paths", "tree": "draft_tree_nodes", "k": "num_speculative_tokens"}
    for text in options:
        name, _, value = text.partition("=")
        option = names.get(name)
        if option is None or not value.isdigit() or option in settings:
            raise SystemExit(f"unknown or repeated drafter option {text!r} (expected paths=N, tree=N or k=N)")
        settings[option] = int(value)
    return settings
