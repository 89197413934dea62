"""Host work per engine step, counted rather than timed: the Python-level calls (cProfile's
count, builtins included) of one engine step, which do not depend on what else the machine
is doing. Two checkouts compared this way show a change in host work that timings on a
shared machine would drown.

The engine is ``host_overhead.py``'s: a tiny seeded model with the default model's
tokenizer, its forward and LM head stubbed by a near-free function (so a draft model's
proposals are all accepted), the CUDA-graph input path run eagerly; batch 1 and 64,
speculation off, n-gram and a draft model at k = 4. Run it with each checkout's
interpreter and its own ``benchmarks/`` folder (``--tree``):

    python benchmarks/host_calls.py --json after.json
    /tmp/venv_before/bin/python benchmarks/host_calls.py --tree /tmp/before --json before.json
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", default=str(Path(__file__).resolve().parent.parent),
                        help="the checkout whose benchmarks/host_overhead.py builds the engine")
    parser.add_argument("--steps", type=int, default=32, help="counted steps per setting")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(args.tree) / "benchmarks"))
    import host_overhead as ho  # noqa: E402 - the tree's own, found through --tree

    from specserve import SamplingParams

    torch.set_num_threads(2)
    calls = {}
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = ho.tiny_checkpoints(Path(tmp))
        settings = SimpleNamespace(device="cpu", dtype="auto", batches=[1, 64], k=4)
        for method in ("none", "ngram", "draft_model"):
            for batch in (1, 64):
                engine = ho.build_engine(settings, method, target, draft, graphs=True)
                ho.stub_forward(engine)
                params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=16 * args.steps)
                for prompt in ho.prompts_for(engine, batch):
                    engine.add_request(prompt, params)
                sched = engine.scheduler
                while sched.waiting or any(r.num_tokens - r.num_computed_tokens > 1 for r in sched.running):
                    engine.step()  # prefill
                for _ in range(8):  # a steady state
                    engine.step()
                profile = cProfile.Profile()
                profile.enable()
                for _ in range(args.steps):
                    engine.step()
                profile.disable()
                calls[f"{method} b{batch}"] = pstats.Stats(profile).total_calls / args.steps
                print(f"{method:12s} batch {batch:3d}: {calls[f'{method} b{batch}']:9.1f} calls per step",
                      flush=True)
                engine.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps({"tree": args.tree, "calls_per_step": calls}, indent=1) + "\n")


if __name__ == "__main__":
    main()
