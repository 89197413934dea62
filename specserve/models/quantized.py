"""Linear layers that keep a GGUF file's quantized weights, run by ``kernels/cpu_quant.cpp``.

A GGUF weight arrives as rows of blocks (``GGUFWeight``). Every supported block format is
decoded here into one form the kernel runs: an unsigned integer q per weight (4, 5 or 8
bits), one fp32 scale and one fp32 min per group of 16 or 32 inputs, w = scale · q + min.
The decoding is exact: each format's dequantised value is that expression (see
``decode``), which the tests check against the ``gguf`` package's own dequantisation.

Formats (block layouts as ggml's ``ggml-common.h`` defines them):
  Q4_0  d:f16, 16 bytes of nibbles          w = d · (q − 8)
  Q4_1  d:f16, m:f16, 16 bytes of nibbles   w = d · q + m
  Q8_0  d:f16, 32 int8                      w = d · q
  Q4_K  256 inputs: d, dmin:f16, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles;
        8 groups of 32: w = d·sc · q − dmin·m
  Q6_K  256 inputs: 128 bytes low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, d:f16;
        16 groups of 16: w = d·sc · (q − 32)
  Q5_0  d:f16, 32 high bits, 16 bytes of nibbles   w = d · (q − 16)
  Q5_1  d:f16, m:f16, 32 high bits, 16 bytes of nibbles   w = d · q + m
  Q5_K  256 inputs: d, dmin:f16, Q4_K's scales and mins, 32 bytes of high bits, 128 bytes
        of nibbles; 8 groups of 32: w = d·sc · q − dmin·m
  Q3_K  256 inputs: 32 bytes of high bits, 64 bytes of 2-bit lows, 12 bytes of 6-bit
        scales, d:f16; 16 groups of 16: w = d·(sc − 32) · (q − 4)
  Q2_K  256 inputs: 16 bytes of 4-bit scales and mins, 64 bytes of 2-bit q, d, dmin:f16;
        16 groups of 16: w = d·sc · q − dmin·m
  IQ4_NL  d:f16, 16 bytes of nibbles indexing a table of 16 int8 values t
        w = d · t[q]
  IQ4_XS  256 inputs: d:f16, 6-bit scales (2 bits in a u16, 4 in 4 bytes), 128 bytes of
        nibbles; 8 groups of 32: w = d·(sc − 32) · t[q]

Q5 formats run as 5-bit q (0..31), Q6_K as 6-bit q (0..63), Q3_K and Q2_K as 4-bit q (0..7,
0..3), the IQ4 formats as q = t[i] + 128 held as their 4-bit indices i (``cpu_ops.IQ4``),
looked up in the kernel; where the kernels are not built for AVX-512 VNNI, the Q5, Q6_K and
IQ4 formats run as 8-bit q. Every value exactly as ggml dequantises it (see ``QuantLinear``
for the bytes a step reads).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from specserve.kernels import cpu_ops
from specserve.models.packed_linear import replace_linears

# Rows from which a QuantLinear unpacks its weight (``QuantLinear``): where unpacking costs
# less than the integer kernel's extra rows on the default model's layers. For a library
# GEMM, 32 (benchmarks/results/gguf_cpu/); onto AMX tiles, which never write the unpacked
# weight out, 16: the crossover was ~8 rows at 2 threads and ~16-20 at 8 on the Xeons
# measured (benchmarks/results/cpu_amx/). Below it a batch of a few requests' verify spans
# round as their decode rows do, in the same kernel, and the start-up cost profile's
# batches of 8 stay on the kernel a lone request's steps run.
DEQUANT_ROWS = 32
TILE_ROWS = 16


def switch_rows(model: nn.Module) -> int:
    """The fewest rows from which a QuantLinear of ``model`` unpacks its weight, where a
    pass's cost per row changes (0: none does)."""
    return min((m.dequant_rows for m in model.modules() if isinstance(m, QuantLinear) and m.dequant_rows > 0),
               default=0)


def default_dequant_rows() -> int:
    """``dequant_rows`` for a QuantLinear here: TILE_ROWS where the kernels multiply on AMX
    tiles, else DEQUANT_ROWS."""
    return TILE_ROWS if cpu_ops.amx_tiles() else DEQUANT_ROWS
CHUNK = 64  # the kernel's inputs per weight vector: rows are padded to a multiple


