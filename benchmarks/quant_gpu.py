"""Quantized weights on a GPU against their bandwidth floors and their dequantised
references, in one run: correctness first, then timings, one table last.

1. ``agreement``: the default model (SmolLM2-135M-Instruct) written as each quantized
   checkpoint layout (``tests/tiny_models.write_quantized_checkpoint``: FP8 per channel
   with per-token activations, FP8 in 64 x 64 blocks, W8A16, AWQ and GPTQ act-order 4-bit
   in groups of 64) and loaded by the engine, bf16: greedy tokens against the engine on
   the dequantised bf16 weights and on the original bf16 model; batch-1 tokens/s. With
   ``--device cpu``: the layouts a CPU runs (FP8 per channel, AWQ, GPTQ).
2. ``gemm``: Llama-3.1-8B's projections, random weights: µs per layer call (CUDA-graph
   replay) at 1, 5 and 64 rows for bf16 (cuBLAS), FP8 W8A8 per channel (Triton up to 16
   rows, ``torch._scaled_mm`` above), FP8 128 x 128 blocks (Triton), FP8 W8A16 (Triton) and W4A16
   groups of 128 (Triton), beside each one's floor at one row: the bytes it reads (weights,
   scales, zero points) over the measured copy bandwidth.
3. ``tiles`` (not run by default): for each scheme and projection at one row, the
   planned Triton tiles against a sweep of tiles, K splits, warps and stages.
4. ``decode``: the Llama-3.1-8B shape with random weights, its projections quantized at
   each scheme (the LM head and embeddings stay bf16): the batch-1 decode step (CUDA
   graph replay, 512 tokens of context) against its floor, the bytes a step reads.
5. ``kv``: the same shape in bf16 decoding with its KV cache in bf16 and in float8
   (``--kv-cache-dtype fp8``), at long contexts and large batches, against the floor.

    python benchmarks/quant_gpu.py [--sections agreement,gemm,decode] [--json out.json]
    python benchmarks/quant_gpu.py --device cpu --sections agreement --prompts 8 --max-tokens 64
    python benchmarks/quant_gpu.py --device cpu --sections kv --prompts 16 --max-tokens 128
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "tests"))

from deterministic import GEMMS_8B, graph_us  # noqa: E402
from gpu_bench import (_card, _copy_bandwidth, _one_by_one, agreement, decode_step, kv_read_bytes,  # noqa: E402
                       llama_8b_config, log, median_ms, random_llama)

# The schemes at Llama-3.1-8B's shapes: name -> (kind, weight block, activations, int4 group)
SCHEMES = {
    "fp8 W8A8 per channel": ("fp8", None, "token", 0),
    "fp8 W8A8 128x128 blocks": ("fp8", (128, 128), "group", 0),
    "fp8 W8A16 per channel": ("fp8", None, None, 0),
    "int4 W4A16 g128": ("int4", None, None, 128),
}

# The default model's layouts: tests/tiny_models.QUANT_LAYOUTS, with groups and blocks
# that divide its widths (576, 1536).
LAYOUTS = {
    "ct_fp8_dynamic": {},
    "fp8_block": {"weight_block_size": [64, 64]},
    "ct_fp8_w8a16": {},
    "awq": {"group_size": 64},
    "gptq_act_order": {"group_size": 64},
}
# What runs on a CPU: FP8 per channel (torch._scaled_mm), 4-bit through the GGUF kernels.
CPU_LAYOUTS = {"ct_fp8_dynamic": {}, "awq": {"group_size": 64}, "gptq": {"group_size": 64}}


def quantized_layer(linear: torch.nn.Linear, scheme: tuple) -> torch.nn.Module:
    from specserve.models.checkpoint_quant import Fp8Linear, Int4Linear, quantize_fp8, quantize_int4

    kind, block, activations, group = scheme
    if kind == "int4":
        return Int4Linear(quantize_int4(linear.weight.detach(), group), linear.bias)
    weight = quantize_fp8(linear.weight.detach(), block)
    return Fp8Linear(weight, None, activations, linear.bias, deterministic=False)


def layer_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


# ---------------------------------------------------------------------- agreement
def held_out_prompts(tokenizer, count: int) -> list:
    """``count`` held-out prompts with the chat template: half chat, half code edits."""
    from workloads import WORKLOADS, chat_prompts

    half = count // 2
    return (chat_prompts(tokenizer, WORKLOADS["chat"])[:half]
            + chat_prompts(tokenizer, WORKLOADS["code-edit"])[:count - half])


def agreement_section(args, rows: list) -> None:
    import tiny_models
    from specserve import LLM
    from specserve.loader import resolve_model

    source = resolve_model(None).path
    work = Path(tempfile.mkdtemp())
    common = dict(device=args.device, dtype="bfloat16", num_kv_blocks=512, max_model_len=2048)  # several engines
    layouts = LAYOUTS if args.device == "cuda" else CPU_LAYOUTS
    base = LLM(str(source), **common)
    prompts = held_out_prompts(base.tokenizer, args.prompts)
    _one_by_one(base, prompts[:1], 8, None)
    plain = _one_by_one(base, prompts, args.max_tokens, None)
    rows.append({"section": "agreement", "model": "bf16 (original)", "tokens_per_s": round(plain["tokens_per_s"], 1)})
    log(json.dumps(rows[-1]))
    for layout, overrides in layouts.items():
        tiny_models.QUANT_LAYOUTS[layout] = {**tiny_models.QUANT_LAYOUTS[layout], **overrides}
        path = work / layout
        start = time.perf_counter()
        reference = tiny_models.write_quantized_checkpoint(source, path, layout)
        ref_path = work / f"{layout}-dequantised"
        reference.to(torch.bfloat16).save_pretrained(ref_path)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
            if (source / name).is_file():
                (ref_path / name).write_bytes((source / name).read_bytes())
        log(f"{layout}: written in {time.perf_counter() - start:.0f} s")
        quant = LLM(str(path), **common)
        deq = LLM(str(ref_path), **common)
        _one_by_one(quant, prompts[:1], 8, None)
        got = _one_by_one(quant, prompts, args.max_tokens, None)
        want = _one_by_one(deq, prompts, args.max_tokens, None)
        rows.append({"section": "agreement", "model": layout, "tokens_per_s": round(got["tokens_per_s"], 1),
                     "agreement_dequantised": round(agreement(got["token_ids"], want["token_ids"]), 3),
                     "identical_dequantised": sum(a == b for a, b in zip(got["token_ids"], want["token_ids"])),
                     "agreement_bf16": round(agreement(got["token_ids"], plain["token_ids"]), 3),
                     "prompts": len(prompts)})
        log(json.dumps(rows[-1]))
        del quant, deq
        if args.device == "cuda":
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------- gemm
def projections_8b(device: torch.device):
    """(name, n, k, a bf16 linear with seeded random weights, its generator) for each of
    Llama-3.1-8B's projections."""
    for name, (n, k) in GEMMS_8B.items():
        if name == "lm_head":
            continue
        g = torch.Generator(device=device).manual_seed(0)
        linear = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            linear.weight.normal_(0, 0.02, generator=g)
        yield name, n, k, linear, g


