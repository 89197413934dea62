"""Where a batch-1 decode step of the Llama-3.1-8B shape goes, per weight scheme (H100/H200):
``../step_anatomy_2026-12-05/anatomy.py`` with the layers handed their inputs as the loader
hands them (``linears_replaced``: W8A8's norms and SiLU·mul round to float8 themselves), and
only the schemes named on the command line.

For each scheme: the step as ``quant_gpu.py --sections decode`` times it (``execute``:
host preparation and graph replay), the graph replay alone (CUDA events around
``replay()``), and a torch profile of replays, its kernels grouped into the quantized
projections' kernels, the bf16 LM head's, attention's, and the rest (norms, rotary,
activation quantizers, sums of K splits). Each group's µs a step beside its floor.

    python anatomy_shipped.py out.json [scheme,scheme,...]
"""
from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
BENCH = HERE.parents[2]
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent / "tests"))

from gpu_bench import (
    _copy_bandwidth,
    decode_step,
    kv_read_bytes,
    llama_8b_config,
    median_ms,
    random_llama,
)
from quant_gpu import SCHEMES, layer_bytes, quantized_layer


def classify(name: str) -> str:
    """A kernel's group: the projections' GEMMs, their helpers (activation quantizer, sums
    of K splits), cuBLAS (the bf16 projections and the LM head), attention, the rest."""
    low = name.lower()
    if "attention" in low or "reduce_splits" in low:
        return "attention"
    if any(k in low for k in ("_fp8_kernel", "_fp8_left", "_fp8_row", "_int4_kernel", "_int4_row", "_matmul_kernel")):
        return "quantized gemm"
    if "_sum_splits" in low or "_quantize_kernel" in low:
        return "gemm helpers"
    if any(k in low for k in ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas")):
        return "cublas"
    return "other"


def replay_ms(runner, step, reps: int):
    runner.execute(step)  # inputs written; the replays below recompute the same step
    graphs = runner.graphs
    graph = graphs._get(graphs._shape(step.scheduled))[0]
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), graph


def profile(run, reps: int = 5) -> dict:
    """Kernel name -> (launches, µs) per call of ``run``."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    kernels = defaultdict(lambda: [0, 0.0])
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[e.name]
            k[0] += 1
            k[1] += e.time_range.elapsed_us()
    return {name: (n / reps, us / reps) for name, (n, us) in kernels.items()}


def main() -> None:
    out = Path(sys.argv[1])
    from specserve.config import EngineConfig
    from specserve.model_runner import ModelRunner
    from specserve.models.packed_linear import linears_replaced

    device = torch.device("cuda")
    bandwidth = _copy_bandwidth()
    print(f"{torch.cuda.get_device_name()} copy {bandwidth / 1e12:.2f} TB/s", flush=True)
    model = random_llama(llama_8b_config(), device)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    context, rows = 512, []
    cfg = EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=8, max_num_batched_tokens=2048,
                       num_kv_blocks=512, block_size=16)
    head_bytes = layer_bytes(model.lm_head)
    wanted = sys.argv[2].split(",") if len(sys.argv) > 2 else ["bf16", *SCHEMES]
    for label, scheme in [("bf16", None), *SCHEMES.items()]:
        if label not in wanted:
            continue
        if scheme is not None:
            for name, linear in linears.items():
                model.set_submodule(name, quantized_layer(linear, scheme))
            linears_replaced(model)  # as the loader does
        proj_bytes = sum(layer_bytes(model.get_submodule(n)) for n in linears)
        kv = kv_read_bytes(model, context)
        runner = ModelRunner(model, cfg, device, torch.bfloat16, num_blocks=512)
        runner.enable_graphs(5, 512)
        step = decode_step(1, 0, context)
        execute = median_ms(lambda r=runner, s=step: r.execute(s), 50, device)
        replay, graph = replay_ms(runner, step, 50)
        kernels, profiled = profile(graph.replay), "graph"
        if not kernels:  # no kernel seen inside the graph: the same step run eagerly
            graphs, runner.graphs = runner.graphs, None
            runner.execute(step)
            kernels, profiled = profile(lambda r=runner, s=step: r.execute(s)), "eager"
            runner.graphs = graphs
        groups = defaultdict(lambda: [0.0, 0.0])
        for name, (n, us) in kernels.items():
            g = groups[classify(name)]
            g[0] += n
            g[1] += us
        row = {"scheme": label, "profiled": profiled, "execute_ms": round(execute, 3), "replay_ms": round(replay, 3),
               "kernels_ms": round(sum(us for _, us in kernels.values()) / 1000, 3),
               "floor_ms": round(1000 * (proj_bytes + head_bytes + kv) / bandwidth, 3),
               "proj_floor_ms": round(1000 * proj_bytes / bandwidth, 3),
               "head_floor_ms": round(1000 * head_bytes / bandwidth, 3),
               "kv_floor_ms": round(1000 * kv / bandwidth, 3),
               "groups": {g: {"launches": round(n, 1), "ms": round(us / 1000, 3)} for g, (n, us) in groups.items()},
               "kernels": sorted(([name[:120], round(n, 1), round(us, 1)] for name, (n, us) in kernels.items()),
                                 key=lambda r: -r[2])}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), flush=True)
        for name, n, us in row["kernels"][:14]:
            print(f"    {us:9.1f} µs  x{n:5.1f}  {name}", flush=True)
        runner = graph = None
        for name, linear in linears.items():
            model.set_submodule(name, linear)
        linears_replaced(model)
        torch.cuda.empty_cache()
    out.write_text(json.dumps({"card": torch.cuda.get_device_name(), "copy_tb_s": bandwidth / 1e12,
                               "context": context, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
