"""A/B of where a step without drafts feeds the draft model (2026-12-04): after the
target's pass is launched, on a CUDA stream of its own ("beside", the default:
``Speculator.feed_after_target``, ``ModelDrafter.own_stream``) or on the target's ("after"),
or before the target's pass, as steps with drafts do ("first", the code before). One adaptive engine a process beside
speculation off (a second engine in one GPU process runs slower), the built-in draft, under
load; each run's steps recorded (``StepRecorder``) for what a step without drafts costs at
a full batch. ``--no-drafts``: the adaptive engine plans k = 0 for every request (the
draft still fed every step), so every step is one without drafts.

    python ab_feed.py --setting beside|after|first [--no-drafts] [--device cuda] [--rates 256,inf] [--json out.json]
"""
import argparse
import json
import statistics

from specserve import LLMEngine
from specserve.bench.arrivals import arrival_times
from specserve.bench.cli import describe_machine
from specserve.bench.offline import load_workload, prompt_ids, run_offline, warm_up
from specserve.bench.recorder import FIELDS, StepRecorder


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--setting", choices=("beside", "after", "first"), required=True)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--workloads", default="chat")
    parser.add_argument("--rates", default="256,inf", help="request rates; inf: everything queued")
    parser.add_argument("--num-prompts", type=int, default=192)
    parser.add_argument("--num-warmups", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--no-drafts", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    common = {"device": args.device, "speculative_method": "draft_model"}
    if args.num_kv_blocks:
        common["num_kv_blocks"] = args.num_kv_blocks
    engines = {"off": LLMEngine(**{**common, "speculative_method": "none"}), args.setting: LLMEngine(**common)}
    engines[args.setting].speculator.feed_after_target = args.setting != "first"
    engines[args.setting].speculator.drafter.own_stream = args.setting == "beside"
    if args.no_drafts:
        engines[args.setting].speculator._drafter_plan = lambda scheduler: {r.req_id: 0 for r in scheduler.running}
    recorders = {name: StepRecorder(engine) for name, engine in engines.items()}
    col = {name: i for i, name in enumerate(FIELDS)}
    names, runs = list(engines), []
    for workload in args.workloads.split(","):
        for rate in args.rates.split(","):
            requests = load_workload(workload, args.num_prompts, output_len=args.output_len,
                                     tokenizer=engines["off"].tokenizer)
            ids = prompt_ids(engines["off"], requests)
            for engine in engines.values():
                warm_up(engine, requests, ids, num_requests=args.num_warmups)
            for round_ in range(args.rounds):
                arrivals = None if rate == "inf" else arrival_times(len(requests), float(rate), 1.0, round_)
                for name in names[round_ % 2:] + names[:round_ % 2]:
                    with recorders[name].recording():
                        run = run_offline(engines[name], requests, token_ids=ids, progress=False, label=name,
                                          arrivals=arrivals)
                    steps = recorders[name].steps
                    # Steps without drafts or prompt chunks at 64 requests or more: what the
                    # draft's feed adds to a step that verifies nothing.
                    plain = [s for s in steps if not s[col["drafts"]] and not s[col["prefill_tokens"]]
                             and s[col["requests"]] >= 64]
                    lengths = {int(k): n for k, n in (run.get("spec_decode_draft_lengths") or {}).items()}
                    row = {"workload": workload, "rate": rate, "round": round_, "setting": name,
                           "output_throughput": run["output_throughput"],
                           "mean_k": sum(k * n for k, n in lengths.items()) / sum(lengths.values())
                           if lengths else None,
                           "steps": len(steps), "drafted_steps": sum(1 for s in steps if s[col["drafts"]]),
                           "full_plain_steps": len(plain),
                           "full_plain_ms": 1e3 * statistics.median(s[col["step_s"]] for s in plain) if plain else None,
                           "full_plain_verify_ms": 1e3 * statistics.median(s[col["verify_s"]] for s in plain)
                           if plain else None}
                    runs.append(row)
                    print(json.dumps(row), flush=True)
    print()
    print(f"| workload | rate | off tok/s | {args.setting} / off by round | full plain step ms (off; {args.setting}) |")
    print("| --- | --- | --- | --- | --- |")
    for workload in args.workloads.split(","):
        for rate in args.rates.split(","):
            mine = [r for r in runs if r["workload"] == workload and r["rate"] == rate]
            ratios = []
            for round_ in range(args.rounds):
                by = {r["setting"]: r for r in mine if r["round"] == round_}
                ratios.append(by[args.setting]["output_throughput"] / by["off"]["output_throughput"])
            offs = [r["output_throughput"] for r in mine if r["setting"] == "off"]
            ms = {name: [f"{r['full_plain_ms']:.2f}" for r in mine if r["setting"] == name and r["full_plain_ms"]]
                  for name in names}
            print(f"| {workload} | {rate} | {statistics.median(offs):.1f} | "
                  + ", ".join(f"{x:.3f}x" for x in ratios)
                  + f" | {'/'.join(ms['off']) or '-'}; {'/'.join(ms[args.setting]) or '-'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": describe_machine(), "args": vars(args), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
