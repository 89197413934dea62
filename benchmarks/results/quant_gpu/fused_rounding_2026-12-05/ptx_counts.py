"""The few-row W8A8 kernel compiled for sm_90 without a GPU, with its inputs given in float8
and (4083fc2's form) rounded inside the product: PTX lines, shuffles and IEEE divisions.

    git show 4083fc2:kernels/quant_matmul.py > /tmp/qm_fused.py
    python ptx_counts.py /tmp/qm_fused.py > ptx_counts.txt
"""
import importlib.util
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

spec = importlib.util.spec_from_file_location("qm_fused", sys.argv[1])
qm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(qm)


def compile(fn, pointers, constants, num_warps=4, num_stages=4):
    signature = {name: "constexpr" if name in constants else pointers.get(name, "i32") for name in fn.arg_names}
    constexprs = {(fn.arg_names.index(name),): value for name, value in constants.items()}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})


tiles = {"HAS_BIAS": False, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "UPCAST": False, "IEEE": False}
fp8 = {"xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*fp32"}
print("triton", triton.__version__)
for x, quantize in (("fp8e4nv", False), ("bf16", True)):
    ptx = compile(qm._fp8_left_kernel, {**fp8, "x_ptr": "*" + x}, {**tiles, "QUANTIZE_X": quantize}).asm["ptx"]
    print(f"x {x}, rounded in the product {quantize}: {ptx.count(chr(10))} PTX lines, "
          f"{ptx.count('shfl')} shfl, {ptx.count('div.rn')} div.rn, {ptx.count('wgmma.mma_async')} wgmma.mma_async")
