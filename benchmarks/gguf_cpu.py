"""GGUF on the CPU: the default model's own Q4_1 file (or ``--gguf FILE``) run by llama.cpp
and by specserve, side by side, in one run.

llama.cpp is ``llama-cpp-python`` (optional: ``pip install llama-cpp-python``, built on the
machine), on the same file with the same thread count, in a process of its own. specserve runs the file with its
weights kept quantized (the default on a CPU), dequantised to bf16 (the path before), and
with speculation: n-gram, the built-in draft (both over the quantized target; the draft's
layers in Q4_1, its default there, or bf16 as its checkpoint holds them) and the
quantized self-draft (the file's Q4_1 blocks drafting for the bf16 target).

Held-out chat and code prompts (``specserve.bench.prompt_sets``) with the chat template,
batch 1 (one prompt after another), greedy, at most ``--max-tokens`` new tokens, stopping
at EOS on both sides; tokens/s counts the tokens each produced over its wall time, prompt
processing included. Prompt processing apart: each prompt run cold for one token (llama.cpp
reset, specserve's prefix cache emptied), prompt tokens per second of that. Each engine is
built, warmed up on one prompt, run and closed in turn.

    python benchmarks/gguf_cpu.py [--threads 2,8] [--prompts 4] [--max-tokens 128] [--methods quantized,ngram]
        [--gguf model-Q5_K_M.gguf] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from draft_acceptance import machine_name  # noqa: E402

# specserve configurations: short name -> (label, engine settings)
METHODS = {
    "quantized": ("specserve, kept quantized", {}),
    # The same, its prompt chunks through the integer kernel too (QuantLinear.dequant_rows 0,
    # as --deterministic runs them): what unpacking the weight for a GEMM gains.
    "integer-prompts": ("specserve, kept quantized, integer kernel for prompts too", {"dequant_rows": 0}),
    "bf16": ("specserve, dequantized to bf16", {"gguf_weights": "dequantized"}),
    "ngram": ("specserve quantized + n-gram", {"speculative_method": "ngram"}),
    "draft": ("specserve quantized + built-in draft", {"speculative_method": "draft_model"}),
    # The same, the draft's layers as its checkpoint holds them (bf16), as before --draft-quantization.
    "draft-bf16": ("specserve quantized + built-in draft, its layers bf16", {"speculative_method": "draft_model",
                                                                           "draft_quantization": "none"}),
    "self-draft": ("specserve bf16 + quantized self-draft", {"speculative_method": "quantized"}),
}


def run_llama_cpp(path: str, prompts: list[str], threads: int, max_tokens: int) -> dict | None:
    """llama.cpp in a process of its own, so that its threads never share the cores with
    the specserve runs that follow."""
    job = json.dumps({"path": path, "prompts": prompts, "threads": threads, "max_tokens": max_tokens})
    done = subprocess.run([sys.executable, __file__, "--llama-cpp-job"], input=job, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"no llama.cpp baseline: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}",
              file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def llama_cpp_job() -> None:
    from llama_cpp import Llama  # lazy: optional, the baseline only (pip install llama-cpp-python)

    job = json.loads(sys.stdin.read())
    threads = job["threads"]
    llm = Llama(job["path"], n_threads=threads, n_threads_batch=threads, n_ctx=4096, seed=0, verbose=False)
    llm.create_completion(job["prompts"][0], max_tokens=8, temperature=0.0)  # warm-up
    tokens, seconds = 0, 0.0
    for prompt in job["prompts"]:
        start = time.perf_counter()
        out = llm.create_completion(prompt, max_tokens=job["max_tokens"], temperature=0.0)
        seconds += time.perf_counter() - start
        tokens += out["usage"]["completion_tokens"]
    prompt_tokens, prompt_s = 0, 0.0
    for prompt in job["prompts"]:  # prompt processing alone: cold, one token
        llm.reset()
        start = time.perf_counter()
        out = llm.create_completion(prompt, max_tokens=1, temperature=0.0)
        prompt_s += time.perf_counter() - start
        prompt_tokens += out["usage"]["prompt_tokens"]
    print(json.dumps({"tokens_per_s": tokens / seconds, "tokens": tokens, "prompt_tokens_per_s": prompt_tokens / prompt_s}))


def run_specserve(model: str | None, settings: dict, prompts: list[str], threads: int, max_tokens: int) -> dict:
    from specserve import LLM, SamplingParams

    settings = dict(settings)
    dequant_rows = settings.pop("dequant_rows", None)
    llm = LLM(model, cpu_threads=threads, kv_cache_memory_gib=0.25, max_num_seqs=4, **settings)
    if dequant_rows is not None:
        from specserve.models.quantized import QuantLinear  # lazy: only for this row

        for module in llm.engine.runner.model.modules():
            if isinstance(module, QuantLinear):
                module.dequant_rows = dequant_rows
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
    stats = llm.engine.spec_stats
    drafts0, accepted0 = stats.num_drafts, stats.num_accepted_tokens
    tokens, seconds = 0, 0.0
    for prompt in prompts:
        start = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        seconds += time.perf_counter() - start
        tokens += len(out.token_ids)
    drafts, accepted = stats.num_drafts - drafts0, stats.num_accepted_tokens - accepted0
    prompt_tokens, prompt_s, one = 0, 0.0, SamplingParams(temperature=0, max_tokens=1)
    for prompt in prompts:  # prompt processing alone: cold, one token
        llm.engine.kv.reset_prefix_cache()
        start = time.perf_counter()
        out = llm.generate([prompt], one, use_tqdm=False)[0]
        prompt_s += time.perf_counter() - start
        prompt_tokens += len(out.prompt_token_ids)
    result = {"tokens_per_s": tokens / seconds, "tokens": tokens, "prompt_tokens_per_s": prompt_tokens / prompt_s,
              "acceptance_length": 1 + accepted / drafts if drafts else None,
              "quantized_target": llm.engine.quantized_weights,
              "formats": sorted({f for m in llm.engine.runner.model.modules() for f in getattr(m, "formats", ())})}
    llm.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="2", help="comma-separated thread counts")
    parser.add_argument("--prompts", type=int, default=4, help="held-out prompts per workload")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated specserve rows, of: {', '.join(METHODS)}")
    parser.add_argument("--gguf", default=None, help="a GGUF file to run (default: the default model's own)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--llama-cpp-job", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.llama_cpp_job:
        return llama_cpp_job()
    methods = [name.strip() for name in args.methods.split(",") if name.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown --methods {', '.join(unknown)}; choose from {', '.join(METHODS)}")

    import torch

    from specserve.bench.prompt_sets import chat_prompts, held_out_prompts
    from specserve.loader import default_model_gguf, load_tokenizer, resolve_model

    gguf = args.gguf or str(default_model_gguf())
    tokenizer = load_tokenizer(resolve_model(args.gguf))
    workloads = {kind: chat_prompts(tokenizer, held_out_prompts(kind, args.prompts)) for kind in ("chat", "code")}
    cpu = machine_name(torch.device("cpu"))
    rows = []
    for threads in (int(t) for t in args.threads.split(",")):
        for workload, prompts in workloads.items():
            base = run_llama_cpp(gguf, prompts, threads, args.max_tokens)
            entries = [("llama.cpp (llama-cpp-python)", base)] if base else []
            for name in methods:
                label, settings = METHODS[name]
                entries.append((label, run_specserve(args.gguf, settings, prompts, threads, args.max_tokens)))
            for label, r in entries:
                row = {"threads": threads, "workload": workload, "method": label,
                       "tokens_per_s": round(r["tokens_per_s"], 1), "tokens": r["tokens"],
                       "prompt_tokens_per_s": round(r["prompt_tokens_per_s"], 1),
                       "vs_llama_cpp": round(r["tokens_per_s"] / base["tokens_per_s"], 2) if base else None,
                       "acceptance_length": round(r["acceptance_length"], 2) if r.get("acceptance_length") else None,
                       "formats": r.get("formats")}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n{Path(gguf).name} on {cpu}; batch 1, greedy, at most {args.max_tokens} new tokens per prompt, "
          f"{args.prompts} held-out prompts per workload\n")
    print("| threads | workload | method | tokens/s | vs llama.cpp | acceptance length | prompt tokens/s |")
    print("| ---: | --- | --- | ---: | ---: | ---: | ---: |")
    for row in rows:
        vs = f"{row['vs_llama_cpp']:.2f}x" if row["vs_llama_cpp"] else ""
        print(f"| {row['threads']} | {row['workload']} | {row['method']} | {row['tokens_per_s']:.1f} | {vs} | "
              f"{row['acceptance_length'] or ''} | {row['prompt_tokens_per_s']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": cpu, "file": Path(gguf).name, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
