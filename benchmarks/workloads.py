"""Prompt sets that exist offline: code editing built from Python's standard-library
sources, and chat questions written for this project. Each prompt is a user message; the
benchmarks apply the model's chat template.

They live in ``specserve.drafts.prompt_sets`` (with the generated training set and its
held-out split, so draft training can never see them); this module keeps the benchmarks'
names."""
from __future__ import annotations

from specserve.drafts.prompt_sets import (
    CHAT,
    CODE_EDITING,
    WORKLOADS,
    chat_prompts,
    held_out_prompts,
)

__all__ = ["CHAT", "CODE_EDITING", "WORKLOADS", "chat_prompts", "held_out_prompts"]
