"""The per-token float8 input quantizer read once (``quantize_rows``, groups up to
``ONE_PASS_MAX``) against its 1,024-wide two-pass loop (``ONE_PASS_MAX = 0``), alone and
in the Llama-3.1-8B shape's batch-1 decode step with FP8 W8A8 per-channel projections;
the two taking turns in one process (new, old, old, new).

    python quantizer_ab.py out.json
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
    llama_8b_config,
    median_ms,
    random_llama,
)
from quant_gpu import SCHEMES, quantized_layer
from specserve.kernels import quant_matmul


def quantizer_us(k: int, reps: int = 30) -> float:
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    return graph_us(lambda: quant_matmul.quantize_rows(x, k), reps=reps)


def main() -> None:
    from specserve.config import EngineConfig
    from specserve.model_runner import ModelRunner

    out, rows = Path(sys.argv[1]), []
    print(f"{torch.cuda.get_device_name()} copy {_copy_bandwidth() / 1e12:.2f} TB/s", flush=True)
    order = [("one pass", 16384), ("two passes", 0), ("two passes", 0), ("one pass", 16384)]
    for name, limit in order:
        quant_matmul.ONE_PASS_MAX = limit
        for k in (4096, 14336):
            rows.append({"what": "quantizer", "variant": name, "k": k, "us": round(quantizer_us(k), 2)})
            print(json.dumps(rows[-1]), flush=True)
    device = torch.device("cuda")
    model = random_llama(llama_8b_config(), device)
    for name, linear in [(n, m) for n, m in model.named_modules()
                         if isinstance(m, torch.nn.Linear) and n != "lm_head"]:
        model.set_submodule(name, quantized_layer(linear, SCHEMES["fp8 W8A8 per channel"]))
    cfg = EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=8, max_num_batched_tokens=2048,
                       num_kv_blocks=512, block_size=16)
    step = decode_step(1, 0, 512)
    for name, limit in order:
        quant_matmul.ONE_PASS_MAX = limit
        runner = ModelRunner(model, cfg, device, torch.bfloat16, num_blocks=512)
        runner.enable_graphs(5, 512)
        execute = median_ms(lambda r=runner: r.execute(step), 50, device)
        verify = median_ms(lambda r=runner: r.execute(decode_step(1, 4, 512)), 50, device)
        rows.append({"what": "decode step, fp8 W8A8 per channel", "variant": name, "execute_ms": round(execute, 3),
                     "verify_1_plus_4_ms": round(verify, 3)})
        print(json.dumps(rows[-1]), flush=True)
        runner = None
        torch.cuda.empty_cache()
    out.write_text(json.dumps({"card": torch.cuda.get_device_name(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
