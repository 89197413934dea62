"""Gemma 2 decoding on the CPU: the C++ layer kernels (Gemma's norm, GeGLU, soft-capped
attention) against the torch ops, beside transformers' ``generate`` on the same model.

A Gemma-2 model of SmolLM2-135M's size (576 wide, 30 layers, 9 query and 3 KV heads of 64,
GeGLU of 1536, both soft-caps, sliding and global layers) with seeded random bf16 weights
and the default model's tokenizer, built once under ``--workdir``. Batch 1, greedy, one
prompt of 64 tokens, ``--new-tokens`` decoded, speculation off; each engine in its own
process (the kernels are chosen once per process); median of ``--repeats``.

    python benchmarks/gemma_cpu.py --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=2048,
             sliding_window=512, query_pre_attn_scalar=64, attn_logit_softcapping=50.0,
             final_logit_softcapping=30.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
             pad_token_id=0)
PROMPT = [(37 * i) % 40000 + 100 for i in range(64)]


def build(workdir: Path) -> Path:
    """The random Gemma 2 checkpoint (made once), with the default model's tokenizer."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from specserve.loader import resolve_model

    path = workdir / "gemma2-smollm2-size"
    if (path / "config.json").is_file():
        return path
    torch.manual_seed(0)
    config = Gemma2Config(**SHAPE)
    model = Gemma2ForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.1 if "norm" in name else 0.05)
    model.save_pretrained(path)
    tokenizer_dir = resolve_model(None).path
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    return path


def run_specserve(path: Path, new_tokens: int, repeats: int) -> dict:
    from specserve import LLM, SamplingParams
    from specserve.kernels import cpu_ops

    llm = LLM(str(path), dtype="bfloat16", max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([PROMPT], params, use_tqdm=False)  # warm-up
    times, tokens = [], None
    for _ in range(repeats):
        begin = time.perf_counter()
        tokens = llm.generate([PROMPT], params, use_tqdm=False)[0].token_ids
        times.append(time.perf_counter() - begin)
    return {"tokens_per_s": new_tokens / statistics.median(times), "kernels": cpu_ops.available(),
            "token_ids": tokens}


def run_hf(path: Path, new_tokens: int, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager").eval()
    ids = torch.tensor([PROMPT])
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids, **kwargs)
        times, out = [], None
        for _ in range(repeats):
            begin = time.perf_counter()
            out = model.generate(ids, **kwargs)
            times.append(time.perf_counter() - begin)
    return {"tokens_per_s": new_tokens / statistics.median(times), "token_ids": out[0, len(PROMPT):].tolist()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default="/tmp/specserve-gemma-cpu")
    parser.add_argument("--json", default=None)
    parser.add_argument("--one", choices=["kernels", "torch", "hf"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    path = build(Path(args.workdir))
    if args.one:  # a child process: one engine, its result as JSON on stdout
        run = run_hf if args.one == "hf" else run_specserve
        print(json.dumps(run(path, args.new_tokens, args.repeats)))
        return 0
    rows = {}
    for variant, switch in (("specserve, C++ kernels", "1"), ("specserve, torch ops", "0"), ("HF generate", "1")):
        one = "hf" if variant.startswith("HF") else ("kernels" if switch == "1" else "torch")
        done = subprocess.run([sys.executable, __file__, "--one", one, "--new-tokens", str(args.new_tokens),
                               "--repeats", str(args.repeats), "--workdir", args.workdir],
                              env={**os.environ, "SPECSERVE_CPU_KERNELS": switch}, capture_output=True,
                              text=True, check=True)
        rows[variant] = json.loads(done.stdout.strip().splitlines()[-1])
    reference = rows["HF generate"]["token_ids"]
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"bf16, batch 1, {args.new_tokens} new tokens")
    print("| engine | tokens/s | vs HF | greedy tokens equal to HF's |")
    print("| --- | ---: | ---: | ---: |")
    for variant, row in rows.items():
        same = next((i for i, (a, b) in enumerate(zip(row["token_ids"], reference)) if a != b), len(reference))
        print(f"| {variant} | {row['tokens_per_s']:.1f} | {row['tokens_per_s'] / rows['HF generate']['tokens_per_s']:.2f}x "
              f"| first {same} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
