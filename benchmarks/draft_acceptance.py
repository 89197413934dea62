"""The trained draft against the other drafters on held-out prompts, default model, in one
run: speculation off, n-gram, layer-skip and the built-in draft model.

Held-out chat and code prompts (``specserve.bench.prompt_sets``: never trained on),
chat template applied, greedy, k = 4, up to ``--max-tokens`` new tokens (EOS ends a
request). Batch 1 runs the prompts one after another; a larger batch runs them together.
The methods take turns chunk by chunk, so load from elsewhere falls on all of them alike.
Reports mean acceptance length (tokens per verify step, as ``spec_stats`` counts it),
tokens/s, speed-up over speculation off, how many verify steps kept a further draft
path's tokens (``draft_model:paths=N``), and how many outputs equal speculation off's
(all in float32; bf16 batched numerics may differ). A method's options
(``workloads.drafter_settings``): ``:paths=N``, ``:tree=N`` (a dynamic draft tree), ``:k=N``
(its own k instead of ``--k``), ``:q=KIND`` (a draft checkpoint's layers quantized as KIND
on a CPU). ``--adaptive`` lets each engine choose k (up to ``--k``)
and whether to verify further paths, as it does by default. Works on CPU and CUDA.

    python benchmarks/draft_acceptance.py [--prompts 8] [--batch 1,8] [--adaptive] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import drafter_settings  # noqa: E402


def machine_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (torch {torch.__version__})"
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return f"{platform.machine()} CPU {model}, {torch.get_num_threads()} threads (torch {torch.__version__})"


def run_all(engines: dict, prompts: list[str], batch: int, max_tokens: int, k: dict) -> dict:
    """Every method on the same prompts, interleaved chunk by chunk so that a burst of load
    elsewhere on a shared machine hits all of them alike. ``k``: per method, its requests'
    k (None: the engine chooses)."""
    from specserve import SamplingParams

    acc = {m: {"tokens": 0, "seconds": 0.0, "drafts": 0, "accepted": 0, "path_wins": 0, "token_ids": []}
           for m in engines}
    for start in range(0, len(prompts), batch):
        chunk = prompts[start:start + batch]
        for method, llm in engines.items():
            params = SamplingParams(temperature=0, max_tokens=max_tokens,
                                    num_speculative_tokens=k[method] if method != "none" else 0)
            before = llm.engine.spec_stats.copy()
            began = time.perf_counter()
            outs = llm.generate(chunk, params, use_tqdm=False)
            if llm.engine.device.type == "cuda":
                torch.cuda.synchronize()
            a = acc[method]
            a["seconds"] += time.perf_counter() - began
            a["tokens"] += sum(len(o.token_ids) for o in outs)
            a["drafts"] += llm.engine.spec_stats.num_drafts - before.num_drafts
            a["accepted"] += llm.engine.spec_stats.num_accepted_tokens - before.num_accepted_tokens
            a["path_wins"] += llm.engine.spec_stats.num_path_wins - before.num_path_wins
            a["token_ids"] += [o.token_ids for o in outs]
    return {m: {"tokens": a["tokens"], "seconds": round(a["seconds"], 3),
                "tokens_per_s": round(a["tokens"] / a["seconds"], 2),
                "acceptance_length": round(1 + a["accepted"] / a["drafts"], 3) if a["drafts"] else None,
                "num_drafts": a["drafts"], "num_path_wins": a["path_wins"], "token_ids": a["token_ids"]}
            for m, a in acc.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts per kind")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--adaptive", action="store_true",
                        help="each engine chooses k up to --k (and draft paths) per request and step")
    parser.add_argument("--batch", default="1", help="comma-separated batch sizes")
    parser.add_argument("--methods", default="none,ngram,layerskip,draft_model",
                        help="comma-separated; draft_model@PATH for a draft other than the built-in one")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--json", default=None, help="write all results here")
    args = parser.parse_args()

    from specserve.bench.prompt_sets import chat_prompts, held_out_prompts

    from specserve import LLM

    methods = args.methods.split(",")
    engines, ks = {}, {}
    for i, method in enumerate(methods):
        # Every engine lives in this process (CUDA), and an engine's share counts what the
        # process holds already: the engines before it.
        share = {"gpu_memory_utilization": 0.8 * (i + 1) / len(methods)}
        settings = drafter_settings(method)
        ks[method] = settings.pop("num_speculative_tokens", args.k)  # (a method's own :k=N)
        engines[method] = LLM(device=args.device, dtype=args.dtype, speculative_adaptive=args.adaptive,
                              num_speculative_tokens=ks[method], max_num_seqs=64, max_model_len=4096,
                              **share, **settings)
    first = engines[methods[0]].engine
    tok, device = first.tokenizer, first.device
    machine, dtype = machine_name(device), str(first.dtype).removeprefix("torch.")
    workloads = {kind: chat_prompts(tok, held_out_prompts(kind, args.prompts)) for kind in ("chat", "code")}
    k = {method: None if args.adaptive else ks[method] for method in methods}
    run_all(engines, workloads["chat"][:1], 1, 8, k)  # warm-up

    rows = []
    for kind, prompts in workloads.items():
        for batch in (int(b) for b in args.batch.split(",")):
            results = run_all(engines, prompts, batch, args.max_tokens, k)
            base = results[methods[0]]
            base_ids = base["token_ids"]
            for method, r in results.items():
                same = sum(a == b for a, b in zip(r.pop("token_ids"), base_ids))
                row = {"workload": kind, "batch": batch, "method": method, **r,
                       "speedup": round(r["tokens_per_s"] / base["tokens_per_s"], 2),
                       "same_as_spec_off": f"{same}/{len(prompts)}"}
                rows.append(row)
                print(json.dumps(row), flush=True)

    described = "; ".join(f"{m}: {e.engine.speculator.drafter.describe()}" for m, e in engines.items()
                          if m.startswith("draft_model"))
    print(f"\nSmolLM2-135M-Instruct on {machine}, {dtype}; held-out prompts ({args.prompts} chat, "
          f"{args.prompts} code), greedy, k = {f'adaptive, at most {args.k}' if args.adaptive else args.k}, "
          f"up to {args.max_tokens} new tokens\n"
          f"{described}\n")
    print("| workload | batch | method | tokens/s | vs off | acceptance length | path wins | same as off |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        al = f"{r['acceptance_length']:.2f}" if r["acceptance_length"] else ""
        method = "speculation off" if r["method"] == "none" else r["method"]
        print(f"| {r['workload']} | {r['batch']} | {method} | {r['tokens_per_s']:.1f} | "
              f"{r['speedup']:.2f}x | {al} | {r['num_path_wins'] or ''} | {r['same_as_spec_off']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "dtype": dtype, "k": args.k, "adaptive": args.adaptive,
                                               "max_tokens": args.max_tokens, "draft": described,
                                               "date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
