"""The Llama-3.1-8B-shape decode and verify (1 + 4) steps (random weights, CUDA-graph
replay, 512 tokens of context) at 4 bits with both 4-bit kernels as they were (8b5ee64:
shift, mask and int-to-float a nibble) and with ``_NIBBLE_BITS``, in one process: two
runners over the same weights, their graphs captured with each pair of kernels, timed in
turns (new, old, old, new, new, old); bf16 as the control.

    python benchmarks/results/quant_gpu/int4_tiled_ptx_2026-12-05/ab_decode.py [out.json]
"""
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path[:0] = [str(ROOT), str(ROOT.parent / "tests"), str(HERE.parent / "int4_k_lanes_2026-12-05")]
import quant_matmul_8b5ee64 as before
from gpu_bench import decode_step, llama_8b_config, median_ms, random_llama
from quant_gpu import SCHEMES, quantized_layer
from specserve.kernels import quant_matmul

from specserve.config import EngineConfig
from specserve.model_runner import ModelRunner


def main() -> None:
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(device), flush=True)
    model = random_llama(llama_8b_config(), device)
    linears = {name: module for name, module in model.named_modules()
               if isinstance(module, torch.nn.Linear) and name != "lm_head"}
    cfg = EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=8, max_num_batched_tokens=2048,
                       num_kv_blocks=512, block_size=16)
    kernels = {"new": (quant_matmul._int4_row_kernel, quant_matmul._int4_kernel),
               "old": (before._int4_row_kernel, before._int4_kernel)}
    rows = []
    for label in ("bf16", "int4 W4A16 g128"):
        if label != "bf16":
            for name, linear in linears.items():
                model.set_submodule(name, quantized_layer(linear, SCHEMES[label]))
        runners = {}
        for key, kernel in kernels.items():
            quant_matmul._int4_row_kernel, quant_matmul._int4_kernel = kernel
            runners[key] = ModelRunner(model, cfg, device, torch.bfloat16, num_blocks=512)
            runners[key].enable_graphs(5, 512)
        quant_matmul._int4_row_kernel, quant_matmul._int4_kernel = kernels["new"]
        row = {"scheme": label}
        for key in ("new", "old", "old", "new", "new", "old"):
            row.setdefault(f"{key}_step_ms", []).append(
                round(median_ms(lambda r=runners[key]: r.execute(decode_step(1, 0, 512)), 20, device), 3))
            row.setdefault(f"{key}_verify_ms", []).append(
                round(median_ms(lambda r=runners[key]: r.execute(decode_step(1, 4, 512)), 20, device), 3))
        rows.append(row)
        print(json.dumps(row), flush=True)
        runners = None
        for name, linear in linears.items():
            model.set_submodule(name, linear)
        torch.cuda.empty_cache()
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(rows, indent=1))


main()
