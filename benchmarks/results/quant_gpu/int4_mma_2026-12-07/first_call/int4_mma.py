"""4-bit weights at 1 to 16 rows on the tensor cores (``int4_mma.cu``), against the shipped
Triton kernels (``quant_matmul.int4_linear``) at Llama-3.1-8B's projections: values
against the dequantised fp32 product, then GPU time (CUDA-graph replay over copies of the
weight that together exceed L2) beside the bytes' floor at the copy bandwidth measured here.

The kernel is built at run time: through CuPy's NVRTC where CuPy is installed, else
through ``torch.utils.cpp_extension.load_inline`` (nvcc). Prints a JSON line per
(projection, rows) and writes them all to ``$OUT/int4_mma.json``.

    python benchmarks/results/quant_gpu/int4_mma_2026-12-07/int4_mma.py
"""
import copy
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, "benchmarks")
sys.path.insert(0, "tests")
from deterministic import graph_us
from gpu_bench import _copy_bandwidth

from specserve.models.checkpoint_quant import Int4Linear, quantize_int4

HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(HERE, "int4_mma.cu")) as f:
    SRC = f.read()
VARIANTS = [(1, 8), (2, 4), (2, 8), (4, 4)]  # (n8 tiles a warp, warps a block)
LAUNCHER = """
#include <ATen/cuda/CUDAContext.h>
void launch(int64_t x, int64_t w, int64_t s, int64_t z, int64_t out, int64_t M, int64_t N, int64_t chunks,
            int64_t sx, int64_t sw, int64_t ss, int64_t sz, int64_t so) {
    int4_mma<<<N / (8 * NT), 32 * WARPS, 0, at::cuda::getCurrentCUDAStream()>>>(
        (const u16*)x, (const u32*)w, (const u16*)s, (const u8*)z, (u16*)out, (int)M, (int)N, (int)chunks,
        (int)sx, (int)sw, (int)ss, (int)sz, (int)so);
}
"""


def build(nt: int, warps: int):
    """fn(x, layer, out) launching the kernel on torch's current stream; and how it was built."""
    try:
        import cupy
        kern = cupy.RawModule(code=SRC, options=("-std=c++17", f"-DNT={nt}", f"-DWARPS={warps}")).get_function("int4_mma")

        def launch(x, layer, out):
            m = x.shape[0]
            n = layer.packed.shape[0]
            stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
            args = tuple(np.uint64(t.data_ptr()) for t in (x, layer.packed, layer.scales, layer.zeros, out)) + \
                tuple(np.int32(v) for v in (m, n, layer.packed.shape[1] // 16, x.stride(0), layer.packed.stride(0),
                                            layer.scales.stride(0), layer.zeros.stride(0), out.stride(0)))
            kern((n // (8 * nt),), (32 * warps,), args, stream=stream)
        return launch, "cupy " + cupy.__version__
    except ImportError:
        from torch.utils.cpp_extension import load_inline
        mod = load_inline(name=f"int4_mma_{nt}_{warps}", cpp_sources=LAUNCHER.split("{")[0].split("\n", 2)[2] + ";",
                          cuda_sources=SRC + LAUNCHER, functions=["launch"],
                          extra_cuda_cflags=[f"-DNT={nt}", f"-DWARPS={warps}", "-std=c++17",
                                             "-gencode=arch=compute_90,code=sm_90"])

        def launch(x, layer, out):
            m = x.shape[0]
            n = layer.packed.shape[0]
            mod.launch(x.data_ptr(), layer.packed.data_ptr(), layer.scales.data_ptr(), layer.zeros.data_ptr(),
                       out.data_ptr(), m, n, layer.packed.shape[1] // 16, x.stride(0), layer.packed.stride(0),
                       layer.scales.stride(0), layer.zeros.stride(0), out.stride(0))
        return launch, "load_inline"


def main() -> None:
    dev = torch.device("cuda")
    bandwidth = _copy_bandwidth()
    print(f"{torch.cuda.get_device_name()} copy {bandwidth / 1e12:.2f} TB/s", flush=True)
    kernels = {}
    for nt, warps in VARIANTS:
        kernels[f"mma nt{nt} w{warps}"], how = build(nt, warps)
    print("built with", how, flush=True)
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    rows = []
    for name, (n, k) in shapes.items():
        g = torch.Generator(device=dev).manual_seed(0)
        w = (torch.randn(n, k, device=dev, generator=g) * 0.02).bfloat16()
        qw = quantize_int4(w, 128)
        layer = Int4Linear(qw, None)
        dequant = (qw.q.float() - qw.zero.float().repeat_interleave(128, 1)) * qw.scale.float().repeat_interleave(128, 1)
        size = sum(t.numel() * t.element_size() for t in (layer.packed, layer.scales, layer.zeros))
        layers = [layer] + [copy.deepcopy(layer) for _ in range(min(15, -(-256_000_000 // size) - 1))]
        x = torch.randn(16, k, device=dev, generator=g).bfloat16()
        for m in (1, 5, 16):
            xm = x[:m].clone()
            want = xm.float() @ dequant.T
            shipped = layer(xm)
            row = {"gemm": name, "n": n, "k": k, "m": m, "floor_us": round(1e6 * size / bandwidth, 2),
                   "shipped_err": round(((shipped.float() - want).norm() / want.norm()).item(), 6),
                   "shipped_us": round(graph_us(lambda xm=xm, layers=layers: [each(xm) for each in layers], 10, dev, calls=1)
                                       / len(layers), 2)}
            for label, fn in kernels.items():
                out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
                fn(xm, layer, out)
                torch.cuda.synchronize()
                row[label] = {"err": round(((out.float() - want).norm() / want.norm()).item(), 6),
                              "same_as_shipped": round((out == shipped).float().mean().item(), 4),
                              "us": round(graph_us(lambda fn=fn, xm=xm, out=out, layers=layers: [fn(xm, each, out) for each in layers],
                                                   10, dev, calls=1) / len(layers), 2)}
            rows.append(row)
            print(json.dumps(row), flush=True)
        layers = layer = None
        torch.cuda.empty_cache()
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "int4_mma.json"), "w") as f:
                json.dump({"card": torch.cuda.get_device_name(), "copy_tb_s": bandwidth / 1e12, "rows": rows}, f,
                          indent=1)


if __name__ == "__main__":
    main()
