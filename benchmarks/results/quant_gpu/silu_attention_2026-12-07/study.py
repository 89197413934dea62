"""Two pieces of the batch-1 decode step outside the GEMMs, on a GPU (#32):

- ``kernels``: SiLU·mul handing the down projection float8 per row (the Llama-3.1-8B row
  of 14,336) in one program a row against over the row's blocks in two launches
  (``fused_act.ROW_SPLIT_MOST``), 1 and 5 rows, PDL off and on; µs a call inside a CUDA
  graph of 32 calls, each on its own input; the two forms' outputs compared bit for bit.
- ``attention``: the paged attention of one decode token (32 query heads, 8 KV heads of
  128, blocks of 16) over 513 and 2,048 keys, for launch plans (KV splits, keys a tile,
  warps, stages), and the plans ``plan_launch`` makes for graphs captured at a
  ``max_model_len`` of 512 and 8,192, with the split reduce over every split or the used
  ones only (``REDUCE_USED_ONLY``); µs a layer inside a graph of 32 layers, each on its own
  cache (more bytes than L2 holds), PDL off (each layer's own time) and on.
- ``step``: the 8B shape's decode and verify steps (W8A8 per channel, random weights) as
  ``../pdl_2026-12-06/pdl_ab.py`` measures them, modes taking turns: as before this
  change, with the SiLU·mul split (and the reduce over the used splits), and with both and
  the attention's best decode plan at 513 keys from ``attention`` (when it ran first).

- ``final``: as shipped (the SiLU·mul split, the reduce over used splits, one-token tiles
  split down to 32 keys) against before, W8A8 per channel in three rounds, 4-bit and W8A8
  in 128 x 128 blocks in one.

    python study.py out.json [kernels,attention,step,final]
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch
from triton.runtime.errors import OutOfResources

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))
sys.path.insert(0, str(HERE.parent / "pdl_2026-12-06"))

from specserve.kernels import fused_act, paged_attention, pdl

DEV = torch.device("cuda")
KV_LENS = (513, 2048)
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


def same_bits(a, b) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def kernels() -> None:
    for rows in (1, 5):
        inputs = [torch.randn(rows, 2 * 14336, device=DEV, dtype=torch.bfloat16) * 3 for _ in range(32)]
        outs = {}
        for split in (0, 16, 0, 16):
            fused_act.ROW_SPLIT_MOST = split
            outs.setdefault(split, [fused_act.silu_and_mul(x, fp8_group=14336) for x in inputs[:4]])
            for on in (False, True):
                pdl.ENABLED = on
                us = graph_us([lambda x=x: fused_act.silu_and_mul(x, fp8_group=14336) for x in inputs])
                emit({"what": "silu_fp8_row", "rows": rows, "form": "split" if split else "one program",
                      "pdl": on, "us": round(us, 2)})
        same = all(same_bits(a, b) for pa, pb in zip(outs[0], outs[16]) for a, b in zip(pa, pb))
        emit({"what": "silu_fp8_row_bits", "rows": rows, "same_bits": same})
    fused_act.ROW_SPLIT_MOST, pdl.ENABLED = 16, True


def attention_layers(kv_len: int, layers: int = 32, block_size: int = 16):
    blocks = -(-kv_len // block_size)
    caches = []
    for layer in range(layers):
        gen = torch.Generator(device=DEV).manual_seed(layer)
        k = torch.randn(blocks + 8, block_size, 8, 128, device=DEV, dtype=torch.bfloat16, generator=gen)
        v = torch.randn(blocks + 8, block_size, 8, 128, device=DEV, dtype=torch.bfloat16, generator=gen)
        table = torch.randperm(blocks + 8, device=DEV, generator=gen)[:blocks].to(torch.int32)[None]
        caches.append((k, v, table))
    query = torch.randn(1, 32, 128, device=DEV, dtype=torch.bfloat16)
    cu = torch.tensor([0, 1], device=DEV, dtype=torch.int32)
    seq = torch.tensor([kv_len], device=DEV, dtype=torch.int32)
    return caches, query, cu, seq


def run_plan(layers, plan):
    caches, query, cu, seq = layers
    return [lambda k=k, v=v, t=t: paged_attention.paged_attention(query, k, v, t, cu, seq, 0.088, plan=plan)
            for k, v, t in caches]


def attention() -> dict:
    best = {}
    for kv_len in KV_LENS:
        layers = attention_layers(kv_len)
        (k0, v0, table0), query, cu, seq = layers[0][0], *layers[1:]
        want = paged_attention.paged_attention(query, k0, v0, table0, cu, seq, 0.088, max_query_len=1,
                                               max_seq_len=kv_len, num_splits=1)
        results = []
        for splits in (1, 2, 3, 4, 5, 8, 9, 16, 32):
            for block_n in (32, 64, 128):
                for warps in (2, 4):
                    for stages in (1, 2, 3):
                        plan = paged_attention.LaunchPlan(1, 16, block_n, 1, splits, warps, stages)
                        pdl.ENABLED = False
                        try:
                            got = run_plan(layers, plan)[0]()
                            us = graph_us(run_plan(layers, plan))
                        except OutOfResources as exc:  # (a plan past shared memory)
                            emit({"what": "attention", "kv": kv_len, "plan": plan.__dict__, "error": str(exc)[:200]})
                            continue
                        err = (got.float() - want.float()).abs().max().item()
                        results.append((us, plan))
                        emit({"what": "attention", "kv": kv_len, "splits": splits, "block_n": block_n,
                              "warps": warps, "stages": stages, "pdl": False, "us": round(us, 2),
                              "max_err": round(err, 5)})
        results.sort(key=lambda r: r[0])
        shipped = {f"plan at max_model_len {m}": paged_attention.plan_launch(query, k0, 1, 1, m) for m in (512, 8192)}
        for name, plan in [*shipped.items(), *((f"top {i}", p) for i, (_, p) in enumerate(results[:4]))]:
            for used_only in (True, False):
                paged_attention.REDUCE_USED_ONLY = used_only
                for on in (False, True):
                    pdl.ENABLED = on
                    us = graph_us(run_plan(layers, plan))
                    emit({"what": "attention_pick", "kv": kv_len, "name": name, "plan": plan.__dict__,
                          "reduce_used_only": used_only, "pdl": on, "us": round(us, 2)})
        paged_attention.REDUCE_USED_ONLY, pdl.ENABLED = True, True
        best[kv_len] = results[0][1]
    return best


def step(best: dict | None) -> None:
    import pdl_ab
    from gpu_bench import _copy_bandwidth, kv_read_bytes, llama_8b_config, random_llama
    from quant_gpu import SCHEMES, layer_bytes, quantized_layer
    from specserve.models.packed_linear import linears_replaced

    shipped_plan = paged_attention.plan_launch
    decode_plan = best.get(513) if best else None

    def plan_launch(query, k_cache, num_reqs, max_query_len, max_seq_len, num_splits=None, deterministic=False):
        plan = shipped_plan(query, k_cache, num_reqs, max_query_len, max_seq_len, num_splits, deterministic)
        if MODE_PLAN[0] is not None and max_query_len <= 1 and not deterministic:  # decode: the sweep's best
            plan = dataclasses.replace(MODE_PLAN[0], block_m=plan.block_m, num_tiles=plan.num_tiles)
        return plan

    MODE_PLAN = [None]
    modes = {"before": (0, False, None), "silu_split": (16, True, None)}  # (and the reduce over used splits)
    if decode_plan is not None:
        modes["best_attention"] = (16, True, decode_plan)

    def set_mode(mode: str) -> None:
        pdl.ENABLED, pdl.TRIGGER, pdl.GEMM_PREFETCH = True, True, None
        fused_act.ROW_SPLIT_MOST, paged_attention.REDUCE_USED_ONLY, MODE_PLAN[0] = modes[mode]

    paged_attention.plan_launch = plan_launch
    pdl_ab.set_mode = set_mode
    bandwidth = _copy_bandwidth()
    model = random_llama(llama_8b_config(), DEV)
    for name, linear in [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]:
        model.set_submodule(name, quantized_layer(linear, SCHEMES["fp8 W8A8 per channel"]))
    linears_replaced(model)
    read = layer_bytes(model) - layer_bytes(model.model.embed_tokens) + kv_read_bytes(model, 512)
    rows: list = []
    pdl_ab.measure(model, "8B shape, fp8 W8A8 per channel", read, bandwidth, rows, reps=30, modes=list(modes))
    for r in rows:
        r["what"] = "step"
        r["copy_tb_s"] = round(bandwidth / 1e12, 3)
        if r["mode"] == "best_attention":
            r["decode_plan"] = decode_plan.__dict__
        emit(r)


def final(turns: int = 3) -> None:
    """As shipped against before (the three changes off), per scheme; W8A8 per channel in
    ``turns`` rounds of ``pdl_ab.measure`` (each: before, after, after, before)."""
    import pdl_ab
    from gpu_bench import _copy_bandwidth, kv_read_bytes, llama_8b_config, random_llama
    from quant_gpu import SCHEMES, layer_bytes, quantized_layer
    from specserve.models.packed_linear import linears_replaced

    modes = {"before": (0, False, 128), "after": (16, True, 32)}

    def set_mode(mode: str) -> None:
        pdl.ENABLED, pdl.TRIGGER, pdl.GEMM_PREFETCH = True, True, None
        fused_act.ROW_SPLIT_MOST, paged_attention.REDUCE_USED_ONLY, paged_attention._MIN_DECODE_SPLIT_TOKENS = \
            modes[mode]

    pdl_ab.set_mode = set_mode
    bandwidth = _copy_bandwidth()
    model = random_llama(llama_8b_config(), DEV)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    for scheme, rounds in (("fp8 W8A8 per channel", turns), ("int4 W4A16 g128", 1), ("fp8 W8A8 128x128 blocks", 1)):
        for name, linear in linears:
            model.set_submodule(name, quantized_layer(linear, SCHEMES[scheme]))
        linears_replaced(model)
        read = layer_bytes(model) - layer_bytes(model.model.embed_tokens) + kv_read_bytes(model, 512)
        for turn in range(rounds):
            rows: list = []
            pdl_ab.measure(model, f"8B shape, {scheme}", read, bandwidth, rows, reps=30, modes=list(modes))
            for r in rows:
                emit(dict(r, what="final", round=turn, copy_tb_s=round(bandwidth / 1e12, 3)))
        for name, linear in linears:
            model.set_submodule(name, linear)
        linears_replaced(model)
        torch.cuda.empty_cache()


def main() -> None:
    out = Path(sys.argv[1])
    wanted = (sys.argv[2] if len(sys.argv) > 2 else "kernels,attention,step").split(",")
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    best = None
    try:
        if "kernels" in wanted:
            kernels()
        if "attention" in wanted:
            best = attention()
        if "step" in wanted:
            step(best)
        if "final" in wanted:
            final()
    finally:
        out.write_text(json.dumps({"card": torch.cuda.get_device_name(), "rows": ROWS}, indent=1))


if __name__ == "__main__":
    main()
