"""Where a draft-tree step's time goes against a chain's, batch 1, the default model and its
built-in draft: every engine in one process, each run twice in turn over held-out prompts,
with the engine's, speculator's, tree's and drafter's methods wrapped by timers (µs per
step: calls, µs per call). A tree setting "tree=N:k=K:levels=L" sets the draft tree's
expansion passes (``DraftTrees.levels``) after the engine is made; ":engine=E" makes an
engine of k up to E whose requests ask for K (as per_token_drafting.py's engines do).

    python tree_host_time.py --device cuda --prompts 4 --settings "k=3;k=4;tree=10:k=4;tree=10:k=4:levels=0"
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from adaptive_host_time import wrap


def parse(setting: str) -> tuple[dict, int | None, int]:
    """A setting's engine options, its tree's expansion passes (None: the engine's) and its
    requests' k (``engine=K``: an engine of k up to K, as per_token_drafting.py's)."""
    options = dict(part.split("=") for part in setting.split(":"))
    k = int(options["k"])
    config = {"num_speculative_tokens": int(options.get("engine", k)), "speculative_adaptive": False}
    if "tree" in options:
        config["draft_tree_nodes"] = int(options["tree"])
    return config, int(options["levels"]) if "levels" in options else None, k


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--settings", default="k=3;k=4;tree=10:k=4;tree=10:k=4:levels=0")
    args = parser.parse_args()

    from specserve import LLM, SamplingParams, model_runner
    from specserve import engine as engine_module
    from specserve.bench.prompt_sets import chat_prompts, held_out_prompts
    from specserve.drafts import model_drafter
    from specserve.spec import rejection_sampler, speculator, tree

    totals = collections.defaultdict(lambda: [0, 0.0])
    for owner, name in ((engine_module.LLMEngine, "step"), (engine_module.LLMEngine, "_verify"),
                        (speculator.Speculator, "propose"), (speculator.Speculator, "settle_trees"),
                        (tree.DraftTrees, "grow"), (tree.DraftTrees, "settle"), (tree, "choose"),
                        (model_drafter.ModelDrafter, "expand"), (model_drafter.ModelDrafter, "_add_candidates"),
                        (model_drafter.ModelDrafter, "_forward"), (model_drafter.ModelDrafter, "_choose"),
                        (model_runner.ModelRunner, "execute"), (model_runner.ModelRunner, "copy_slots"),
                        (rejection_sampler.RejectionSampler, "sample")):
        if hasattr(owner, name):
            wrap(owner, name, f"{getattr(owner, '__name__', '').rpartition('.')[2]}.{name}", totals)
    small = {"gpu_memory_utilization": 0.15} if args.device == "cuda" else {}
    engines, ks = {}, {}
    for setting in args.settings.split(";"):
        config, levels, ks[setting] = parse(setting)
        llm = LLM(device=args.device, max_num_seqs=8, max_model_len=4096, speculative_method="draft_model",
                  **small, **config)
        if levels is not None:
            llm.engine.speculator.trees.levels = levels
        engines[setting] = llm
    first = next(iter(engines.values())).engine
    sync = torch.cuda.synchronize if first.device.type == "cuda" else (lambda: None)
    print(first.speculator.drafter.describe(), torch.cuda.get_device_name() if first.device.type == "cuda" else "cpu")
    for kind in ("chat", "code"):
        prompts = chat_prompts(first.tokenizer, held_out_prompts(kind, args.prompts))
        for llm in engines.values():  # warm-up
            llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
        for name, llm in list(engines.items()) * 2:
            totals.clear()
            stats = llm.engine.spec_stats.copy()
            sync()
            began, tokens = time.perf_counter(), 0
            for prompt in prompts:
                llm.engine.kv.reset_prefix_cache()
                out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                                            num_speculative_tokens=ks[name]), use_tqdm=False)[0]
                tokens += len(out.token_ids)
            sync()
            seconds = time.perf_counter() - began
            steps = totals["LLMEngine.step"][0]
            drafts = llm.engine.spec_stats.num_drafts - stats.num_drafts
            accepted = llm.engine.spec_stats.num_accepted_tokens - stats.num_accepted_tokens
            print(f"{kind} {name}: {tokens / seconds:.0f} tokens/s, {steps} steps, {1e6 * seconds / steps:.0f} us "
                  f"a step, acceptance length {1 + accepted / max(drafts, 1):.2f}")
            print("   " + " ".join(f"{label}={1e6 * t / steps:.0f}us({n},{1e6 * t / max(n, 1):.0f})"
                                   for label, (n, t) in sorted(totals.items(), key=lambda x: -x[1][1])),
                  flush=True)


if __name__ == "__main__":
    main()
