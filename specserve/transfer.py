"""Host -> device moves that never wait for the device.

A step's metadata is built on the host with numpy, packed into one pinned buffer per dtype
and sent with one asynchronous copy. ``torch.tensor(list, device="cuda")`` would copy from
pageable memory, which synchronises the stream: the host would wait for every kernel
launched before it. Pinned buffers come from torch's caching host allocator, which keeps
a buffer out of reuse until the copy that reads it has run, so they can be dropped at once.
On the CPU the arrays are used in place (``torch.from_numpy``), no copy at all.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32,
                torch.bool: np.bool_}


def to_device(arrays: Sequence[np.ndarray | list], dtype: torch.dtype,
              device: torch.device) -> list[torch.Tensor]:
    """``arrays`` (numpy arrays or lists of numbers) as tensors of ``dtype`` on
    ``device``, shapes kept, in one copy."""
    if not _packs(device):
        np_dtype = NUMPY_DTYPES[dtype]
        return [torch.from_numpy(np.asarray(a, dtype=np_dtype)) for a in arrays]
    sizes = [_size(a) for a in arrays]
    host = pinned(sum(sizes), dtype)
    fill(host.numpy(), arrays)
    flat = host.to(device, non_blocking=True)
    return [part if isinstance(a, list) else part.view(a.shape)
            for part, a in zip(flat.split(sizes), arrays)]


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
