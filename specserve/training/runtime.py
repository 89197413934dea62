"""Where draft training runs: the device, the data-parallel ranks torchrun started, and
the log that rank 0 writes for all of them."""
from __future__ import annotations

import os
import platform
import time

import torch

from specserve.distributed import SINGLE, TPGroup, init_tensor_parallel
from specserve.models.packed_linear import bf16_packing_supported


def quiet() -> bool:
    """Whether this process is a data-parallel rank other than 0 (rank 0 speaks for all)."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_rank() != 0


def log(message: str) -> None:
    if not quiet():
        print(f"[training {time.strftime('%H:%M:%S')}] {message}", flush=True)


def join_ranks(args) -> TPGroup:
    """The data-parallel group torchrun started (``WORLD_SIZE`` > 1), else one process.
    Each rank runs on ``cuda:LOCAL_RANK`` (or the CPU, with gloo)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return SINGLE
    if args.device not in ("auto", "cpu", "cuda"):
        raise SystemExit(f"under torchrun each rank uses cuda:LOCAL_RANK: pass --device auto, cuda or cpu, "
                         f"not {args.device!r}")
    return init_tensor_parallel(world, args.device)


def gather(group: TPGroup, part):
    """Every rank's ``part`` (any picklable value), in rank order, on every rank."""
    if group.size == 1:
        return [part]
    parts = [None] * group.size
    torch.distributed.all_gather_object(parts, part)
    return parts


def average_gradients(params: list[torch.nn.Parameter], group: TPGroup) -> None:
    """Data parallelism's one exchange a step: the ranks' gradients averaged, in one
    all-reduce of them all flattened."""
    if group.size == 1:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = group.all_reduce(torch.cat([g.reshape(-1) for g in grads])) / group.size
    for p, chunk in zip(params, flat.split([g.numel() for g in grads])):
        p.grad = chunk.view_as(p).to(p.dtype)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.machine()} CPU, {torch.get_num_threads()} threads"


def use_bf16(device: torch.device) -> bool:
    if device.type == "cuda":
        return True
    return bf16_packing_supported()
