"""Programmatic dependent launch (``kernels/pdl.py``) against plain launches, in the
decode step (batch 1, 512 tokens of context) and the verify step of 1 + 4 tokens of the
Llama-3.1-8B shape in each weight scheme, and of the default model's shape
(SmolLM2-135M, bf16), random weights, CUDA-graph replay (``ModelRunner.execute``).

Modes (``kernels/pdl.py``'s switches): ``off`` (plain launches); ``on`` (as shipped: the
Triton kernels of the step launched with PDL, each waiting first and then letting the next
launch, the GEMMs as their kind's tiles say); ``notrigger`` (as ``on``, but a kernel lets
the next launch only as it ends); ``all`` (every kind's GEMMs with PDL, none prefetching);
``prefetch`` (every kind's GEMMs with PDL, each prefetching its first weights). Per shape
and scheme the modes take turns in the order given, then in reverse, each a runner of its
own (graphs captured in that mode); the step's logits must be the same bits in every mode.
(Calls 1 and 2 of this folder ran an earlier form: their ``wait`` is ``all`` here.)

    python pdl_ab.py out.json [schemes: bf16,w8a8,blocks,w8a16,int4,small] [modes: off,on,notrigger,all,prefetch]
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))
sys.path.insert(0, str(HERE.parents[3] / "tests"))

from gpu_bench import (
    _copy_bandwidth,
    decode_step,
    kv_read_bytes,
    llama_8b_config,
    median_ms,
    random_llama,
)
from quant_gpu import SCHEMES, layer_bytes, quantized_layer
from specserve.kernels import pdl, quant_matmul

SHIPPED = dict(quant_matmul.FEW_ROW_TILES)

NAMES = {"bf16": None, "w8a8": "fp8 W8A8 per channel", "blocks": "fp8 W8A8 128x128 blocks",
         "w8a16": "fp8 W8A16 per channel", "int4": "int4 W4A16 g128"}
# mode -> (ENABLED, TRIGGER, GEMM_PREFETCH, every kind's GEMMs with PDL)
MODES = {"off": (False, True, None, False), "on": (True, True, None, False), "notrigger": (True, False, None, False),
         "all": (True, True, False, True), "prefetch": (True, True, True, True)}


def small_config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                       num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5,
                       rope_theta=100000.0, tie_word_embeddings=True, architectures=["LlamaForCausalLM"])


def set_mode(mode: str) -> None:
    from specserve.kernels import quant_matmul

    pdl.ENABLED, pdl.TRIGGER, pdl.GEMM_PREFETCH, every = MODES[mode]
    quant_matmul.FEW_ROW_TILES.update({k: t._replace(pdl=True) if every else t._replace(pdl=SHIPPED[k].pdl)
                                       for k, t in quant_matmul.FEW_ROW_TILES.items()})
    quant_matmul.plan.cache_clear()


def measure(model, label: str, read: int, bandwidth: float, rows: list, reps: int, modes: list) -> None:
    from specserve.config import EngineConfig
    from specserve.model_runner import ModelRunner

    cfg = EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=8, max_num_batched_tokens=2048,
                       num_kv_blocks=512, block_size=16)
    times: dict[str, list] = {m: [] for m in modes}
    logits, repeats_same = {}, {m: True for m in modes}
    for mode in modes + modes[::-1]:
        set_mode(mode)
        runner = ModelRunner(model, cfg, torch.device("cuda"), torch.bfloat16, num_blocks=512)
        runner.enable_graphs(5, 512)
        step = median_ms(lambda r=runner: r.execute(decode_step(1, 0, 512)), reps, torch.device("cuda"))
        verify = median_ms(lambda r=runner: r.execute(decode_step(1, 4, 512)), reps, torch.device("cuda"))
        out = tuple(runner.execute(decode_step(1, k, 512)).float().cpu() for k in (0, 4))
        if mode in logits:  # the mode's second runner: the same bits as its first
            repeats_same[mode] &= all(torch.equal(a, b) for a, b in zip(logits[mode], out))
        else:
            logits[mode] = out
        times[mode].append((step, verify))
        runner = None
        torch.cuda.empty_cache()
    base = logits[modes[0]]  # ("off", as these calls list it first)
    same = {m: all(torch.equal(a, b) for a, b in zip(base, logits[m])) for m in modes}
    floor = 1000 * read / bandwidth
    for mode in modes:
        step = statistics.mean(t[0] for t in times[mode])
        verify = statistics.mean(t[1] for t in times[mode])
        rows.append({"scheme": label, "mode": mode, "step_ms": [round(t[0], 4) for t in times[mode]],
                     "verify_ms": [round(t[1], 4) for t in times[mode]], "step_mean_ms": round(step, 4),
                     "verify_mean_ms": round(verify, 4), "floor_ms": round(floor, 4),
                     "vs_floor": round(step / floor, 3), "same_logits_as_off": same[mode] and repeats_same[mode]})
        print(json.dumps(rows[-1]), flush=True)


def main() -> None:
    from specserve.models.packed_linear import linears_replaced

    out = Path(sys.argv[1])
    wanted = (sys.argv[2] if len(sys.argv) > 2 else "small,bf16,w8a8,int4,blocks,w8a16").split(",")
    modes = (sys.argv[3] if len(sys.argv) > 3 else "off,on,notrigger").split(",")
    bandwidth = _copy_bandwidth()
    card = torch.cuda.get_device_name()
    print(f"{card}, torch {torch.__version__}, copy {bandwidth / 1e12:.2f} TB/s, PDL supported: "
          f"{pdl._supported(torch.cuda.current_device())}", flush=True)
    rows: list[dict] = []
    device = torch.device("cuda")
    if "small" in wanted:
        model = random_llama(small_config(), device)
        read = layer_bytes(model) + kv_read_bytes(model, 512)
        measure(model, "SmolLM2-135M shape, bf16", read, bandwidth, rows, reps=100, modes=modes)
        model = None
        torch.cuda.empty_cache()
    model = random_llama(llama_8b_config(), device)
    linears = {name: module for name, module in model.named_modules()
               if isinstance(module, torch.nn.Linear) and name != "lm_head"}
    for key in [w for w in wanted if w in NAMES]:
        scheme = NAMES[key]
        if scheme is not None:
            for name, linear in linears.items():
                model.set_submodule(name, quantized_layer(linear, SCHEMES[scheme]))
            linears_replaced(model)
        read = layer_bytes(model) - layer_bytes(model.model.embed_tokens) + kv_read_bytes(model, 512)
        measure(model, f"8B shape, {scheme or 'bf16'}", read, bandwidth, rows, reps=30, modes=modes)
        for name, linear in linears.items():
            model.set_submodule(name, linear)
        linears_replaced(model)
        torch.cuda.empty_cache()
        out.write_text(json.dumps({"card": card, "copy_tb_s": round(bandwidth / 1e12, 3), "rows": rows}, indent=1))
    out.write_text(json.dumps({"card": card, "copy_tb_s": round(bandwidth / 1e12, 3), "rows": rows}, indent=1))
    print(f"\n{card}, copy {bandwidth / 1e12:.2f} TB/s")
    print("| shape, scheme | mode | decode step ms (mean of 2) | x off | floor | x floor | verify 1 + 4 ms | x off | logits as off |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        base = next(b for b in rows if b["scheme"] == r["scheme"] and b["mode"] == modes[0])
        print(f"| {r['scheme']} | {r['mode']} | {r['step_mean_ms']:.3f} | {r['step_mean_ms'] / base['step_mean_ms']:.3f} | "
              f"{r['floor_ms']:.3f} | {r['vs_floor']:.2f}x | {r['verify_mean_ms']:.3f} | "
              f"{r['verify_mean_ms'] / base['verify_mean_ms']:.3f} | {r['same_logits_as_off']} |")


if __name__ == "__main__":
    main()
