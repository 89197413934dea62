"""A float8 projection's K splits added by the norm after it, on a GPU (#32):

- ``pair``: a projection (4096 x 4096 as the output projection, 4096 x 14,336 as the down
  projection; W8A8 per channel, one row, its input rounded by its own quantizer) and then
  the norm that adds it to the residual and hands the next projection float8 rows, 32 such
  layers in one CUDA graph, each its own weights (more bytes than L2 holds); µs a layer,
  with the splits added by a launch of their own ("summed"), by the norm ("handed",
  ``quant_matmul.SplitSums``) or by the GEMM's last program ("in launch",
  ``FewRowTiles.sum_in_launch``), PDL off and on; outputs compared.
- ``step``: the 8B shape's decode and verify steps as ``../pdl_2026-12-06/pdl_ab.py``
  measures them (one runner a mode, modes in turns then reversed, PDL on): W8A8 per
  channel in three rounds of summed, handed and in launch; W8A8 in 128 x 128 blocks and
  W8A16 per channel in one round of summed and handed.

    python study.py out.json [pair,step]
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))
sys.path.insert(0, str(HERE.parent / "pdl_2026-12-06"))

from specserve.kernels import fused_norm, pdl, quant_matmul

from specserve.models.checkpoint_quant import Fp8Linear

DEV = torch.device("cuda")
ROWS: list[dict] = []
W8A8 = quant_matmul.FEW_ROW_TILES["w8a8"]


def emit(row: dict) -> None:
    ROWS.append(row)
    print(json.dumps(row), flush=True)


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


def set_mode(mode: str, modules) -> None:
    """``summed``, ``handed`` or ``in_launch`` for the float8 layers among ``modules``."""
    quant_matmul.FEW_ROW_TILES["w8a8"] = W8A8._replace(sum_in_launch=mode == "in_launch")
    quant_matmul.plan.cache_clear()
    for m in modules:
        if isinstance(m, Fp8Linear):
            m.hands_split_sums = mode == "handed"


def pair(layers: int = 32) -> None:
    from quant_gpu import SCHEMES, quantized_layer

    x = torch.randn(1, 4096, device=DEV, dtype=torch.bfloat16)
    for name, k in (("o", 4096), ("down", 14336)):
        made = []
        for _ in range(layers):
            linear = torch.nn.Linear(k, 4096, bias=False, device=DEV, dtype=torch.bfloat16)
            made.append((quantized_layer(linear, SCHEMES["fp8 W8A8 per channel"]),
                         torch.randn(1, 4096, device=DEV, dtype=torch.bfloat16),
                         torch.rand(4096, device=DEV, dtype=torch.bfloat16) + 0.5))
        x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)

        def layer_fns(made=made, x=x):
            return [lambda o=o, r=r, w=w: fused_norm.add_rms_norm(o(x), r, w, 1e-5, fp8_group=4096)
                    for o, r, w in made]

        outs = {}
        for mode in ("summed", "handed", "in_launch"):
            set_mode(mode, [o for o, _, _ in made])
            outs[mode] = [fn() for fn in layer_fns()[:4]]
        same = {m: all(torch.equal(a[1], b[1]) and torch.equal(a[0][0].view(torch.uint8), b[0][0].view(torch.uint8))
                       for a, b in zip(outs["summed"], outs[m])) for m in outs}
        tiles = quant_matmul.plan(True, "w8a8", 4096, k, 256, DEV)
        emit({"what": "pair", "projection": name, "k": k, "split": tiles.split, "same_bits_as_summed": same})
        for turn in range(2):
            for on in (False, True):
                pdl.ENABLED = on
                order = ("summed", "handed", "in_launch") if turn == 0 else ("in_launch", "handed", "summed")
                for mode in order:
                    set_mode(mode, [o for o, _, _ in made])
                    emit({"what": "pair", "projection": name, "pdl": on, "mode": mode, "turn": turn,
                          "us": round(graph_us(layer_fns()), 2)})
        pdl.ENABLED = True
        set_mode("handed", [])
        del made
        torch.cuda.empty_cache()


def step() -> None:
    import pdl_ab
    from gpu_bench import _copy_bandwidth, kv_read_bytes, llama_8b_config, random_llama
    from quant_gpu import SCHEMES, layer_bytes, quantized_layer

    from specserve.models.packed_linear import linears_replaced

    bandwidth = _copy_bandwidth()
    model = random_llama(llama_8b_config(), DEV)

    def mode_of(mode: str) -> None:
        pdl.ENABLED, pdl.TRIGGER, pdl.GEMM_PREFETCH = True, True, None
        linears_replaced(model)  # (as loaded: the output and down projections hand their splits on)
        if mode != "handed":
            set_mode(mode, model.modules())
        else:
            set_mode("summed", [])  # (the tiles as shipped)

    pdl_ab.set_mode = mode_of
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    for scheme, rounds, modes in (("fp8 W8A8 per channel", 3, ["summed", "handed", "in_launch"]),
                                  ("fp8 W8A8 128x128 blocks", 1, ["summed", "handed"]),
                                  ("fp8 W8A16 per channel", 1, ["summed", "handed"])):
        for name, linear in linears:
            model.set_submodule(name, quantized_layer(linear, SCHEMES[scheme]))
        linears_replaced(model)
        handing = sum(getattr(m, "hands_split_sums", False) for m in model.modules())
        read = layer_bytes(model) - layer_bytes(model.model.embed_tokens) + kv_read_bytes(model, 512)
        for turn in range(rounds):
            rows: list = []
            pdl_ab.measure(model, f"8B shape, {scheme}", read, bandwidth, rows, reps=30, modes=modes)
            for r in rows:
                emit(dict(r, what="step", round=turn, handing_layers=handing, copy_tb_s=round(bandwidth / 1e12, 3)))
        for name, linear in linears:
            model.set_submodule(name, linear)
        linears_replaced(model)
        torch.cuda.empty_cache()
    mode_of("handed")


def main() -> None:
    out = Path(sys.argv[1])
    wanted = (sys.argv[2] if len(sys.argv) > 2 else "pair,step").split(",")
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    try:
        if "pair" in wanted:
            pair()
        if "step" in wanted:
            step()
    finally:
        out.write_text(json.dumps({"card": torch.cuda.get_device_name(), "rows": ROWS}, indent=1))


if __name__ == "__main__":
    main()
