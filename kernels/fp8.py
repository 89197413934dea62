"""float8 (e4m3, torch's ``float8_e4m3fn``) rounding in Triton, written out in integer and
float arithmetic so that the interpreter rounds as a GPU does (the interpreter's own
float8 cast differs from torch's)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_e4m3(v):
    """fp32 ``v`` (|v| ≤ 448) rounded to the nearest float8 e4m3 value, ties to even, as
    fp32: torch's ``.to(float8_e4m3fn)``, written out in integer and float arithmetic so
    that the interpreter rounds as a GPU does. Normal values keep 3 mantissa bits; below
    2⁻⁶ the spacing is 2⁻⁹ (subnormals)."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    normal = bits.to(tl.float32, bitcast=True)
    magnitude = (tl.abs(v) + 24576.0) - 24576.0  # 1.5 · 2¹⁴: fp32's spacing there is 2⁻⁹
    subnormal = tl.where(v < 0, -magnitude, magnitude)  # (a negative value rounding to 0 gives −0)
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


@triton.jit
def to_e4m3(v):
    """``v`` saturated to ±448 and rounded to float8 e4m3: torch's
    ``.clamp(-448, 448).to(torch.float8_e4m3fn)``."""
    return round_e4m3(tl.clamp(v.to(tl.float32), -448.0, 448.0)).to(tl.float8e4nv)
