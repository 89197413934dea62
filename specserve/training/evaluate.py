"""The trained draft in the engine: held-out acceptance beside the baseline drafters."""
from __future__ import annotations

from pathlib import Path

import torch

from specserve.bench.prompt_sets import held_out_prompts
from specserve.engine import LLM
from specserve.sampling_params import SamplingParams
from specserve.training.data import KINDS, encode_prompt
from specserve.training.runtime import log


def evaluate_in_engine(args, out: Path, device: torch.device) -> dict:
    """Held-out chat and code prompts, greedy, k = 4, all at once: mean acceptance length
    for the trained draft and the baseline drafters."""
    prompts = {kind: held_out_prompts(kind, args.eval_prompts, args.seed) for kind in KINDS}
    methods = {"draft_model": {"draft_model": str(out)}}
    methods.update({m: {} for m in args.eval_baselines.split(",") if m})
    params = SamplingParams(temperature=0, max_tokens=args.eval_max_tokens)
    results = {}
    for method, extra in methods.items():
        # k fixed at 4: an adaptive engine would draft only where it pays on this device.
        llm = LLM(args.target, device=str(device), speculative_method=method, num_speculative_tokens=4,
                  speculative_adaptive=False, max_num_seqs=32,
                  max_model_len=args.max_seq_len + args.eval_max_tokens, **extra)
        tokenizer = llm.tokenizer
        results[method] = {}
        for kind, messages in prompts.items():
            ids = [p for p in (encode_prompt(tokenizer, m) for m in messages) if len(p) <= args.max_seq_len]
            outs = llm.generate(ids, params, use_tqdm=False)
            drafts = sum(o.spec_stats.num_drafts for o in outs)
            accepted = sum(o.spec_stats.num_accepted_tokens for o in outs)
            results[method][kind] = round(1 + accepted / drafts, 3) if drafts else 1.0
        log(f"held-out acceptance length, k = 4, {method}: {results[method]}")
        del llm
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"num_prompts_per_kind": {k: len(v) for k, v in prompts.items()},
            "max_tokens": args.eval_max_tokens, "k": 4, "mean_acceptance_length": results}
