"""Where an adaptive engine's extra host time goes: the plan (``draft_stopping=plan``, the
GPU default) or drafting stopped by confidence (``--stopping confidence``, the CPU default)
against a fixed k on the same prompts, with the speculator's, controller's, calibration
map's and stopping rule's methods wrapped by timers, in microseconds per engine step.

Batch 1, the default model and its built-in draft, held-out code and chat prompts with the
chat template, greedy, up to ``--max-tokens`` new tokens, each engine twice in turn. Per
engine: tokens/s, steps, wall time per step, the controller's smoothed plan time and step
time and how many steps its last plan with drafts stood; then each wrapped method's time per
step (calls, time per call). What the adaptive engine spends in ``Speculator.plan``,
``Speculator.record``, ``Speculator.observe`` and ``Speculator.learn`` beyond the fixed
engine's is the controller's host time (and the stopping rule's, inside
``Speculator.propose``); ``learn`` runs inside ``LLMEngine._verify``, while a GPU verifies.

    python benchmarks/adaptive_host_time.py --device cuda [--prompts 6] [--k 4]
    python benchmarks/adaptive_host_time.py --stopping confidence --k 1
"""
from __future__ import annotations

import argparse
import collections
import time

import torch


def wrap(owner, name: str, label: str, totals) -> None:
    """Time every call of ``owner.name`` (a class or module attribute) into ``totals[label]``."""
    inner = getattr(owner, name)

    def timed(*args, **kwargs):
        began = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            entry = totals[label]
            entry[0] += 1
            entry[1] += time.perf_counter() - began

    setattr(owner, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--prompts", type=int, default=6, help="held-out prompts per kind")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="the fixed engine's k")
    parser.add_argument("--stopping", choices=("plan", "confidence"), default="plan",
                        help="the adaptive engine's draft_stopping (its cap: 4)")
    args = parser.parse_args()

    from specserve import LLM, SamplingParams
    from specserve import engine as engine_module
    from specserve.bench.prompt_sets import chat_prompts, held_out_prompts
    from specserve.spec import (
        acceptance,
        calibration,
        controller,
        cost_model,
        speculator,
        stopping,
    )

    totals = collections.defaultdict(lambda: [0, 0.0])
    for owner, name in ((engine_module.LLMEngine, "step"), (engine_module.LLMEngine, "_verify"),
                        (speculator.Speculator, "plan"), (speculator.Speculator, "propose"),
                        (speculator.Speculator, "record"), (speculator.Speculator, "observe"),
                        (speculator.Speculator, "learn"), (speculator.Speculator, "_choose"),
                        (controller.DraftLengthController, "choose"), (controller.DraftLengthController, "_plan"),
                        (controller.DraftLengthController, "observe_step"),
                        (controller.DraftLengthController, "observe_goodput"),
                        (acceptance.AcceptanceEstimates, "apply_pending"), (controller, "plan_draft_lengths"),
                        (cost_model.CostModel, "solve"), (speculator.Speculator, "_calibrate"),
                        (calibration.ConfidenceCalibration, "observe"), (calibration.ConfidenceCalibration, "predict"),
                        (calibration.ConfidenceCalibration, "best_case"), (stopping.DraftStop, "after")):
        wrap(owner, name, f"{getattr(owner, '__name__', '').rpartition('.')[2]}.{name}", totals)
    small = {"gpu_memory_utilization": 0.2} if args.device == "cuda" else {}
    common = dict(device=args.device, max_num_seqs=8, max_model_len=4096, speculative_method="draft_model", **small)
    engines = {args.stopping: LLM(draft_stopping=args.stopping, num_speculative_tokens=4, **common),
               f"k={args.k}": LLM(speculative_adaptive=False, num_speculative_tokens=args.k, **common)}
    sync = torch.cuda.synchronize if engines[args.stopping].engine.device.type == "cuda" else (lambda: None)
    tokenizer = engines[args.stopping].engine.tokenizer
    for kind in ("code", "chat"):
        prompts = chat_prompts(tokenizer, held_out_prompts(kind, args.prompts))
        for llm in engines.values():  # warm-up
            llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
        for name, llm in list(engines.items()) * 2:
            totals.clear()
            sync()
            began, tokens = time.perf_counter(), 0
            for prompt in prompts:
                llm.engine.kv.reset_prefix_cache()
                out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=args.max_tokens),
                                   use_tqdm=False)[0]
                tokens += len(out.token_ids)
            sync()
            seconds = time.perf_counter() - began
            steps = totals["LLMEngine.step"][0]
            ctl = llm.engine.speculator.controller
            stood = max((p.stands for p in ctl._plans.values() if p.draft_lengths), default=0) if ctl else 0
            plan = (f"; plan {ctl._plan_s * 1e6:.0f} us, step {ctl._step_s * 1e6:.0f} us, its last plan with "
                    f"drafts stood {stood} steps" if ctl is not None else "")
            print(f"{kind} {name}: {tokens / seconds:.0f} tokens/s, {steps} steps, "
                  f"{1e6 * seconds / steps:.0f} us a step{plan}")
            print("   " + " ".join(f"{label}={1e6 * t / steps:.0f}us({n},{1e6 * t / max(n, 1):.0f})"
                                   for label, (n, t) in sorted(totals.items(), key=lambda x: -x[1][1])),
                  flush=True)


if __name__ == "__main__":
    main()
