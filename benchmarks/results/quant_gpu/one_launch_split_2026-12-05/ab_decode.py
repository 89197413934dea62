"""The Llama-3.1-8B-shape decode step (random weights, each scheme, CUDA-graph replay,
512 tokens of context) with the K splits summed in the launch and by a second launch, in
one process: two runners per scheme over the same weights, their graphs captured with
``ONE_LAUNCH_SUM`` on and off, timed in turns (one, two, two, one, one, two).

    python benchmarks/results/quant_gpu/one_launch_split_2026-12-05/ab_decode.py [out.json]
"""
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT.parent / "tests")]
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
    rows = []
    for label, scheme in [("bf16", None), *SCHEMES.items()]:
        if scheme is not None:
            for name, linear in linears.items():
                model.set_submodule(name, quantized_layer(linear, scheme))
        runners = {}
        for one in (True, False):
            quant_matmul.ONE_LAUNCH_SUM = one
            runners[one] = ModelRunner(model, cfg, device, torch.bfloat16, num_blocks=512)
            runners[one].enable_graphs(5, 512)
        quant_matmul.ONE_LAUNCH_SUM = True
        row = {"scheme": label, "one_step_ms": [], "two_step_ms": [], "one_verify_ms": [], "two_verify_ms": []}
        for one in (True, False, False, True, True, False):
            key = "one" if one else "two"
            row[f"{key}_step_ms"].append(round(median_ms(lambda r=runners[one]: r.execute(decode_step(1, 0, 512)), 20, device), 3))
            row[f"{key}_verify_ms"].append(round(median_ms(lambda r=runners[one]: r.execute(decode_step(1, 4, 512)), 20, device), 3))
        rows.append(row)
        print(json.dumps(row), flush=True)
        runners = None
        for name, linear in linears.items():
            model.set_submodule(name, linear)
        torch.cuda.empty_cache()
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(rows, indent=1))


main()