def gemm_section(args, rows: list, bandwidth: float) -> None:
    device = torch.device("cuda")
    for name, n, k, linear, g in projections_8b(device):
        layers = {"bf16 (cuBLAS)": linear, **{s: quantized_layer(linear, SCHEMES[s]) for s in SCHEMES}}
        x = torch.randn(64, k, device=device, dtype=torch.bfloat16, generator=g)
        ref = linear(x).float()
        for label, layer in layers.items():
            err = ((layer(x).float() - ref).norm() / ref.norm()).item()
            row = {"section": "gemm", "gemm": name, "n": n, "k": k, "layer": label, "rel_error": round(err, 4),
                   "floor_us_m1": round(1e6 * layer_bytes(layer) / bandwidth, 1)}
            for m in (1, 5, 64):
                xm = x[:m].clone()
                row[f"m{m}_us"] = round(graph_us(lambda: layer(xm), args.reps, device), 1)
            row["m1_vs_floor"] = round(row["m1_us"] / row["floor_us_m1"], 2)
            rows.append(row)
            log(json.dumps(row))


# ---------------------------------------------------------------------- tiles
def tiles_section(args, rows: list, bandwidth: float) -> None:
    """Each scheme's planned tiles (``quant_matmul.plan``) at one row against a sweep of
    column tile, K tile, K split, warps and stages, per projection. Calls rotate over
    copies of the weight (at least 256 MB in all), so that the L2 cache holds none."""
    import copy

    from specserve.kernels import quant_matmul

    device = torch.device("cuda")
    planned = quant_matmul.plan
    for scheme_name, scheme in SCHEMES.items():
        for name, n, k, linear, g in projections_8b(device):
            layer = quantized_layer(linear, scheme)
            size = layer_bytes(layer)
            layers = [layer] + [copy.deepcopy(layer) for _ in range(min(15, -(-256_000_000 // size) - 1))]
            x = torch.randn(16, k, device=device, dtype=torch.bfloat16, generator=g)
            floor = 1e6 * size / bandwidth

            def us(m: int, tiles=None) -> tuple[float, tuple | None]:
                xm = x[:m].clone()
                asked = []
                quant_matmul.plan = lambda few, *key: asked.append(key) or tiles or planned(True, *key)
                try:
                    got = graph_us(lambda: [each(xm) for each in layers], args.reps, device, calls=1) / len(layers)
                finally:
                    quant_matmul.plan = planned
                return got, (asked[-1] if asked else None)  # (None: not through Triton)

            extra = {}
            if us(1)[1] is None:  # torch._scaled_mm: timed, then the layers go through Triton
                extra = {"scaled_mm_m1_us": round(us(1)[0], 1), "scaled_mm_m5_us": round(us(5)[0], 1)}
                for each in layers:
                    each._scaled_mm = lambda *_: False
            (one, key), (five, _), (sixteen, _) = us(1), us(5), us(16)
            step = key[3]  # plan(few, kind, n, k, step, device), less few
            row = {"section": "tiles", "scheme": scheme_name, "gemm": name, "floor_us": round(floor, 1),
                   "planned": planned(True, *key)._asdict(), "planned_m1_us": round(one, 1),
                   "planned_m5_us": round(five, 1), "planned_m16_us": round(sixteen, 1), **extra}
            best = None
            for block_n in (32, 64, 128):
                for block_k in (64, 128, 256):
                    if step % block_k or (scheme[0] == "int4" and block_k != quant_matmul.INT4_CHUNK):
                        continue
                    for warps, stages in ((4, 4), (4, 2)):  # (8 warps never won on an H200)
                        for split in (1, 2, 4, 8, 16):
                            if -(-k // block_k) >= split:
                                t = quant_matmul.Tiles(16, block_n, block_k, split, warps, stages,
                                                       quant_matmul.FEW_ROW_TILES[key[0]].sum_in_launch)
                                got = us(1, t)[0]
                                if best is None or got < best[0]:
                                    best = (got, t)
            row.update(best_m1_us=round(best[0], 1), best=best[1]._asdict(),
                       planned_vs_floor=round(one / floor, 2), best_vs_floor=round(best[0] / floor, 2))
            rows.append(row)
            log(json.dumps(row))
            layers, layer, linear = [], None, None  # (freed before the next projection)
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------- decode
def decode_section(args, rows: list, bandwidth: float) -> None:
    from specserve.config import EngineConfig
    from specserve.model_runner import ModelRunner
    from specserve.models.packed_linear import linears_replaced

    device = torch.device("cuda")
    model = random_llama(llama_8b_config(), device)
    linears = {name: module for name, module in model.named_modules()
               if isinstance(module, torch.nn.Linear) and name != "lm_head"}
    context = 512
    cfg = EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=8, max_num_batched_tokens=2048,
                       num_kv_blocks=512, block_size=16)
    for label, scheme in [("bf16", None), *SCHEMES.items()]:
        if scheme is not None:
            for name, linear in linears.items():
                model.set_submodule(name, quantized_layer(linear, scheme))
            linears_replaced(model)  # as the loader does: norms hand float8 layers their inputs rounded
        read = layer_bytes(model) - layer_bytes(model.model.embed_tokens) + kv_read_bytes(model, context)
        runner = ModelRunner(model, cfg, device, torch.bfloat16, num_blocks=512)
        runner.enable_graphs(5, 512)
        step = median_ms(lambda: runner.execute(decode_step(1, 0, context)), args.reps, device)
        verify = median_ms(lambda: runner.execute(decode_step(1, 4, context)), args.reps, device)
        floor = 1000 * read / bandwidth
        rows.append({"section": "decode", "scheme": label, "bytes_read_gb": round(read / 1e9, 2),
                     "step_ms": round(step, 3), "floor_ms": round(floor, 3), "vs_floor": round(step / floor, 2),
                     "verify_1_plus_4_ms": round(verify, 3)})
        log(json.dumps(rows[-1]))
        runner = None  # (its KV cache and graphs freed before the next)
        for name, linear in linears.items():
            model.set_submodule(name, linear)
        linears_replaced(model)
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------- kv
def kv_section(args, rows: list, bandwidth: float) -> None:
    """The Llama-3.1-8B shape (random bf16 weights) decoding with its KV cache in bf16
    and in float8 (``kv_cache_dtype="fp8"``): the step at long contexts and large batches,
    where reading the cache costs as much as reading the weights, against its floor.
    With ``--device cpu``: what float8 K and V do to the default model's greedy output."""
    from specserve.config import EngineConfig
    from specserve.model_runner import ModelRunner

    if args.device == "cpu":
        kv_agreement(args, rows)
        return
    device = torch.device("cuda")
    model = random_llama(llama_8b_config(), device)
    weights = layer_bytes(model) - layer_bytes(model.model.embed_tokens)
    shapes = [(1, 8192), (16, 8192), (64, 2048), (64, 4096)]
    blocks = max(b * -(-(c + 1) // 16) for b, c in shapes)
    for kv_dtype in ("auto", "fp8"):
        cfg = EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=64, max_num_batched_tokens=2048,
                           num_kv_blocks=blocks, block_size=16, kv_cache_dtype=kv_dtype)
        runner = ModelRunner(model, cfg, device, torch.bfloat16, num_blocks=blocks)
        runner.enable_graphs(1, 8448)
        element = runner.kv_storage.element_size()
        for batch, context in shapes:
            step = median_ms(lambda: runner.execute(decode_step(batch, 0, context)), args.reps, device)
            read = weights + kv_read_bytes(model, context, batch, element)
            floor = 1000 * read / bandwidth
            rows.append({"section": "kv", "kv_cache": "bf16" if kv_dtype == "auto" else "fp8", "batch": batch,
                         "context": context, "bytes_read_gb": round(read / 1e9, 2), "step_ms": round(step, 3),
                         "floor_ms": round(floor, 3), "vs_floor": round(step / floor, 2),
                         "tokens_per_s": round(1000 * batch / step), "bytes_per_block": runner.bytes_per_block})
            log(json.dumps(rows[-1]))
        runner.close()
        runner = None
        torch.cuda.empty_cache()


def kv_agreement(args, rows: list) -> None:
    """The default model's greedy tokens with float8 K and V against float32 ones, beside
    what bf16 (weights, activations and cache) does to them: the rounding noise to compare
    with. The torch reference kernels on both (the C++ CPU kernels keep the cache in the
    model's dtype), the model dequantised from its GGUF."""
    import os

    from specserve import LLM
    from specserve.kernels import cpu_ops

    os.environ[cpu_ops.ENV_SWITCH] = "0"
    runs = {}
    for dtype, kv in (("float32", "auto"), ("float32", "fp8"), ("bfloat16", "auto")):
        llm = LLM(None, device="cpu", dtype=dtype, kv_cache_dtype=kv, gguf_weights="dequantized",
                  num_kv_blocks=512, max_model_len=2048)
        prompts = held_out_prompts(llm.tokenizer, args.prompts)
        runs[dtype, kv] = got = _one_by_one(llm, prompts, args.max_tokens, None)
        row = {"section": "kv", "device": "cpu", "model_dtype": dtype, "kv_cache": dtype if kv == "auto" else kv,
               "tokens_per_s": round(got["tokens_per_s"], 1), "prompts": len(prompts)}
        if (dtype, kv) != ("float32", "auto"):
            want = runs["float32", "auto"]["token_ids"]
            row.update(agreement_fp32=round(agreement(got["token_ids"], want), 3),
                       identical_fp32=sum(a == b for a, b in zip(got["token_ids"], want)))
        rows.append(row)
        log(json.dumps(row))
        del llm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default="agreement,gemm,decode,kv", help="also: tiles (a sweep)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (the agreement and kv sections only)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sections = args.sections.split(",")
    bandwidth = _copy_bandwidth() if args.device == "cuda" else float("nan")
    rows: list[dict] = []
    card = _card() if args.device == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    log(f"{card}, torch {torch.__version__}, copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    if "agreement" in sections:
        agreement_section(args, rows)
    if "gemm" in sections:
        gemm_section(args, rows, bandwidth)
    if "tiles" in sections:
        tiles_section(args, rows, bandwidth)
    if "decode" in sections:
        decode_section(args, rows, bandwidth)
    if "kv" in sections:
        kv_section(args, rows, bandwidth)
    log(f"\n{card}, copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    for row in rows:
        log(" | ".join(f"{k}={v}" for k, v in row.items() if k != "section"))
    if args.json:
        Path(args.json).write_text(json.dumps({"card": card, "bandwidth_tb_s": bandwidth / 1e12, "rows": rows},
                                              indent=1))


if __name__ == "__main__":
    main()
