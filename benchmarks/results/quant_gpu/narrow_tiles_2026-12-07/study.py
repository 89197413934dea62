"""Tiles for the float8 projections of a decode step, under PDL, on a GPU (#32):

- ``sweep``: the q/k/v (6144 x 4096), output (4096 x 4096), gate/up (28672 x 4096) and
  down (4096 x 14336) projections, W8A8 per channel, one row, each call its layer's
  quantizer and then its GEMM, 32 layers in one CUDA graph, each its own weights (more
  bytes than L2 holds), PDL on; µs a layer for column tiles of 16 to 128, K split 1 to 8
  ways, 2 or 4 pipeline stages (K tiles of 256, 4 warps, two K tiles prefetched before
  the PDL wait, as shipped), then the fastest with 2 and 8 warps; outputs against the
  shipped plan's.
- ``step``: the 8B shape's W8A8 per-channel decode and verify steps as
  ``../pdl_2026-12-06/pdl_ab.py`` measures them (one runner a mode, modes in turns then
  reversed), with the shipped plans, the sweep's fastest for all four shapes, and for
  q/k/v and o alone.

    python study.py out.json [sweep,step]
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch
from triton.runtime.errors import OutOfResources

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))
sys.path.insert(0, str(HERE.parent / "pdl_2026-12-06"))

from specserve.kernels import pdl, quant_matmul

DEV = torch.device("cuda")
ROWS: list[dict] = []
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
NARROW = ("qkv", "o")
SHIPPED = quant_matmul.plan
FORCED: dict = {}


def emit(row: dict) -> None:
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def plan(few, kind, n, k, step, device):
    """The shipped plan, but where ``FORCED`` names tiles for this (kind, n, k) and few rows."""
    return (FORCED.get((kind, n, k)) if few else None) or SHIPPED(few, kind, n, k, step, device)


quant_matmul.plan = plan


def graph_us(fns, reps: int = 30) -> float:
    """µs a call: one CUDA graph calling each of ``fns`` once, median of ``reps`` replays."""
    for fn in fns:
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(1000 * start.elapsed_time(end) / len(fns))
    return statistics.median(times)


def sweep(layers: int = 32) -> dict:
    from quant_gpu import SCHEMES, quantized_layer

    pdl.ENABLED = True
    best = {}
    for name, (n, k) in SHAPES.items():
        made = [quantized_layer(torch.nn.Linear(k, n, bias=False, device=DEV, dtype=torch.bfloat16),
                                SCHEMES["fp8 W8A8 per channel"]) for _ in range(layers)]
        x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
        shipped = SHIPPED(True, "w8a8", n, k, 256, DEV)
        FORCED.clear()
        want = made[0](x)
        results = []
        for block_n in (16, 32, 64, 128):
            for split in (1, 2, 4, 8):
                for stages in (2, 4):
                    tiles = shipped._replace(block_n=block_n, split=split, num_stages=stages)
                    FORCED[("w8a8", n, k)] = tiles
                    try:
                        err = (made[0](x).float() - want.float()).abs().max().item()
                        us = graph_us([lambda m=m, x=x: m(x) for m in made])
                    except OutOfResources as exc:  # (a plan past shared memory)
                        emit({"what": "sweep", "shape": name, "tiles": tiles._asdict(), "error": str(exc)[:200]})
                        continue
                    results.append((us, tiles))
                    emit({"what": "sweep", "shape": name, "block_n": block_n, "split": split, "stages": stages,
                          "shipped": tiles == shipped, "us": round(us, 2), "max_err": round(err, 5)})
        results.sort(key=lambda r: r[0])
        for warps in (2, 8):  # the fastest tiles with other warp counts
            tiles = results[0][1]._replace(num_warps=warps)
            FORCED[("w8a8", n, k)] = tiles
            try:
                err = (made[0](x).float() - want.float()).abs().max().item()
                us = graph_us([lambda m=m, x=x: m(x) for m in made])
            except OutOfResources as exc:
                emit({"what": "sweep", "shape": name, "tiles": tiles._asdict(), "error": str(exc)[:200]})
                continue
            results.append((us, tiles))
            emit({"what": "sweep", "shape": name, "block_n": tiles.block_n, "split": tiles.split,
                  "stages": tiles.num_stages, "warps": warps, "us": round(us, 2), "max_err": round(err, 5)})
        FORCED.clear()
        results.sort(key=lambda r: r[0])
        best[("w8a8", n, k)] = results[0][1]
        emit({"what": "sweep_best", "shape": name, "tiles": results[0][1]._asdict(), "us": round(results[0][0], 2),
              "shipped": shipped._asdict(), "shipped_us": next((round(u, 2) for u, t in results if t == shipped), None)})
        del made
        torch.cuda.empty_cache()
    return best


def step(best: dict) -> None:
    import pdl_ab
    from gpu_bench import _copy_bandwidth, kv_read_bytes, llama_8b_config, random_llama
    from quant_gpu import SCHEMES, layer_bytes, quantized_layer

    from specserve.models.packed_linear import linears_replaced

    narrow = {key: t for key, t in best.items() if key[1:] in [SHAPES[s] for s in NARROW]}
    modes = {"shipped": {}, "best": best, "best_narrow": narrow}

    def set_mode(mode: str) -> None:
        pdl.ENABLED, pdl.TRIGGER, pdl.GEMM_PREFETCH = True, True, None
        FORCED.clear()
        FORCED.update(modes[mode])

    pdl_ab.set_mode = set_mode
    bandwidth = _copy_bandwidth()
    model = random_llama(llama_8b_config(), DEV)
    for name, linear in [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]:
        model.set_submodule(name, quantized_layer(linear, SCHEMES["fp8 W8A8 per channel"]))
    linears_replaced(model)
    read = layer_bytes(model) - layer_bytes(model.model.embed_tokens) + kv_read_bytes(model, 512)
    for turn in range(2):
        rows: list = []
        pdl_ab.measure(model, "8B shape, fp8 W8A8 per channel", read, bandwidth, rows, reps=30, modes=list(modes))
        for r in rows:
            emit(dict(r, what="step", round=turn, copy_tb_s=round(bandwidth / 1e12, 3)))
    FORCED.clear()


def main() -> None:
    out = Path(sys.argv[1])
    wanted = (sys.argv[2] if len(sys.argv) > 2 else "sweep,step").split(",")
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    try:
        best = sweep() if "sweep" in wanted else {}
        if "step" in wanted and best:
            step(best)
    finally:
        out.write_text(json.dumps({"card": torch.cuda.get_device_name(), "rows": ROWS}, indent=1))


if __name__ == "__main__":
    main()
