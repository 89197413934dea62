"""Host -> device moves that never wait for the device.

A step's metadata is built on the host with numpy, packed into one pinned buffer per dtype
and sent with one asynchronous copy. ``torch.tensor(list, device="cuda")`` would copy from
pageable memory, which synchronises the stream: the host would wait for every kernel
launched before it. Pinned buffers come from torch's caching host allocator, which keeps
a buffer out of reuse until the copy that reads it has run, so they can be dropped at once.
On the CPU the arrays are used in place (``torch.from_numpy``), no copy at all.

Each array starts at a multiple of ``ALIGN_BYTES`` in its packed buffer. Triton compiles
a kernel once per pattern of 16-byte-aligned pointer arguments: packed back to back, a
step's metadata would land at offsets set by the lengths before it, and a step of a new
pattern (say, 8 requests after a start-up warmed with one) would compile its kernels
again, mid-serving.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32,
                torch.bool: np.bool_}
ALIGN_BYTES = 16  # where each packed array starts (Triton specialises on 16-byte alignment)


def to_device(arrays: Sequence[np.ndarray | list], dtype: torch.dtype,
              device: torch.device) -> list[torch.Tensor]:
    """``arrays`` (numpy arrays or lists of numbers) as tensors of ``dtype`` on
    ``device``, shapes kept, in one copy."""
    if not _packs(device):
        np_dtype = NUMPY_DTYPES[dtype]
        return [torch.from_numpy(np.asarray(a, dtype=np_dtype)) for a in arrays]
    sizes = [_size(a) for a in arrays]
    step = max(ALIGN_BYTES // dtype.itemsize, 1)
    starts = np.cumsum([0] + [-(-size // step) * step for size in sizes])
    host = pinned(int(starts[-1]), dtype)
    out = host.numpy()
    for a, start, size in zip(arrays, starts, sizes):
        out[start:start + size] = a if isinstance(a, list) else a.reshape(-1)
    flat = host.to(device, non_blocking=True)
    parts = [flat[start:start + size] for start, size in zip(starts.tolist(), sizes)]
    return [part if isinstance(a, list) else part.view(a.shape) for part, a in zip(parts, arrays)]


def copy_into(static: torch.Tensor, arrays: Sequence[np.ndarray | list]) -> None:
    """Pack ``arrays`` at the start of the (1-D, device) tensor ``static`` in one copy."""
    if not _packs(static.device):
        fill(static.numpy(), arrays)
        return
    host = pinned(sum(_size(a) for a in arrays), static.dtype)
    fill(host.numpy(), arrays)
    static[:host.numel()].copy_(host, non_blocking=True)


def pinned(size: int, dtype: torch.dtype) -> torch.Tensor:
    """A page-locked host buffer of ``size`` elements (from torch's caching allocator)."""
    return torch.empty(size, dtype=dtype, pin_memory=True)


def fill(out: np.ndarray, arrays: Sequence[np.ndarray | list]) -> None:
    """Write ``arrays`` (any shapes, flattened) one after another at the start of ``out``."""
    offset = 0
    for a in arrays:
        size = _size(a)
        out[offset:offset + size] = a if isinstance(a, list) else a.reshape(-1)
        offset += size


def _packs(device: torch.device) -> bool:
    """Whether moves to ``device`` go through a packed pinned buffer (tests force it on CPU)."""
    return device.type == "cuda"


def _size(a: np.ndarray | list) -> int:
    return len(a) if isinstance(a, list) else a.size
