"""The output projection's weights asked of L2 while the attention runs, on a GPU (#32):

- ``pair``: a decode token's attention (32 query heads, 8 KV heads of 128, 513 keys, the
  plan a graph captured at ``max_model_len`` 512 gets) and then the output projection
  (4096 x 4096, W8A8 per channel or 4-bit in groups of 128), 32 such layers in one CUDA
  graph, each its own cache and weights (more bytes than L2 holds); µs a layer, with the
  attention asking L2 for the projection's weights (``paged_attention``'s ``prefetch``)
  or not, PDL off and on; outputs compared bit for bit.
- ``step``: the 8B shape's decode and verify steps as ``../pdl_2026-12-06/pdl_ab.py``
  measures them (one runner a mode, modes in turns then reversed, PDL on), with the
  prefetch off and on: W8A8 per channel in three rounds, 4-bit and W8A8 in 128 x 128
  blocks in one; bf16 (whose 33.5 MB weight is past half of L2) with the share raised to
  0.75.

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

from specserve.kernels import paged_attention, pdl

DEV = torch.device("cuda")
ROWS: list[dict] = []


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


def pair(kv_len: int = 513, layers: int = 32, block_size: int = 16) -> None:
    from quant_gpu import SCHEMES, quantized_layer

    from specserve.models.llama import streamed_weights

    blocks = -(-kv_len // block_size)
    query = torch.randn(1, 32, 128, device=DEV, dtype=torch.bfloat16)
    cu = torch.tensor([0, 1], device=DEV, dtype=torch.int32)
    seq = torch.tensor([kv_len], device=DEV, dtype=torch.int32)
    plan = paged_attention.plan_launch(query, torch.empty(1, block_size, 8, 128, device=DEV, dtype=torch.bfloat16),
                                       1, 1, 512)
    for scheme in ("fp8 W8A8 per channel", "int4 W4A16 g128"):
        made = []
        for layer in range(layers):
            gen = torch.Generator(device=DEV).manual_seed(layer)
            k = torch.randn(blocks + 8, block_size, 8, 128, device=DEV, dtype=torch.bfloat16, generator=gen)
            v = torch.randn(blocks + 8, block_size, 8, 128, device=DEV, dtype=torch.bfloat16, generator=gen)
            table = torch.randperm(blocks + 8, device=DEV, generator=gen)[:blocks].to(torch.int32)[None]
            linear = torch.nn.Linear(4096, 4096, bias=False, device=DEV, dtype=torch.bfloat16)
            made.append((k, v, table, quantized_layer(linear, SCHEMES[scheme])))

        def layer_fns(prefetch: bool, made=made):
            return [lambda k=k, v=v, t=t, o=o: o(paged_attention.paged_attention(
                query, k, v, t, cu, seq, 0.088, plan=plan, prefetch=streamed_weights(o) if prefetch else None
            ).reshape(1, 4096)) for k, v, t, o in made]

        outs = {p: [fn() for fn in layer_fns(p)[:4]] for p in (False, True)}
        same = all(torch.equal(a, b) for a, b in zip(outs[False], outs[True]))
        weight = streamed_weights(made[0][3])
        emit({"what": "pair", "scheme": scheme, "weight_mb": round(weight.numel() * weight.element_size() / 1e6, 2),
              "lines": paged_attention.prefetched_lines(weight), "same_bits": same})
        for turn in range(2):
            for on in (False, True):
                pdl.ENABLED = on
                for prefetch in ((False, True) if turn == 0 else (True, False)):
                    emit({"what": "pair", "scheme": scheme, "pdl": on, "prefetch": prefetch, "turn": turn,
                          "us": round(graph_us(layer_fns(prefetch)), 2)})
        pdl.ENABLED = True
        del made
        torch.cuda.empty_cache()


def step() -> None:
    import pdl_ab
    from gpu_bench import _copy_bandwidth, kv_read_bytes, llama_8b_config, random_llama
    from quant_gpu import SCHEMES, layer_bytes, quantized_layer

    from specserve.models.packed_linear import linears_replaced

    modes = {"off": (False, 0.5), "on": (True, 0.5), "wide": (True, 0.75)}

    def set_mode(mode: str) -> None:
        pdl.ENABLED, pdl.TRIGGER, pdl.GEMM_PREFETCH = True, True, None
        paged_attention.PREFETCH_NEXT, paged_attention.PREFETCH_L2_SHARE = modes[mode]

    pdl_ab.set_mode = set_mode
    bandwidth = _copy_bandwidth()
    model = random_llama(llama_8b_config(), DEV)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    for scheme, rounds, wanted in (("fp8 W8A8 per channel", 3, ["off", "on"]), ("int4 W4A16 g128", 1, ["off", "on"]),
                                   ("fp8 W8A8 128x128 blocks", 1, ["off", "on"]), ("bf16", 1, ["off", "wide"])):
        if scheme != "bf16":
            for name, linear in linears:
                model.set_submodule(name, quantized_layer(linear, SCHEMES[scheme]))
        linears_replaced(model)
        read = layer_bytes(model) - layer_bytes(model.model.embed_tokens) + kv_read_bytes(model, 512)
        for turn in range(rounds):
            rows: list = []
            pdl_ab.measure(model, f"8B shape, {scheme}", read, bandwidth, rows, reps=30, modes=wanted)
            for r in rows:
                emit(dict(r, what="step", round=turn, copy_tb_s=round(bandwidth / 1e12, 3)))
        for name, linear in linears:
            model.set_submodule(name, linear)
        linears_replaced(model)
        torch.cuda.empty_cache()
    set_mode("on")


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
