"""Programmatic dependent launch (PDL) for the Triton kernels of a step, on NVIDIA Hopper and later.

A decode step at batch 1 is a chain of hundreds of short kernels, each waiting for the one
before it. Between two of them the GPU drains the first, then launches the second and
spreads it over its SMs, and the second's loads only start after that. Launched with PDL,
a kernel's programs may start while the kernel before it finishes; each waits
(``griddepcontrol.wait``, in ``wait``) until that kernel has completed and its writes are
visible, before it reads what that kernel wrote or writes anything at all. What it does
before the wait (a prefetch, ``prefetch_l2``, or reads of what is already there)
overlaps the kernel before it. Each kernel here then lets the next one launch (in
``wait`` as well): by then every program of its grid has started, so the next kernel's
programs take no place one of this kernel's still needs.

The wait covers the whole chain: a kernel passes it only once the kernel before it has
completed, which itself passed its wait only once the one before that had. So when a
kernel starts, every kernel but the one just before it has completed, and it may read
before its wait what that one does not write (the paged attention reads the batch's
layout there, and prefetches cached keys and values). A kernel launched without PDL
(cuBLAS, a torch op) keeps the stream's order, and a PDL launch after one waits for it to
finish, as any launch would.

``SPECSERVE_PDL=0`` (or ``ENABLED = False`` before a kernel is launched, or a graph is
captured) turns it off; the interpreter, GPUs before Hopper and ROCm GPUs never use it. Measured in
``benchmarks/results/quant_gpu/pdl_2026-12-06/``.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

ENABLED = os.environ.get("SPECSERVE_PDL", "1") != "0"
# For A/B runs: whether a kernel lets the next one launch once past its wait (else only as
# it ends), and whether weight GEMMs prefetch (None: as each kind of weight's tiles say,
# ``quant_matmul.FEW_ROW_TILES``; True or False: all or none, a kind that asks none then
# taking FORCED_PREFETCH K tiles).
TRIGGER = True
GEMM_PREFETCH: bool | None = None
FORCED_PREFETCH = 2


@functools.cache
def _supported(index: int) -> bool:
    try:
        # lazy: the instructions and the launch option, read once a GPU asks (Triton 3.3 on)
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return (torch.version.hip is None  # (a ROCm GPU answers as "cuda" too, with its own versions)
            and "launch_pdl" in CUDAOptions.__dataclass_fields__ and torch.cuda.get_device_capability(index)[0] >= 9)


def active(device: torch.device) -> bool:
    """Whether kernels launched on ``device`` now use PDL."""
    return ENABLED and device.type == "cuda" and _supported(device.index if device.index is not None
                                                            else torch.cuda.current_device())


def launch(device: torch.device, allowed: bool = True) -> dict:
    """Keyword arguments for a launch of a kernel that takes ``PDL: tl.constexpr``: where
    ``active`` (and ``allowed``, a kind of launch measured slower with it), the launch
    option and ``PDL`` 1 (wait, then let the next kernel launch) or 2 (``TRIGGER`` off:
    wait only); else ``PDL`` 0."""
    if not (allowed and active(device)):
        return {"PDL": 0}
    return {"PDL": 1 if TRIGGER else 2, "launch_pdl": True}


def prefetch(launched: dict, wanted: bool) -> bool:
    """Whether a weight GEMM with ``launch``'s arguments ``launched`` prefetches its first
    weights before its wait: where it waits at all, and its kind's tiles ask (``wanted``),
    unless ``GEMM_PREFETCH`` says otherwise."""
    return bool(launched["PDL"]) and (wanted if GEMM_PREFETCH is None else GEMM_PREFETCH)


@triton.jit
def wait(PDL: tl.constexpr):
    """Wait for the kernel before (PDL 1 or 2), then let the next one launch (1)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    if PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(addresses):
    """Ask L2 for the 128-byte lines at ``addresses`` (int64 tensor of global addresses):
    one ``prefetch.global.L2`` each, which returns at once."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\nmov.u32 $0, 0;", "=r,l", [addresses],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def row_lines(base, rows, row_bytes, start, last_row, last_byte, LINES: tl.constexpr):
    """The addresses (int64 ``[rows, LINES]``) of LINES 128-byte steps along each row in
    ``rows`` of the matrix at ``base`` (``row_bytes`` apart), from byte ``start`` of the
    row; rows and bytes clamped to the last ones, so that no address leaves the matrix."""
    r = tl.minimum(rows, last_row).to(tl.int64)
    b = tl.minimum(start + 128 * tl.arange(0, LINES), last_byte).to(tl.int64)
    return base.to(tl.int64) + r[:, None] * row_bytes + b[None, :]
