"""Tensor parallelism's process group: one process per rank, started by torchrun.

``init_tensor_parallel`` joins the group torchrun describes (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``): NCCL on CUDA, each rank on
``cuda:LOCAL_RANK``; gloo on CPU (CI and tests). ``TPGroup`` is what the model and the
runner hold: the rank, the group size, the rank's device and the few collectives tensor
parallelism needs, each a no-op for a group of one — so a single-GPU engine runs exactly
the ops it always ran.

NVLink multicast (NVLS) stays off: on shared hosts it can put the GPUs out of service.
``MULTICAST_OFF`` is set (``setdefault``) before the group starts and goes into every
environment specserve builds for its ranks.
"""
from __future__ import annotations

import atexit
import datetime
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NoReturn

import torch

from specserve.errors import SpecserveError

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}


def disable_multicast(env: dict | None = None) -> dict:
    """Turn NVLink multicast off in ``env`` (default: this process's environment) unless
    the user set the variables; returns ``env``."""
    env = os.environ if env is None else env
    for name, value in MULTICAST_OFF.items():
        env.setdefault(name, value)
    return env


@dataclass(frozen=True)
class TPGroup:
    """This process's place in a tensor-parallel group (rank 0 of 1 by default)."""

    rank: int = 0
    size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_driver(self) -> bool:
        """Rank 0: it owns the scheduler, the drafter and the server."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns it."""
        if self.size > 1:
            torch.distributed.all_reduce(self._handed(x))
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` ``[..., n]`` along the last dim: ``[..., size * n]``.

        Built from an all-reduce of a zero-filled buffer rather than an all-gather:
        all-reduce is the collective PyTorch tests under CUDA-graph capture, and this runs
        inside the captured forward pass (the LM head). It moves twice the bytes of an
        all-gather, which only matters for logits of many rows."""
        if self.size == 1:
            return x
        n = x.shape[-1]
        out = x.new_zeros(*x.shape[:-1], self.size * n)
        out[..., self.rank * n:(self.rank + 1) * n] = x
        torch.distributed.all_reduce(self._handed(out))
        return out

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` into every rank's ``x``; returns it."""
        if self.size > 1:
            torch.distributed.broadcast(self._handed(x), src=0)
        return x

    def min(self, value: int) -> int:
        """The smallest ``value`` any rank holds (every rank must call it)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(self._handed(t), op=torch.distributed.ReduceOp.MIN)
        return int(t.item())

    def barrier(self) -> None:
        if self.size > 1:
            torch.distributed.barrier()

    def _handed(self, x: torch.Tensor) -> torch.Tensor:
        """``x``, about to go to a collective; on gloo, kept until its worker threads let go
        (see ``_GlooHeld``)."""
        if self.device.type == "cpu":
            _GLOO_HELD.add(x)
        return x

    @contextmanager
    def rank_zero_first(self):
        """Rank 0 runs the block, then the others (a cache rank 0 fills, they read)."""
        if not self.is_driver:
            self.barrier()
        yield
        if self.is_driver:
            self.barrier()


SINGLE = TPGroup()


class _GlooHeld:
    """The tensors this process handed to gloo collectives that gloo may still hold.

    A gloo collective returns once its work is done, but one of the process group's
    worker threads drops the work (and its references to the tensors) a moment later, or
    later still when a barrier queued meanwhile holds it. Dropping a reference to a
    tensor that Python also holds takes the GIL (torch's PyObject preservation); once the
    interpreter is finalizing, a thread that asks for the GIL is ended by
    ``pthread_exit``, whose unwinding through the work's ``noexcept`` destructor aborts
    the process ("terminate called without an active exception"). So the group, before
    it is torn down, waits until gloo holds none of them (``settle()``), and so does the
    interpreter before it finalizes (an ``atexit`` hook). A tensor counts
    as let go once its references are back to what they were when it was handed over."""

    PRUNE_AT = 16      # look for let-go tensors once this many are held
    MOST = 256         # beyond this the oldest go unwatched

    def __init__(self) -> None:
        self._held: list[tuple[torch.Tensor, int]] = []

    def add(self, x: torch.Tensor) -> None:
        if len(self._held) >= self.PRUNE_AT:  # before x joins: gloo has not taken it yet
            self._prune()
            del self._held[:-self.MOST]
        self._held.append((x, x._use_count()))

    def _prune(self) -> None:
        self._held = [(t, before) for t, before in self._held if t._use_count() > before]

    def settle(self, timeout_s: float = 10.0) -> bool:
        """Wait (the GIL released) until no worker thread holds a handed tensor, at most
        ``timeout_s``; then forget them. Whether gloo let go of all of them."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._prune()
            if not self._held or time.monotonic() >= deadline:
                settled = not self._held
                self._held = []
                return settled
            time.sleep(0.001)


_GLOO_HELD = _GlooHeld()
_JOINED_GLOO = False  # whether this process joined a gloo group (``exit_process``)


def exit_process(code: int | str | None) -> NoReturn:
    """End this process as ``sys.exit(code)`` would (None: 0; a message: printed, 1). A
    process that joined a gloo group ends without the interpreter's finalization: its
    ``atexit`` hooks run (``_GlooHeld.settle`` among them) and its output is flushed, then
    ``os._exit``; threads are not joined (a non-daemon thread left running is ended with
    the process) and ``threading``'s own exit hooks do not run. A gloo worker thread that
    drops the last reference to a tensor some collective held, while the interpreter
    finalizes, aborts the process ("terminate called without an active exception",
    ``_GlooHeld``); the watch waits for the tensors it was handed, and a rank was still
    seen aborting so, rarely, at the end of a run whose work was done. Without a
    finalization no thread can meet one. Any other process: ``sys.exit``."""
    if not _JOINED_GLOO:
        sys.exit(code)
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more to say
            pass
    os._exit(code or 0)


def run_main(main: Callable[[], int | None]) -> NoReturn:
    """Run a command's ``main`` and end the process with what it returned or raised
    (``exit_process``): a ``SystemExit`` from inside it (a signal handler's, argparse's)
    keeps its code, an interrupt is 130, and any other exception is printed as the
    interpreter would print it, code 1, so that a gloo rank never reaches the interpreter's finalization either way."""
    try:
        code = main()
    except SystemExit as exc:
        code = exc.code
    except KeyboardInterrupt:
        code = 130  # as a shell reports an interrupted command
    except BaseException:  # noqa: BLE001 - reported, then the process ends as any failed command does
        traceback.print_exc()
        code = 1
    exit_process(code)


def check_tensor_parallel_size(size: int, device: str = "auto") -> None:
    """What can be checked before any process starts: a positive size, and enough GPUs
    for one rank each. SpecserveError (a ValueError) otherwise."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise SpecserveError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    if size == 1:
        return
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if device.startswith("cuda:"):
        raise SpecserveError(f"with tensor_parallel_size {size} each rank uses cuda:LOCAL_RANK; "
                             f"pass device 'cuda' (or 'auto'), not {device!r}")
    if cuda and size > torch.cuda.device_count():
        raise SpecserveError(f"tensor_parallel_size {size} needs {size} GPUs, "
                             f"this host has {torch.cuda.device_count()}")


def init_tensor_parallel(size: int, device: str = "auto", timeout_s: float = 1800) -> TPGroup:
    """Join (or, if this process already joined, describe) the group of ``size`` ranks
    torchrun started. ``device``: the engine's device setting (auto, cpu or cuda);
    ``timeout_s``: how long a collective may wait for the other ranks."""
    check_tensor_parallel_size(size, device)
    if size == 1:
        return SINGLE
    world = os.environ.get("WORLD_SIZE")
    if world is None:
        raise SpecserveError(
            f"tensor_parallel_size {size} runs one process per rank: start them with "
            f"torchrun --nproc-per-node {size} (the specserve CLI does this itself)")
    if int(world) != size:
        raise SpecserveError(f"torchrun started {world} processes but tensor_parallel_size is {size}")
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if cuda:
        rank_device = torch.device("cuda", local_rank)
        torch.cuda.set_device(rank_device)
    else:
        rank_device = torch.device("cpu")
    disable_multicast()
    dist = torch.distributed
    if not dist.is_initialized():
        # device_id binds the rank to its GPU and creates the NCCL communicator now, not
        # inside the first CUDA-graph capture.
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s),
                                **({"device_id": rank_device} if cuda else {}))
        if not cuda:  # also where a script leaves the group its own way, or not at all
            global _JOINED_GLOO
            _JOINED_GLOO = True
            atexit.register(_GLOO_HELD.settle)
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (socket.gethostname(), os.getpid()))
        _RANK_PROCESSES.update(enumerate(everyone))
    backend = dist.get_backend()
    if backend != ("nccl" if cuda else "gloo"):
        raise SpecserveError(f"the process group uses {backend}, but a {rank_device.type} engine "
                             f"needs {'nccl' if cuda else 'gloo'}")
    if dist.get_world_size() != size:
        raise SpecserveError(f"the process group has {dist.get_world_size()} ranks, "
                             f"tensor_parallel_size is {size}")
    return TPGroup(rank=dist.get_rank(), size=size, device=rank_device)


# rank -> (host, pid) of every rank of the group this process joined
_RANK_PROCESSES: dict[int, tuple[str, int]] = {}


def how_process_ended(pid: int) -> str | None:
    """None while process ``pid`` runs; once it has ended (a zombie its parent has not
    reaped yet, or gone), how: "was killed by SIGKILL", "exited with code 1", "exited"."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return "exited"
    except OSError:  # no /proc: only whether it exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "exited"
        except PermissionError:
            pass
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] not in ("Z", "X"):
        return None
    status = int(fields[-1])  # exit_code, as waitpid() would report it (Linux >= 3.5)
    if status & 0x7F:
        try:
            name = signal.Signals(status & 0x7F).name
        except ValueError:
            name = f"signal {status & 0x7F}"
        return f"was killed by {name}"
    return f"exited with code {status >> 8}"


