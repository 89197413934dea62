"""What the API's sampling features cost, with speculation and without, in one run:
logits processing (repetition, frequency and presence penalties, logit_bias) and
log-probabilities (the sampled token's and the top 5), greedy and sampled, against plain
greedy decoding.

Each setting generates ``--output-len`` tokens (EOS ignored) for each of ``--num-prompts``
held-out chat prompts as one offline batch; the engines (speculation off and the chosen
drafter) take turns setting by setting, each round starting with the other. Reported:
output tokens/s, the tokens each request-step emitted under speculation (acceptance
length), and, for greedy settings, how many prompts' outputs equal speculation off's.

    python benchmarks/api_features.py                        # CPU, the default model and its draft
    python benchmarks/api_features.py --device cuda --num-prompts 64
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def settings(vocab_ids: list[int]) -> dict:
    from specserve import SamplingParams

    penalties = dict(repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.2,
                     logit_bias={t: -5.0 for t in vocab_ids})
    return {
        "greedy": dict(temperature=0),
        "greedy + penalties": dict(temperature=0, **penalties),
        "greedy + logprobs 5": dict(temperature=0, logprobs=5),
        "sampled": dict(temperature=0.8, top_p=0.95),
        "sampled + penalties + logprobs 5": dict(temperature=0.8, top_p=0.95, logprobs=5, **penalties),
    }, SamplingParams


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="requests in flight at once (default: all prompts)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--speculative-method", default="draft_model")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)

    from specserve import LLMEngine
    from specserve.bench.cli import describe_machine
    from specserve.bench.prompt_sets import chat_prompts, held_out_prompts

    common = dict(device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs or args.num_prompts)
    engines = {"spec off": LLMEngine(**common),
               args.speculative_method: LLMEngine(**common, speculative_method=args.speculative_method,
                                                  num_speculative_tokens=args.num_speculative_tokens,
                                                  speculative_adaptive=False)}
    tokenizer = engines["spec off"].tokenizer
    prompts = chat_prompts(tokenizer, held_out_prompts("chat", args.num_prompts))
    # Bias against a few frequent words, so that the bias changes outputs.
    biased = [tokenizer.encode(w, add_special_tokens=False)[0] for w in (" the", " a", " is")]
    cases, SamplingParams = settings(biased)
    results = {"machine": describe_machine(), "args": vars(args), "runs": []}
    outputs: dict[tuple[str, str, int], list] = {}
    order = list(engines)
    for engine in engines.values():  # warm-up
        _generate(engine, prompts[:2], SamplingParams(temperature=0, max_tokens=8))
    for round_ in range(args.rounds):
        for case, extra in cases.items():
            for name in (order if round_ % 2 == 0 else order[::-1]):
                engine = engines[name]
                params = [SamplingParams(max_tokens=args.output_len, ignore_eos=True, seed=i, **extra)
                          for i in range(len(prompts))]
                steps_before = _request_steps(engine)
                start = time.perf_counter()
                outs = _generate(engine, prompts, params)
                elapsed = time.perf_counter() - start
                tokens = sum(len(o.token_ids) for o in outs)
                steps = _request_steps(engine) - steps_before
                outputs[(case, name, round_)] = [o.token_ids for o in outs]
                row = {"setting": case, "engine": name, "round": round_, "output_throughput": tokens / elapsed,
                       "acceptance_length": tokens / steps if steps else None}
                results["runs"].append(row)
                print(f"round {round_} {case:34s} {name:12s} {row['output_throughput']:8.1f} tok/s"
                      + (f"  {row['acceptance_length']:.2f} tokens/step" if row["acceptance_length"] else ""),
                      flush=True)
    spec = order[1]
    table = ["| setting | spec off tok/s | vs greedy | " + spec + " tok/s | vs greedy | speed-up | tokens/step "
             "| same greedy output |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    base = {n: statistics.median(r["output_throughput"] for r in results["runs"]
                                 if r["setting"] == "greedy" and r["engine"] == n) for n in order}
    for case in cases:
        rows = {n: [r for r in results["runs"] if r["setting"] == case and r["engine"] == n] for n in order}
        off = statistics.median(r["output_throughput"] for r in rows["spec off"])
        on = statistics.median(r["output_throughput"] for r in rows[spec])
        accept = statistics.median(r["acceptance_length"] for r in rows[spec])
        same = "–"
        if cases[case].get("temperature") == 0:
            same = f"{sum(a == b for a, b in zip(outputs[(case, 'spec off', 0)], outputs[(case, spec, 0)]))}" \
                   f"/{len(prompts)}"
        table.append(f"| {case} | {off:.1f} | {off / base['spec off']:.2f}x | {on:.1f} | {on / base[spec]:.2f}x "
                     f"| {on / off:.2f}x | {accept:.2f} | {same} |")
    print("\n".join(table))
    results["table"] = table
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def _generate(engine, prompts, params):
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params if isinstance(params, list) else
                                                     [params] * len(prompts))]
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.req_id] = out
    engine.kv.reset_prefix_cache()
    return [final[i] for i in ids]


def _request_steps(engine) -> int:
    """Request-steps that emitted tokens so far (one per request per step)."""
    return sum(engine.draft_length_counts.values())


if __name__ == "__main__":
    sys.exit(main())
