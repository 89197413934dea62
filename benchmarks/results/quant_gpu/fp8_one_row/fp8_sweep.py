"""FP8 one-row kernel against the tiled kernel at one row, Llama-3.1-8B projections."""
import copy, json, os, sys
import torch
sys.path.insert(0, "benchmarks")
from deterministic import graph_us
from specserve.kernels import quant_matmul as qm
from specserve.models.checkpoint_quant import quantize_fp8

dev = torch.device("cuda")
shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
rows = []
for scheme, block, act in (("w8a16 channel", None, None), ("w8a8 blocks", (128, 128), "group")):
    for name, (n, k) in shapes.items():
        g = torch.Generator(device=dev).manual_seed(0)
        w = quantize_fp8(torch.randn(n, k, device=dev, generator=g) * 0.02, block or (1, k))
        bn, bk = block or (1, k)
        copies = [w] + [copy.deepcopy(w) for _ in range(min(15, -(-256_000_000 // (n * k)) - 1))]
        x = torch.randn(1, k, device=dev, generator=g).to(torch.bfloat16)
        if act:
            xq, xs = qm.quantize_rows(x, bk)
        else:
            xq, xs = x, None
        ag = bk if act else k

        def call(t, each=w):
            return qm.fp8_linear(xq, xs, ag, each.values, each.scale, (bn, bk), None, torch.bfloat16, tiles=t)
        want = (x.float() @ w.dequantize().float().T)
        res = {}
        for label, t in [("row planned", None)] + [
                (f"row n{c} k{kt} s{sp} st{st} w{wp}", qm.Tiles(16, c, kt, sp, wp, st))
                for c in (64, 128) for kt in (128, 256) for sp in (8, 16) for st, wp in ((3, 4), (3, 8))
                if not (block and kt > 128)]:
            got = call(t).float()
            err = ((got - want).norm() / want.norm()).item()
            us = graph_us(lambda: [call(t, each=e) for e in copies], 10, dev, calls=1) / len(copies)
            rows.append({"scheme": scheme, "gemm": name, "variant": label, "us": round(us, 2), "err": round(err, 4)})
            res[label] = us
        best = min(res, key=res.get)
        print(scheme, name, "planned", round(res["row planned"], 2), "best", best, round(res[best], 2), flush=True)
json.dump(rows, open(os.path.join(os.environ["OUT"], "fp8_sweep.json"), "w"))