class RankWatch:
    """Rank 0's watch over the other ranks' processes on this host: a daemon thread that
    looks every ``interval`` seconds and calls ``on_lost(why)`` once when one has ended —
    the collectives would otherwise wait for it (NCCL: until the group's timeout).
    ``releasing()`` before the ranks are told to stop: a rank that then exits cleanly
    ends the watch instead; ``stop()`` ends it."""

    def __init__(self, tp: TPGroup, on_lost: Callable[[str], None], interval: float = 0.2) -> None:
        host = socket.gethostname()
        self._ranks = [(rank, pid) for rank, (rank_host, pid) in sorted(_RANK_PROCESSES.items())
                       if rank != tp.rank and rank_host == host]
        self._on_lost, self._interval = on_lost, interval
        self._stopped, self._releasing = threading.Event(), False
        self._thread = threading.Thread(target=self._run, name="specserve-rank-watch", daemon=True)
        if self._ranks:
            self._thread.start()

    def releasing(self) -> None:
        self._releasing = True

    def stop(self) -> None:
        self._stopped.set()

    def check(self) -> str | None:
        """Why the group is broken (a rank's process ended, and how), or None."""
        for rank, pid in self._ranks:
            how = how_process_ended(pid)
            if how is not None:
                return f"tensor-parallel rank {rank} (pid {pid}) {how}"
        return None

    def wait(self, timeout: float) -> str | None:
        """``check()`` until it has an answer or ``timeout`` seconds have passed: a
        collective that failed because a rank died may fail before the rank is seen gone."""
        deadline = time.monotonic() + timeout
        while True:
            why = self.check()
            if why is not None or time.monotonic() >= deadline:
                return why
            time.sleep(0.02)

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            why = self.check()
            if why is None:
                continue
            if not (self._releasing and why.endswith("exited with code 0")) and not self._stopped.is_set():
                self._on_lost(why)
            return


def destroy_tensor_parallel() -> None:
    """Leave the process group (after every CUDA graph holding its collectives is freed:
    NCCL waits for those before it lets a communicator go) and after gloo's worker threads
    have let go of every tensor this process handed them (``_GlooHeld``)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        _GLOO_HELD.settle()
        torch.distributed.destroy_process_group()