@dataclass(frozen=True)
class GGUFWeight:
    """A weight ``[rows, in_features]`` still in its GGUF blocks: ``raw`` uint8
    ``[rows, bytes per row]``. Rows are independent, so they can be cut and reordered."""

    qtype: str
    raw: np.ndarray
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.raw.shape[0], self.in_features)

    def take_rows(self, index) -> GGUFWeight:
        return GGUFWeight(self.qtype, self.raw[index], self.in_features)

    def decoded(self) -> Decoded:
        return decode(self)


@dataclass
class Decoded:
    """w = scale · q + min: q uint8 ``[rows, K]`` within ``bits`` (4, 5, 6 or 8; or ``cpu_ops.IQ4``:
    q holds 4-bit indices into the IQ4 table), scale/min fp32 ``[rows, K / group]``.
    ``scale_factor`` / ``min_factor``: where each scale (min) is a float32 factor of its
    super-block of 256 inputs times a small integer of its group (the K-quants' d · sc and
    −dmin · m, IQ4_XS's d · (ls − 32); a min that is a power of two times its scale, −32 d ·
    sc for Q6_K, has the factor times that power), the factors, fp32 ``[rows, K / 256]``
    (None: not so made): ``pack`` then holds the integers and factors, fewer bytes than the
    products (``two_level``)."""

    q: np.ndarray
    scale: np.ndarray
    min: np.ndarray
    bits: int
    group: int
    scale_factor: np.ndarray | None = None
    min_factor: np.ndarray | None = None

    def dequantize(self) -> np.ndarray:
        """scale · q + min in float32 (a product rounded, then a sum: ggml's values), in
        place over one float copy of q and through torch's threads: an embedding table is
        tens of millions of weights, loaded at every start."""
        rows, k = self.q.shape
        w = torch.from_numpy(np.ascontiguousarray(self.widened().q)).view(rows, k // self.group, self.group).float()
        w.mul_(torch.from_numpy(self.scale)[..., None]).add_(torch.from_numpy(self.min)[..., None])
        return w.view(rows, k).numpy()

    @property
    def stored_bits(self) -> int:
        """Bits a weight takes in the kernel's layout (an IQ4 index: 4)."""
        return 4 if self.bits == cpu_ops.IQ4 else self.bits

    def widened(self) -> Decoded:
        """The same weight with q as 8-bit integers (IQ4's indices looked up): a form every
        build of the kernels runs."""
        q = _IQ4_TABLE[self.q] if self.bits == cpu_ops.IQ4 else self.q
        return Decoded(q, self.scale, self.min, 8, self.group, self.scale_factor, self.min_factor)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    return blocks[..., start:start + 2].copy().view(np.float16).astype(np.float32)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's nibble order in a block of 32: byte j holds input j (low) and 16 + j (high)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _decode_q4_0(b: np.ndarray) -> tuple:
    d = _f16(b, 0)
    return _nibbles(b[..., 2:18]), d, -8.0 * d, 4, 32


def _decode_q4_1(b: np.ndarray) -> tuple:
    return _nibbles(b[..., 4:20]), _f16(b, 0), _f16(b, 2), 4, 32


def _decode_q8_0(b: np.ndarray) -> tuple:
    d = _f16(b, 0)
    q = (b[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return q, d, -128.0 * d, 8, 32


def _k4_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's 12 bytes of 6-bit scales and mins (ggml's get_scale_min_k4):
    the 8 groups' scales and mins as float32."""
    low = np.arange(4)
    sc = np.concatenate([s[..., low] & 63, (s[..., low + 8] & 0x0F) | ((s[..., low] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., low + 4] & 63, (s[..., low + 8] >> 4) | ((s[..., low + 4] >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _high_bits(b: np.ndarray, start: int, count: int) -> np.ndarray:
    """``count`` bytes from ``start`` as bits, least significant first: ``[..., 8 · count]``."""
    return np.unpackbits(b[..., start:start + count], axis=-1, bitorder="little")


def _decode_q4_k(b: np.ndarray) -> tuple:
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k4_scales(b[..., 4:16])
    qs = b[..., 16:144].reshape(*b.shape[:-1], 4, 32)  # 4 × 32 bytes: groups 2j (low), 2j+1 (high)
    q = np.stack([qs & 0x0F, qs >> 4], axis=-2).reshape(*b.shape[:-1], 256)
    return q, d[..., None] * sc, -(dmin[..., None] * mn), 4, 32, (d, -dmin)


def _decode_q5_0(b: np.ndarray) -> tuple:
    d = _f16(b, 0)
    q = _nibbles(b[..., 6:22]) | (_high_bits(b, 2, 4) << 4)  # bit i of qh: input i's fifth
    return q, d, -16.0 * d, 5, 32


def _decode_q5_1(b: np.ndarray) -> tuple:
    return _nibbles(b[..., 8:24]) | (_high_bits(b, 4, 4) << 4), _f16(b, 0), _f16(b, 2), 5, 32


def _decode_q5_k(b: np.ndarray) -> tuple:
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k4_scales(b[..., 4:16])
    qs = b[..., 48:176].reshape(*b.shape[:-1], 4, 32)  # as Q4_K's: groups 2j (low), 2j+1 (high)
    q = np.stack([qs & 0x0F, qs >> 4], axis=-2).reshape(*b.shape[:-1], 8, 32)
    # Byte l of qh holds the fifth bit of input l of every group: group g's is its bit g.
    high = _high_bits(b, 16, 32).reshape(*b.shape[:-1], 32, 8).swapaxes(-1, -2)
    q = (q | (high << 4)).reshape(*b.shape[:-1], 256)
    return q, d[..., None] * sc, -(dmin[..., None] * mn), 5, 32, (d, -dmin)


def _q3_k_scales(s: np.ndarray) -> np.ndarray:
    """Q3_K's 12 bytes of 6-bit scales as its 16 groups' (ggml's aux words, byte by byte)."""
    low, high = s[..., 0:8], s[..., 8:12]
    lows = np.concatenate([low & 0x0F, low >> 4], axis=-1)                       # groups 0-7, 8-15
    highs = np.concatenate([(high >> shift) & 3 for shift in (0, 2, 4, 6)], axis=-1)
    return (lows | (highs << 4)).astype(np.float32) - 32.0


def _two_bit(b: np.ndarray, start: int) -> np.ndarray:
    """Q3_K's and Q2_K's 64 bytes of 2-bit values from ``start``: ``[..., 2 halves, 4 shifts,
    32]``, half n's bytes shifted by 2j for the j-th run of 32 inputs (ggml's order)."""
    qs = b[..., start:start + 64].reshape(*b.shape[:-1], 2, 1, 32)
    return (qs >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3


def _decode_q3_k(b: np.ndarray) -> tuple:
    d = _f16(b, 108)
    low = _two_bit(b, 32)
    hmask = _high_bits(b, 0, 32).reshape(*b.shape[:-1], 32, 8).swapaxes(-1, -2)  # [8 bits, 32 inputs]
    q = low + 4 * hmask.reshape(*b.shape[:-1], 2, 4, 32)  # (q3 + 4): bit 4n + j of byte l, half n, shift j
    scale = d[..., None] * _q3_k_scales(b[..., 96:108])
    return q.reshape(*b.shape[:-1], 256), scale, -4.0 * scale, 4, 16, (d, -4.0 * d)


def _decode_q2_k(b: np.ndarray) -> tuple:
    d, dmin = _f16(b, 80), _f16(b, 82)
    sc = b[..., 0:16]
    q = _two_bit(b, 16)
    scale = d[..., None] * (sc & 0x0F).astype(np.float32)
    return q.reshape(*b.shape[:-1], 256), scale, -(dmin[..., None] * (sc >> 4).astype(np.float32)), 4, 16, (d, -dmin)


# IQ4_NL's and IQ4_XS's 16 values (ggml's kvalues_iq4nl), offset by 128 into unsigned bytes.
_IQ4_TABLE = (np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])
              + 128).astype(np.uint8)


def _decode_iq4_nl(b: np.ndarray) -> tuple:
    d = _f16(b, 0)
    return _nibbles(b[..., 2:18]), d, -128.0 * d, cpu_ops.IQ4, 32


def _decode_iq4_xs(b: np.ndarray) -> tuple:
    d = _f16(b, 0)
    high = b[..., 2:4].copy().view(np.uint16)  # [..., 1]
    ls = np.stack([((b[..., 4 + g // 2] >> (4 * (g % 2))) & 0x0F) | (((high[..., 0] >> (2 * g)) & 3) << 4)
                   for g in range(8)], axis=-1).astype(np.float32)
    q = _nibbles(b[..., 8:136].reshape(*b.shape[:-1], 8, 16))
    scale = d[..., None] * (ls - 32.0)
    return q.reshape(*b.shape[:-1], 256), scale, -128.0 * scale, cpu_ops.IQ4, 32, (d, -128.0 * d)


def _decode_q6_k(b: np.ndarray) -> tuple:
    ql, qh = b[..., 0:128].reshape(*b.shape[:-1], 2, 64), b[..., 128:192].reshape(*b.shape[:-1], 2, 32)
    sc = b[..., 192:208].view(np.int8).astype(np.float32)
    d = _f16(b, 208)
    parts = [(ql[..., :32] & 0x0F) | ((qh & 3) << 4), (ql[..., 32:] & 0x0F) | (((qh >> 2) & 3) << 4),
             (ql[..., :32] >> 4) | (((qh >> 4) & 3) << 4), (ql[..., 32:] >> 4) | (((qh >> 6) & 3) << 4)]
    q = np.stack(parts, axis=-2).reshape(*b.shape[:-1], 256)  # per half: 4 runs of 32 inputs
    scale = d[..., None] * sc
    return q.astype(np.uint8), scale, -32.0 * scale, 6, 16, (d, -32.0 * d)


# ggml type name -> (inputs per block, bytes per block, decoder)
FORMATS = {"Q4_0": (32, 18, _decode_q4_0), "Q4_1": (32, 20, _decode_q4_1), "Q8_0": (32, 34, _decode_q8_0),
           "Q4_K": (256, 144, _decode_q4_k), "Q6_K": (256, 210, _decode_q6_k),
           "Q5_0": (32, 22, _decode_q5_0), "Q5_1": (32, 24, _decode_q5_1), "Q5_K": (256, 176, _decode_q5_k),
           "Q3_K": (256, 110, _decode_q3_k), "Q2_K": (256, 84, _decode_q2_k),
           "IQ4_NL": (32, 18, _decode_iq4_nl), "IQ4_XS": (256, 136, _decode_iq4_xs)}


def decode(weight: GGUFWeight) -> Decoded:
    """The exact (q, scale, min) form of a GGUF weight; a format without a kernel raises."""
    if weight.qtype not in FORMATS:
        raise ValueError(f"GGUF type {weight.qtype} has no quantized CPU kernel; "
                         f"supported: {', '.join(FORMATS)}")
    per_block, nbytes, decoder = FORMATS[weight.qtype]
    rows, k = weight.shape
    if k % per_block or weight.raw.shape[1] != k // per_block * nbytes:
        raise ValueError(f"a {weight.qtype} weight of {k} inputs must be {k // per_block * nbytes} bytes "
                         f"per row, got {weight.raw.shape[1]}")
    blocks = np.ascontiguousarray(weight.raw).reshape(rows, k // per_block, nbytes)
    q, scale, mins, bits, group, *factors = decoder(blocks)
    groups = k // group
    scale_factor, min_factor = (None if f is None else np.ascontiguousarray(f.reshape(rows, -1), dtype=np.float32)
                                for f in (factors[0] if factors else (None, None)))
    return Decoded(np.ascontiguousarray(q.reshape(rows, k)), scale.reshape(rows, groups).astype(np.float32),
                   mins.reshape(rows, groups).astype(np.float32), bits, group, scale_factor, min_factor)


def _merge(parts: list[Decoded]) -> Decoded:
    """Row-stack parts (q, k and v of one projection may differ in format): to the widest
    q and the finest groups any part has, which holds each part's values exactly (IQ4
    indices beside another form: 8 bits)."""
    if len({p.bits for p in parts}) > 1:
        parts = [p.widened() if p.bits == cpu_ops.IQ4 else p for p in parts]
    bits, group = max(p.bits for p in parts), min(p.group for p in parts)
    scales, mins = [], []
    for p in parts:
        repeat = p.group // group
        scales.append(np.repeat(p.scale, repeat, axis=1))
        mins.append(np.repeat(p.min, repeat, axis=1))
    # Factors where every part has them (one a super-block of 256 inputs whatever the
    # group: a part regrouped repeats its groups' integers under the same factors).
    factors = [np.concatenate([getattr(p, name) for p in parts])
               if all(getattr(p, name) is not None for p in parts) else None
               for name in ("scale_factor", "min_factor")]
    return Decoded(np.concatenate([p.q for p in parts]), np.concatenate(scales), np.concatenate(mins), bits, group,
                   *factors)


def blocks(kp: int, group: int) -> list[int]:
    """The kernel's blocks of a row of ``kp`` inputs, in 64-input chunks: 16-group blocks,
    then one each of half, a quarter, ... as the rest needs (``cpu_quant.cpp``: blocks)."""
    full = 16 * group // CHUNK
    chunks = kp // CHUNK
    out = [full] * (chunks // full)
    left = chunks % full
    size = full // 2
    while size >= 1:
        if left >= size:
            out.append(size)
            left -= size
        size //= 2
    return out


def block_order(kp: int, group: int) -> np.ndarray:
    """Input index at each position of the kernel's order: in a block of 16 / L groups,
    chunk j's lane l holds inputs (j · L + l % L) · 4 … + 3 of the block's group l / L, so
    each int32 lane of the integer dot products sums one group."""
    order, k0 = [], 0
    for size in blocks(kp, group):
        per_lane = group // (4 * size)
        j, lane, i = np.meshgrid(np.arange(size), np.arange(16), np.arange(4), indexing="ij")
        order.append((k0 + (lane // per_lane) * group + (j * per_lane + lane % per_lane) * 4 + i).reshape(-1))
        k0 += size * CHUNK
    return np.concatenate(order)


def pack(decoded: Decoded) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's layout (``cpu_quant.cpp``): inputs padded with zero weights to a
    multiple of 64 and put in block order; 4-bit q two per byte, byte j of each 128
    (reordered) inputs holding inputs j and 64 + j (an odd last 64: j and 32 + j), IQ4's
    indices likewise; 5- and 6-bit q as 4-bit, then planes of their higher bits, 8 bytes a
    chunk and bit, chunk by chunk (bit j: the chunk's j-th input in the order its bytes
    hold them); scales (and mins) two-level where the decoder gave their factors and the
    build takes them (``two_level``), else float16 where each is one exactly (groups of
    32), else float32; where every min is one factor times its scale (``_min_factor``),
    that factor alone, 0-dim float32, for mins."""
    rows, k = decoded.q.shape
    bits = decoded.stored_bits
    if decoded.q.size and int(decoded.q.max()) >> bits:
        raise ValueError(f"a quantized weight's q is wider than its {bits} bits")
    kp = -(-k // CHUNK) * CHUNK
    q = np.zeros((rows, kp), np.uint8)
    q[:, :k] = decoded.q
    q = q[:, block_order(kp, decoded.group)]
    pad_groups = (kp - k) // decoded.group
    scale = np.pad(decoded.scale, ((0, 0), (0, pad_groups)))
    mins = np.pad(decoded.min, ((0, 0), (0, pad_groups)))
    if bits in (4, 5, 6):
        low = q & 0x0F
        pairs = kp // (2 * CHUNK)
        paired = low[:, :pairs * 2 * CHUNK].reshape(rows, pairs, 2, CHUNK)
        packed = [(paired[:, :, 0] | (paired[:, :, 1] << 4)).reshape(rows, pairs * CHUNK)]
        if kp % (2 * CHUNK):  # an odd last chunk
            tail = low[:, pairs * 2 * CHUNK:]
            packed.append(tail[:, :32] | (tail[:, 32:] << 4))
        if bits > 4:  # each chunk's inputs are in their bytes' order already
            chunks = q.reshape(rows, kp // CHUNK, CHUNK)
            planes = [np.packbits((chunks >> plane) & 1, axis=-1, bitorder="little") for plane in range(4, bits)]
            packed.append(np.stack(planes, axis=2).reshape(rows, kp // 8 * (bits - 4)))
        q = np.concatenate(packed, axis=1)
    factor = _min_factor(scale, mins)
    if factor is not None:  # no mins read: the kernels take factor · scale, the same values
        mins = np.float32(factor)
    levels = two_level(decoded, scale, mins if factor is None else None) if kp == k else None
    if levels is not None:
        scale, two_mins = levels
        mins = mins if factor is not None else two_mins
    elif decoded.group == 32 and _exact_in_float16(scale) and (factor is not None or _exact_in_float16(mins)):
        scale = scale.astype(np.float16)  # fewer bytes per step, same values
        mins = mins if factor is not None else mins.astype(np.float16)
    return (torch.from_numpy(np.ascontiguousarray(q)), torch.from_numpy(np.ascontiguousarray(scale)),
            torch.tensor(mins) if factor is not None else torch.from_numpy(np.ascontiguousarray(mins)))


SUPER_BLOCK = 256  # inputs a two-level scale's factor covers


def two_level(decoded: Decoded, scale: np.ndarray, mins: np.ndarray | None) -> tuple | None:
    """The scales (and ``mins``, unless None: a factor of the scales) as the kernels' two-level
    rows, uint8 ``[rows, groups + 4 · K / 256]``: each group's integer as int8, then each
    super-block's float32 factor; or None where the build does not take them, the width is
    not whole super-blocks, the decoder gave no factors, or any value is not exactly its
    factor times an int8 (a float32 product, as the kernels form it; a −0 may come back +0,
    which no weight or product tells apart)."""
    rows, groups = scale.shape
    if not cpu_ops.two_level_scales() or (groups * decoded.group) % SUPER_BLOCK:
        return None
    out = []
    for values, factors in ((scale, decoded.scale_factor), (mins, decoded.min_factor)):
        if values is None:
            out.append(None)
            continue
        if factors is None or factors.shape != (rows, groups * decoded.group // SUPER_BLOCK):
            return None
        spread = np.repeat(factors, SUPER_BLOCK // decoded.group, axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            sub = np.where(spread != 0, values / spread, 0.0)
        if not (np.isfinite(sub).all() and np.all((sub >= -128) & (sub <= 127))):
            return None
        sub = np.rint(sub).astype(np.int8)
        if not np.array_equal(spread * sub.astype(np.float32), values):
            return None
        out.append(np.concatenate([sub.view(np.uint8), np.ascontiguousarray(factors, np.float32).view(np.uint8)], axis=1))
    return out[0], out[1]


def _min_factor(scale: np.ndarray, mins: np.ndarray) -> float | None:
    """f where every min is f times its group's scale exactly as the kernels compute it (a
    float32 product), whatever f is: Q4_0's −8, Q5_0's −16, Q8_0's and the IQ4 formats'
    −128, Q6_K's −32, Q3_K's −4. Else None (Q4_1's, Q5_1's and the K-quants' own mins, a
    layer of parts whose factors differ)."""
    nonzero = np.flatnonzero(scale)
    if not nonzero.size:
        return None
    factor = np.float32(mins.flat[nonzero[0]] / scale.flat[nonzero[0]])
    return float(factor) if np.isfinite(factor) and np.array_equal(factor * scale, mins) else None


def _exact_in_float16(values: np.ndarray) -> bool:
    """Whether every value is a float16 exactly (GGUF's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and
    IQ4_NL scales and mins are, unless one overflows; K-quants' and IQ4_XS's products of
    two scales often are not)."""
    with np.errstate(over="ignore"):
        return bool(np.array_equal(values.astype(np.float16).astype(values.dtype), values))


class QuantLinear(nn.Module):
    """Drop-in for an ``nn.Linear`` on the CPU whose weight stays quantized: bits per
    weight read per step, q plus a scale per group and a min where it is not a factor of
    the scale, instead of 16: the file's own for Q4_0, IQ4_NL, Q4_1, Q5_0, Q5_1 and Q8_0
    (4.5, 4.5, 5, 5.5, 6, 8.5: float16 scales, as the file has them); with two-level
    scales and mins (``two_level``: an int8 a group, a float32 factor per 256 inputs)
    4.375 for IQ4_XS, 4.625 for Q3_K, 4.75 for Q4_K, 5.25 for Q2_K, 5.75 for Q5_K and
    6.625 for Q6_K. Where the kernels are not built for AVX-512 VNNI those hold float32
    products (5 for IQ4_XS, 6 for Q4_K and Q3_K, 7 for Q5_K, 8 for Q2_K and Q6_K) and the
    5-bit, 6-bit and IQ4 formats run 2-4 bits wider. ``parts``: (first row, weight) filling
    the layer's rows, in any order; a weight is a GGUFWeight, or any weight whose
    ``decoded()`` gives its exact (q, scale, min) form and ``qtype`` names it (a 4-bit
    AWQ/GPTQ layer).

    ``dequant_rows``: from this many rows on (a prefill chunk; on AMX, a batch of a few
    requests) the weight is unpacked to bf16 onto AMX tiles, or to the activations' dtype
    for ATen's GEMM, either reusing each weight over the rows, where the integer kernel
    costs as much per row at any count (0: never, so that a row's result does not depend
    on its batch: the deterministic mode). ``default_dequant_rows`` by default."""

    def __init__(self, parts: list[tuple[int, object]], in_features: int, out_features: int,
                 bias: torch.Tensor | None) -> None:
        super().__init__()
        if not cpu_ops.available():
            raise ValueError("quantized weights run on the CPU through the C++ kernels, which are unavailable "
                             "here (see the log)")
        self.dequant_rows = default_dequant_rows()
        self.in_features, self.out_features = in_features, out_features
        decoded = [w.decoded() for _, w in sorted(parts, key=lambda part: part[0])]
        merged = _merge(decoded)
        if merged.q.shape != (out_features, in_features):
            raise ValueError(f"quantized parts make {merged.q.shape}, the layer is {(out_features, in_features)}")
        if merged.bits not in cpu_ops.weight_forms():
            merged = merged.widened()  # the same values, in the layout every build runs
        self.bits, self.group = merged.bits, merged.group
        self.formats = sorted({w.qtype for _, w in parts})
        packed, scales, mins = pack(merged)
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    def select_rows(self, ids: torch.Tensor) -> QuantLinear:
        """A layer of rows ``ids`` of this one (output features), still quantized."""
        head = QuantLinear.__new__(QuantLinear)
        nn.Module.__init__(head)
        head.in_features, head.out_features = self.in_features, len(ids)
        head.bits, head.group, head.formats = self.bits, self.group, self.formats
        head.dequant_rows = self.dequant_rows
        for name in ("packed", "scales", "mins"):
            tensor = getattr(self, name)  # (mins may be one factor of the scales: 0-dim)
            head.register_buffer(name, tensor.index_select(0, ids.cpu()).contiguous() if tensor.dim() else tensor)
        head.register_buffer("bias", None if self.bias is None else self.bias.index_select(0, ids.cpu()))
        return head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_ops.quant_linear(x, self.packed, self.scales, self.mins, self.bits, self.group, self.bias,
                                    self.dequant_rows)

    def extra_repr(self) -> str:
        bits = "4 (IQ4 table)" if self.bits == cpu_ops.IQ4 else self.bits
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"formats={'+'.join(self.formats)}, bits={bits}, group={self.group}")


def quantize_linears(model: nn.Module, kind: str = "Q4_1") -> int:
    """Quantize every float ``nn.Linear`` of ``model`` to GGUF format ``kind`` (one the
    ``gguf`` package quantizes: Q4_0, Q4_1, Q8_0) and run it as a QuantLinear; returns how
    many. For a model whose checkpoint holds float weights (a draft on the CPU, the quantized
    self-draft). Raises ValueError, naming the layer, where one cannot be."""
    # lazy: the gguf package, only to quantize at load
    import gguf
    from gguf.quants import quantize

    if kind not in ("Q4_0", "Q4_1", "Q8_0"):
        raise ValueError(f"cannot quantize to {kind!r} at load (Q4_0, Q4_1 or Q8_0)")

    def make(linear: nn.Linear) -> QuantLinear:
        if linear.in_features % 32:
            raise ValueError(f"{kind} needs input widths that are multiples of 32, got {linear.in_features}")
        raw = quantize(linear.weight.detach().float().cpu().numpy(), gguf.GGMLQuantizationType[kind])
        return QuantLinear([(0, GGUFWeight(kind, raw, linear.in_features))], linear.in_features,
                           linear.out_features, linear.bias)

    return replace_linears(model, make)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation quantization, in torch (the tests' reference): per row and
    block of 32 inputs, a = round(x / d) with d = max|x| / 32767 (int16). Returns (a as
    float, d per input), both ``x``'s shape padded to a multiple of 32 inputs."""
    x = x.float()
    k = x.shape[-1]
    x = torch.nn.functional.pad(x, (0, -k % 32))
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 32767.0
    inverse = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    a = torch.round(blocks * inverse)
    return a.reshape(x.shape), d.expand_as(blocks).reshape(x.shape)
