"""Where a step's host time goes with the EAGLE-3 head against the built-in draft: batch 1,
k = 4 fixed, held-out chat prompts, greedy, 128 tokens; each engine twice in turn. The
methods below are wrapped by timers: microseconds per engine step (calls, per call).

    python step_cost.py HEAD_DIR [--device cuda] [--prompts 8]
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # benchmarks/
from adaptive_host_time import wrap  # the same timers


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("head")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--prompts", type=int, default=8)
    args = parser.parse_args()

    from specserve.drafts import eagle, model_drafter

    from specserve import LLM, SamplingParams, model_runner
    from specserve import engine as engine_module
    from specserve.bench.prompt_sets import chat_prompts, held_out_prompts
    from specserve.models import eagle as eagle_models
    from specserve.spec import speculator

    totals = collections.defaultdict(lambda: [0, 0.0])
    for owner, name in ((engine_module.LLMEngine, "step"), (engine_module.LLMEngine, "_verify"),
                        (speculator.Speculator, "propose"), (eagle.EagleDrafter, "propose"),
                        (eagle.EagleDrafter, "_collect"), (eagle.EagleDrafter, "_forward"),
                        (eagle.EagleDrafter, "_feature_rows"), (model_drafter.ModelDrafter, "propose"),
                        (model_drafter.ModelDrafter, "_forward"), (model_drafter.ModelDrafter, "_choose"),
                        (model_drafter.ModelDrafter, "_proposal"), (model_runner.ModelRunner, "execute"),
                        (eagle_models.Eagle3ForCausalLM, "input_features")):
        wrap(owner, name, f"{owner.__name__}.{name}", totals)
    small = {"gpu_memory_utilization": 0.2} if args.device == "cuda" else {}
    common = dict(device=args.device, max_num_seqs=8, max_model_len=4096, speculative_method="draft_model",
                  num_speculative_tokens=4, speculative_adaptive=False, **small)
    engines = {"built-in draft": LLM(**common), "EAGLE-3 head": LLM(draft_model=args.head, **common)}
    first = next(iter(engines.values()))
    sync = torch.cuda.synchronize if first.engine.device.type == "cuda" else (lambda: None)
    prompts = chat_prompts(first.engine.tokenizer, held_out_prompts("chat", args.prompts))
    for llm in engines.values():
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    for name, llm in list(engines.items()) * 2:
        totals.clear()
        sync()
        began, tokens = time.perf_counter(), 0
        for prompt in prompts:
            llm.engine.kv.reset_prefix_cache()
            out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=128), use_tqdm=False)[0]
            tokens += len(out.token_ids)
        sync()
        seconds = time.perf_counter() - began
        steps = totals["LLMEngine.step"][0]
        print(f"{name}: {tokens / seconds:.0f} tokens/s, {steps} steps, {1e6 * seconds / steps:.0f} us a step")
        print("   " + " ".join(f"{label}={1e6 * t / steps:.0f}us({n},{1e6 * t / max(n, 1):.0f})"
                               for label, (n, t) in sorted(totals.items(), key=lambda x: -x[1][1])), flush=True)


if __name__ == "__main__":
    main()
