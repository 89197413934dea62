"""The adaptive controller's host time under a queue, where it lands: between two verify
passes (``Speculator.plan``, which a GPU waits for) or during one (``Speculator.learn``).

Two engines of the default model with its built-in draft, ``draft_stopping="plan"`` (the
GPU's stopping; the CPU's default stops by confidence and keeps no estimates), at most 64
requests running, ``--requests`` held-out chat prompts with the chat template submitted at
once with staggered lengths (16..111 new tokens), greedy. ``settled in learn``: this
checkout, whose ``Speculator.learn`` applies the queued outcomes to the estimates
(``DraftLengthController.settle``); ``applied at the plan``: the same with ``settle`` a
no-op, so they are applied at the next plan, as before. The engines take turns, round
after round, in one process (A B, B A, ...). Per round: steps, the host time per step in ``plan`` and
``learn``, and the fresh plans (``DraftLengthController._plan``) made in each, their
count and mean time.

``--stand N``: plans with drafts stand N steps at least (``draft_replan``), as they do on
a GPU where a plan costs several times its share of a step (up to 16 there).

    python host_plan.py [--requests 128] [--rounds 3] [--stand 16]
"""
import argparse
import collections
import time

from specserve import LLM, SamplingParams
from specserve.bench.prompt_sets import chat_prompts, held_out_prompts
from specserve.spec import controller, speculator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stand", type=int, default=0, help="steps a plan with drafts stands at least (0: as set)")
    args = parser.parse_args()
    where, totals = [None], collections.defaultdict(lambda: [0, 0.0])

    def timed(owner, name, label, inside=False):
        inner = getattr(owner, name)

        def run(*a, **kw):
            outer = where[0]
            if inside:
                where[0] = label
            began = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                entry = totals[label if inside else f"{label} in {outer}"]
                entry[0] += 1
                entry[1] += time.perf_counter() - began
                where[0] = outer
        setattr(owner, name, run)

    timed(speculator.Speculator, "plan", "plan", inside=True)
    timed(speculator.Speculator, "learn", "learn", inside=True)
    timed(controller.DraftLengthController, "_plan", "fresh plan")
    common = {"draft_stopping": "plan", "speculative_method": "draft_model", "max_num_seqs": 64,
              "max_model_len": 2048}
    engines = {"settled in learn": LLM(**common), "applied at the plan": LLM(**common)}
    engines["applied at the plan"].engine.speculator.controller.settle = lambda: None
    if args.stand:
        for llm in engines.values():
            llm.engine.speculator.controller.draft_replan = args.stand
    tokenizer = engines["settled in learn"].engine.tokenizer
    prompts = chat_prompts(tokenizer, held_out_prompts("chat", 40))
    prompts = (prompts * (args.requests // len(prompts) + 1))[:args.requests]
    params = [SamplingParams(temperature=0, max_tokens=16 + (i * 37) % 96) for i in range(args.requests)]
    for llm in engines.values():  # warm-up
        llm.generate(prompts[:4], params[:4], use_tqdm=False)
    print("| round | engine | steps | tokens/s | plan us/step | learn us/step | fresh plans in plan "
          "(count, us each) | fresh plans in learn (count, us each) |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for rnd in range(args.rounds):
        order = list(engines.items())
        for name, llm in order if rnd % 2 == 0 else order[::-1]:  # A B, B A, ...
            totals.clear()
            llm.engine.kv.reset_prefix_cache()
            began = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - began
            steps = totals["plan"][0]
            tokens = sum(len(o.token_ids) for o in outs)
            fresh = [totals[f"fresh plan in {w}"] for w in ("plan", "learn")]
            print(f"| {rnd + 1} | {name} | {steps} | {tokens / seconds:.0f} | {1e6 * totals['plan'][1] / steps:.0f} "
                  f"| {1e6 * totals['learn'][1] / steps:.0f} | "
                  + " | ".join(f"{n}, {1e6 * t / max(n, 1):.0f}" for n, t in fresh) + " |", flush=True)


if __name__ == "__main__":
    main()
