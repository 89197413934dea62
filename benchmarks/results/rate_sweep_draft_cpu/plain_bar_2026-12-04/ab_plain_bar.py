"""A/B of the plan's bar (2026-12-04): the plan without drafts priced as the kind's steps
without drafts showed (``GoodputCheck.plain_step``, the default) against the cost model's
fit (``controller.measured_plain = False``), beside speculation off; the built-in draft, the
default adaptive settings of the device, under load (Poisson rates and everything queued)
and one request at a time. Settings take turns within each round.

    python ab_plain_bar.py [--device cuda] [--rates inf,2] [--num-prompts 24] [--rounds 2] [--json out.json]
"""
import argparse
import json
import statistics
import types

import numpy as np

from specserve import LLMEngine
from specserve.bench.arrivals import arrival_times
from specserve.bench.cli import describe_machine
from specserve.bench.offline import load_workload, prompt_ids, run_offline, warm_up


def clipped_solve(self) -> None:
    """``CostModel.solve`` before 2026-12-04: an unconstrained solve, negative costs clipped."""
    self._unsolved = 0
    xtx = self.anchor_xtx + self.xtx
    ridge = 1e-9 * np.trace(xtx) / len(xtx) + 1e-12
    theta = np.linalg.solve(xtx + ridge * np.eye(len(xtx)), self.anchor_xty + self.xty)
    self.theta = np.clip(theta, 0.0, None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="auto")
    parser.add_argument("--workloads", default="chat,code-edit")
    parser.add_argument("--rates", default="inf,2,batch1", help="request rates; inf: everything queued; "
                        "batch1: one request at a time")
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--batch1-prompts", type=int, default=8)
    parser.add_argument("--num-warmups", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--settings", default="measured bar;fit bar")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    common = {"device": args.device, "speculative_method": "draft_model"}
    if args.num_kv_blocks:
        common["num_kv_blocks"] = args.num_kv_blocks
    # ("measured level", in runs 2 and 3: the fit's fixed price replaced by the measured one, a
    # patch not kept; see the README.) "main": the code before (the fit's bar, its costs
    # clipped at zero after an unconstrained solve).
    variants = {"measured bar": (True, False), "fit bar": (False, False), "main": (False, True),
                "clipped, measured bar": (True, True)}
    chosen = args.settings.split(";")
    engines = {"off": LLMEngine(**{**common, "speculative_method": "none"})}
    for name in chosen:
        engines[name] = LLMEngine(**common)
        controller = engines[name].speculator.controller
        controller.measured_plain, clipped = variants[name]
        if clipped:
            for model in (controller.costs.target, controller.costs.draft):
                model.solve = types.MethodType(clipped_solve, model)
                model.solve()
    names = list(engines)
    runs = []
    for workload in args.workloads.split(","):
        for rate in args.rates.split(","):
            n = args.batch1_prompts if rate == "batch1" else args.num_prompts
            requests = load_workload(workload, n, output_len=args.output_len, tokenizer=engines["off"].tokenizer)
            ids = prompt_ids(engines["off"], requests)
            for engine in engines.values():
                warm_up(engine, requests, ids, num_requests=args.num_warmups)
            for round_ in range(args.rounds):
                arrivals = None if rate in ("inf", "batch1") else arrival_times(len(requests), float(rate), 1.0, round_)
                for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                    run = run_offline(engines[name], requests, token_ids=ids, progress=False, label=name,
                                      arrivals=arrivals, max_concurrency=1 if rate == "batch1" else None)
                    lengths = {int(k): n for k, n in (run.get("spec_decode_draft_lengths") or {}).items()}
                    mean_k = sum(k * n for k, n in lengths.items()) / sum(lengths.values()) if lengths else None
                    row = {"workload": workload, "rate": rate, "round": round_, "setting": name,
                               "output_throughput": run["output_throughput"], "mean_k": mean_k,
                               "acceptance": run.get("spec_decode_acceptance_length")}
                    runs.append(row)
                    print(json.dumps(row), flush=True)
    print()
    print("| workload | rate | off tok/s | " + " | ".join(names[1:]) + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in names[1:]) + " |")
    for workload in args.workloads.split(","):
        for rate in args.rates.split(","):
            mine = [r for r in runs if r["workload"] == workload and r["rate"] == rate]
            cells = []
            for round_ in range(args.rounds):
                off = next(r["output_throughput"] for r in mine if r["round"] == round_ and r["setting"] == "off")
                cells.append({r["setting"]: r["output_throughput"] / off for r in mine if r["round"] == round_})
            offs = [r["output_throughput"] for r in mine if r["setting"] == "off"]
            print(f"| {workload} | {rate} | {statistics.median(offs):.1f} | "
                  + " | ".join(", ".join(f"{c[s]:.3f}x" for c in cells) for s in names[1:]) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": describe_machine(), "args": vars(args), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
