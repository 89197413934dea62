"""A model driven step by step over the paged cache, without the engine: shared by the
kernel tests that compare one layer-op path with another."""
from __future__ import annotations

import torch

from specserve.config import EngineConfig
from specserve.kv_cache import KVCacheManager
from specserve.model_runner import ModelRunner
from specserve.sampling_params import SamplingParams
from specserve.scheduler import ScheduledRequest, SchedulerOutput


def chunked_prefill_logits(model, prompts: list[list[int]], chunk: int, device: torch.device,
                           kv_dtype: torch.dtype | None = None, calibrate: list[int] | None = None) -> torch.Tensor:
    """Every prompt prefilled ``chunk`` tokens a step, all prompts in each step's ragged
    batch; the logits of every position of every prompt, concatenated. ``kv_dtype``: the
    cache's (float8: scales 1, or calibrated on the tokens ``calibrate``)."""
    runner = ModelRunner(model, EngineConfig(block_size=4, num_kv_blocks=64), device, torch.float32,
                         kv_dtype=kv_dtype)
    kv = KVCacheManager(runner.num_blocks, 4)
    for layer in model.model.layers:
        layer.self_attn.kv_scales = (1.0, 1.0)
    if calibrate:
        kv.allocate_slots("calibration", len(calibrate))
        runner.calibrate_kv_scales(calibrate, kv.block_table("calibration"))
        kv.free("calibration")
    kv.pool.allocate(7)  # block tables that are not contiguous
    done, steps = [0] * len(prompts), []
    while any(d < len(p) for d, p in zip(done, prompts)):
        planned = []
        for i, prompt in enumerate(prompts):
            n = min(chunk, len(prompt) - done[i])
            if n:
                kv.allocate_slots(str(i), done[i] + n)
                planned.append(ScheduledRequest(str(i), prompt[done[i]:done[i] + n], done[i],
                                                kv.block_table(str(i)), SamplingParams()))
                done[i] += n
        batch = runner.prepare(SchedulerOutput(planned, []))
        with torch.inference_mode():
            steps.append(model.compute_logits(model(batch.input_ids, batch.positions, runner.kv_caches, batch)))
    return torch.cat(steps).cpu()
