"""The ranks of a tensor-parallel engine other than rank 0: each loads its shard of the
target model and runs every pass rank 0 announces (``step_channel.py``), until told to stop."""
from __future__ import annotations

import logging
import signal
import threading

from specserve.attention import get_backend
from specserve.distributed import init_tensor_parallel
from specserve.errors import SpecserveError
from specserve.heap import freeze_heap
from specserve.loader import build_model, load_hf_config, resolve_model
from specserve.model_runner import ModelRunner
from specserve.step_channel import COPY, GRAPHS, SHUTDOWN, StepChannel

logger = logging.getLogger("specserve")


def follow(runner, channel: StepChannel) -> None:
    """Run every pass and graph set-up rank 0 announces, until it says stop.

    Ctrl-C and SIGTERM reach every rank of a torchrun job; only rank 0 acts on them
    (it lets requests finish, then sends the stop), so this rank ignores them meanwhile.
    A failure here ends the process: the ranks could not agree on what runs next."""
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            message = channel.receive()
            if message.kind == SHUTDOWN:
                return
            if message.kind == GRAPHS:
                runner.enable_graphs(*message.graphs)
            elif message.kind == COPY:
                runner.copy_blocks(message.block_copies)
            else:
                runner.execute(message.output, message.num_layers, message.device_ids)
    finally:
        for sig, handler in (previous or {}).items():
            signal.signal(sig, handler)


def run_worker(config) -> None:
    """Rank 1.. of a tensor-parallel engine: load this rank's shard of the model, size its
    KV cache with the others, then follow rank 0 until its engine shuts down.
    ``config``: the same EngineConfig rank 0's LLMEngine was given."""
    tp = init_tensor_parallel(config.tensor_parallel_size, config.device)
    if tp.is_driver:
        raise SpecserveError("rank 0 runs the engine (LLMEngine), not run_worker")
    with tp.rank_zero_first():  # rank 0 converts a GGUF into the cache once
        files = resolve_model(config.model)
    hf_config = load_hf_config(files)
    dtype = config.torch_dtype
    model = build_model(files, hf_config, dtype, tp.device,
                        get_backend(config.attention_backend, tp.device, config.deterministic), tp=tp)
    runner = ModelRunner(model, config, tp.device, dtype, tp=tp)
    logger.info("rank %d of %d: following rank 0", tp.rank, tp.size)
    freeze_heap()  # as rank 0's engine does: steps allocate, collections walk only what they make
    try:
        follow(runner, StepChannel(tp))
    finally:
        runner.close()
