"""Prompt sets that exist offline: code editing built from Python's standard-library
sources, and chat questions written for this project. Each prompt is a user message; the
benchmarks apply the model's chat template.

They live in ``specserve.bench.prompt_sets`` (with the generated training set and its
held-out split, so draft training can never see them); this module keeps the benchmarks'
names."""
from __future__ import annotations

import time
from dataclasses import dataclass

from specserve.bench.prompt_sets import (
    CHAT,
    CODE_EDITING,
    WORKLOADS,
    chat_prompts,
    held_out_prompts,
)

__all__ = ["CHAT", "CODE_EDITING", "WORKLOADS", "ColdRun", "chat_prompts", "drafter_settings", "held_out_prompts",
           "run_cold"]


def drafter_settings(spec: str) -> dict:
    """A benchmark's drafter: a speculative method (``none`` for speculation off), or
    ``draft_model@PATH`` for a draft checkpoint other than the built-in one; options after
    it, each after a ``:`` — ``paths=N`` verifies N draft paths per request
    (``num_draft_paths``), ``tree=N`` a draft tree of N further nodes (``draft_tree_nodes``),
    ``k=N`` drafts N tokens where the benchmark's own k would be used
    (``num_speculative_tokens``), ``q=KIND`` quantizes a draft checkpoint's layers on a CPU
    as KIND (``draft_quantization``: none, Q8_0, Q4_1, Q4_0)."""
    spec, *options = spec.split(":")
    method, _, path = spec.partition("@")
    settings = {"speculative_method": method, **({"draft_model": path} if path else {})}
    names = {"paths": "num_draft_paths", "tree": "draft_tree_nodes", "k": "num_speculative_tokens",
             "q": "draft_quantization"}
    for text in options:
        name, _, value = text.partition("=")
        option = names.get(name)
        if option is None or not value or not (value.isdigit() or name == "q") or option in settings:
            raise SystemExit(f"unknown or repeated drafter option {text!r} (expected paths=N, tree=N, k=N or q=KIND)")
        settings[option] = value if name == "q" else int(value)
    return settings


@dataclass
class ColdRun:
    """One prompt run alone on an engine: its wall time, tokens and what speculation did."""

    seconds: float
    token_ids: list[int]
    drafts: int            # steps that verified drafts
    draft_tokens: int      # draft tokens verified
    accepted: int          # of which accepted
    steps: dict[int, int]  # steps by the k they verified


def run_cold(llm, prompt: str, params) -> ColdRun:
    """Run ``prompt`` alone on ``llm`` with its prefix cache emptied first, so that it pays
    its prompt's processing whatever ran before (settings sharing one engine would
    otherwise find it cached)."""
    # lazy: torch only where a benchmark runs an engine
    import torch

    engine = llm.engine
    before = engine.spec_stats.copy()
    counts = dict(engine.draft_length_counts)
    engine.kv.reset_prefix_cache()
    began = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    after = engine.spec_stats
    return ColdRun(seconds, out.token_ids, after.num_drafts - before.num_drafts,
                   after.num_draft_tokens - before.num_draft_tokens,
                   after.num_accepted_tokens - before.num_accepted_tokens,
                   {j: n - counts.get(j, 0) for j, n in engine.draft_length_counts.items()})
