"""Norms and SiLU·mul handing the float8 projections their inputs rounded (``hand_fp8``,
``Fp8Rows``) against each projection launching its own quantizer, in the Llama-3.1-8B
shape's decode step (batch 1, 512 tokens of context), a verify step of 1 + 4 tokens and a
512-token prefill chunk, for FP8 W8A8 per channel and in 128 x 128 blocks; the two taking
turns in one process (handed, own, own, handed). Also the kernels alone, as one graph
replay of 20 launches: the norm and the activation with and without the quantizer. Last,
W8A16 per channel's decode step with its one-row kernel's K splits added by a second
launch (as shipped) or by each tile's last program (``sum_in_launch``, as 4-bit does).

    python handed_ab.py out.json [per-channel | kernels]

(``per-channel``: the kernels and W8A8 per channel only; ``kernels``: the kernels only.)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))
sys.path.insert(0, str(HERE.parents[3] / "tests"))

from gpu_bench import (
    _copy_bandwidth,
    decode_step,
    graph_us,
    kv_read_bytes,
    llama_8b_config,
    median_ms,
    random_llama,
)
from quant_gpu import SCHEMES, layer_bytes, quantized_layer
from specserve.kernels import fused_act, fused_norm, quant_matmul


def kernels(rows: list) -> None:
    dev = torch.device("cuda")
    x, r = (torch.randn(1, 4096, device=dev, dtype=torch.bfloat16) for _ in range(2))
    w = torch.rand(4096, device=dev, dtype=torch.bfloat16) + 0.5
    gate_up = torch.randn(1, 2 * 14336, device=dev, dtype=torch.bfloat16)
    for group, label in ((4096, "per row"), (128, "groups of 128")):
        act_group = 14336 if group == 4096 else 128
        cases = {
            "add_rms_norm, then the quantizer": lambda g=group: quant_matmul.quantize_rows(
                fused_norm.add_rms_norm(x, r, w, 1e-5)[0], g),
            "add_rms_norm handing float8": lambda g=group: fused_norm.add_rms_norm(x, r, w, 1e-5, fp8_group=g),
            "add_rms_norm alone": lambda: fused_norm.add_rms_norm(x, r, w, 1e-5),
            "silu_and_mul, then the quantizer": lambda g=act_group: quant_matmul.quantize_rows(
                fused_act.silu_and_mul(gate_up), g),
            "silu_and_mul handing float8": lambda g=act_group: fused_act.silu_and_mul(gate_up, fp8_group=g),
            "silu_and_mul alone": lambda: fused_act.silu_and_mul(gate_up),
        }
        for name, fn in cases.items():
            rows.append({"what": "kernels", "groups": label, "case": name, "us": round(graph_us(fn), 2)})
            print(json.dumps(rows[-1]), flush=True)


def prefill_step(tokens: int, block_size: int = 16):
    from specserve.sampling_params import SamplingParams
    from specserve.scheduler import ScheduledRequest, SchedulerOutput

    table = list(range(-(-tokens // block_size)))
    return SchedulerOutput([ScheduledRequest("p", [5] * tokens, 0, table, SamplingParams())], [])


def main() -> None:
    from specserve.config import EngineConfig
    from specserve.model_runner import ModelRunner
    from specserve.models.packed_linear import linears_replaced

    out, rows = Path(sys.argv[1]), []
    bandwidth = _copy_bandwidth()
    print(f"{torch.cuda.get_device_name()} copy {bandwidth / 1e12:.2f} TB/s", flush=True)
    kernels(rows)
    if sys.argv[2:] == ["kernels"]:
        out.write_text(json.dumps({"card": torch.cuda.get_device_name(), "copy_tb_s": round(bandwidth / 1e12, 2),
                                   "rows": rows}, indent=1) + "\n")
        return
    device = torch.device("cuda")
    model = random_llama(llama_8b_config(), device)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    cfg = EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=8, max_num_batched_tokens=2048,
                       num_kv_blocks=512, block_size=16)
    quick = sys.argv[2:] == ["per-channel"]
    for scheme in ("fp8 W8A8 per channel",) + (() if quick else ("fp8 W8A8 128x128 blocks",)):
        for name, linear in linears.items():
            model.set_submodule(name, quantized_layer(linear, SCHEMES[scheme]))
        linears_replaced(model)
        handing = {m: m.fp8_group for m in model.modules() if getattr(m, "fp8_group", 0)}
        floor = 1000 * (layer_bytes(model) - layer_bytes(model.model.embed_tokens) + kv_read_bytes(model, 512)) / bandwidth
        logits = {}
        for variant in ("handed", "own", "own", "handed"):
            for module, group in handing.items():
                module.fp8_group = group if variant == "handed" else 0
            runner = ModelRunner(model, cfg, device, torch.bfloat16, num_blocks=512)
            runner.enable_graphs(5, 512)
            logits.setdefault(variant, runner.execute(decode_step(1, 4, 512)).clone())
            step = median_ms(lambda r=runner: r.execute(decode_step(1, 0, 512)), 50, device)
            verify = median_ms(lambda r=runner: r.execute(decode_step(1, 4, 512)), 50, device)
            prefill = median_ms(lambda r=runner: r.execute(prefill_step(512)), 20, device)
            rows.append({"what": "8B shape", "scheme": scheme, "variant": variant, "handing": len(handing),
                         "decode_ms": round(step, 3), "floor_ms": round(floor, 3), "vs_floor": round(step / floor, 3),
                         "verify_1_plus_4_ms": round(verify, 3), "prefill_512_ms": round(prefill, 3)})
            print(json.dumps(rows[-1]), flush=True)
            runner = None
            torch.cuda.empty_cache()
        rows.append({"what": "8B shape", "scheme": scheme, "verify logits, handed and own, bit for bit":
                     torch.equal(logits["handed"], logits["own"])})
        print(json.dumps(rows[-1]), flush=True)
        for module, group in handing.items():
            module.fp8_group = group
    if quick:
        out.write_text(json.dumps({"card": torch.cuda.get_device_name(), "copy_tb_s": round(bandwidth / 1e12, 2),
                                   "rows": rows}, indent=1) + "\n")
        return
    for name, linear in linears.items():
        model.set_submodule(name, quantized_layer(linear, SCHEMES["fp8 W8A16 per channel"]))
    linears_replaced(model)
    shipped = quant_matmul.FEW_ROW_TILES["w8a16_row"]
    for variant in ("second launch", "in the launch", "in the launch", "second launch"):
        quant_matmul.FEW_ROW_TILES["w8a16_row"] = shipped._replace(sum_in_launch=variant == "in the launch")
        quant_matmul.plan.cache_clear()
        runner = ModelRunner(model, cfg, device, torch.bfloat16, num_blocks=512)
        runner.enable_graphs(5, 512)
        step = median_ms(lambda r=runner: r.execute(decode_step(1, 0, 512)), 50, device)
        rows.append({"what": "8B shape", "scheme": "fp8 W8A16 per channel", "variant": f"K splits summed {variant}",
                     "decode_ms": round(step, 3)})
        print(json.dumps(rows[-1]), flush=True)
        runner = None
        torch.cuda.empty_cache()
    quant_matmul.FEW_ROW_TILES["w8a16_row"] = shipped
    quant_matmul.plan.cache_clear()
    out.write_text(json.dumps({"card": torch.cuda.get_device_name(), "copy_tb_s": round(bandwidth / 1e12, 2),
                               "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
