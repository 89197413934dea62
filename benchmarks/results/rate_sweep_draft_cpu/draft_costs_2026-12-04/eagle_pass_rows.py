"""What one further pass of an EAGLE head costs over the rows it runs: a head for the
default model (started from one of its layers, weights nudged at random: what a pass
costs does not depend on what it learned), its passes timed over 24 requests' rows and
fewer, as a compact pass runs only the rows still drafting.
From the repository root: PYTHONPATH=$PWD:$PWD/tests python eagle_pass_rows.py HEAD_DIR
"""
import statistics
import sys
import time
from pathlib import Path

import torch

from specserve import LLMEngine, SamplingParams
from specserve.batch import DeviceTokenIds
from specserve.loader import resolve_model
from specserve.scheduler import ScheduledRequest

head_dir = Path(sys.argv[1])
if not (head_dir / "model.safetensors").exists():
    from tiny_models import make_eagle_head

    target_dir = resolve_model(None).path
    make_eagle_head(target_dir, [29], head_dir)
engine = LLMEngine(speculative_method="draft_model", draft_model=str(head_dir))
spec = engine.speculator
drafter, kv = spec.drafter, spec.kv
print(drafter.describe(), "| threads", torch.get_num_threads(), flush=True)
greedy = SamplingParams(temperature=0)
ids = [f"__t{i}" for i in range(24)]
context = 256
for i in ids:
    assert kv.allocate_slots(i, context + 8)
hidden = engine.runner.model.config.hidden_size if hasattr(engine.runner.model, "config") else 576
rows = {}
for rnd in range(3):
    for n in (24, 18, 12, 6, 3, 1):
        step = [ScheduledRequest(i, [0], context, list(kv.block_table(i)), greedy) for i in ids[:n]]
        feats = torch.randn(n, hidden, dtype=engine.dtype)
        tokens = torch.zeros(n, dtype=torch.int64)
        times = []
        for _ in range(12):
            start = time.perf_counter()
            drafter._forward(step, [feats], DeviceTokenIds(tokens, [1] * n))
            times.append(time.perf_counter() - start)
        rows.setdefault(n, []).append(statistics.median(times[2:]))
print("| rows a pass runs | ms (median of 3 rounds of 10) |")
print("| ---: | ---: |")
for n, v in rows.items():
    print(f"| {n} | {statistics.median(v) * 1e3:.2f} |")
