"""One rank of the 2-process gloo job behind test_tensor_parallel.py (not a test module).

    torchrun --standalone --nproc-per-node 2 tests/tp_job.py SPEC.json OUT_DIR

For every model in the spec, each rank builds its shard and runs the same ragged passes
as test_model.ragged_logits (logits of every position, chunked prefill over a paged
cache); then, for every engine run, rank 0 runs an LLMEngine with tensor_parallel_size 2
while rank 1 runs tp_worker.run_worker. Each rank writes what it saw to OUT_DIR/rank{r}.pt;
the test compares it with the unsharded model in its own process.
"""
from __future__ import annotations

import atexit
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
torch.set_num_threads(1)


def main(spec_path: str, out_dir: str) -> None:
    from specserve import EngineConfig, LLMEngine, SamplingParams
    from specserve.attention import TorchAttentionBackend
    from specserve.distributed import _GLOO_HELD, destroy_tensor_parallel, init_tensor_parallel
    from specserve.loader import ModelFiles, build_model, load_hf_config
    from specserve.tp_worker import run_worker
    from test_model import ragged_logits

    spec = json.loads(Path(spec_path).read_text())
    hooks = []  # what the group registers to run before the interpreter finalizes
    register = atexit.register
    atexit.register = lambda f, *a, **kw: hooks.append(f) or register(f, *a, **kw)
    tp = init_tensor_parallel(2, "cpu")
    atexit.register = register
    seen = {"rank": tp.rank, "env": {k: os.environ.get(k) for k in
                                     ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                      "NVSHMEM_DISABLE_NVLS")},
            "logits": {}, "shapes": {}, "outputs": {}, "free_blocks": {}}
    for name, path in spec["models"].items():
        files = ModelFiles(name, Path(path))
        model = build_model(files, load_hf_config(files), torch.float32, torch.device("cpu"),
                            TorchAttentionBackend(), tp=tp)
        seen["logits"][name] = ragged_logits(model, spec["prompts"], chunk=5)
        seen["shapes"][name] = {n: tuple(p.shape) for n, p in model.named_parameters()}
    for run in spec["engines"]:
        config = EngineConfig(model=run["model"], tensor_parallel_size=2, device="cpu",
                              **{"dtype": "float32", **run["engine"]})
        if not tp.is_driver:
            run_worker(config)
            continue
        engine = LLMEngine(config)
        graph_steps = []
        if run.get("graphs"):  # the CUDA-graph path's padded static buffers, run eagerly
            engine.runner.enable_graphs(1 + config.max_draft_tokens, engine.max_model_len,
                                        capture=False)
            replay = engine.runner.graphs.run
            engine.runner.graphs.run = lambda *a: graph_steps.append(len(a[0].scheduled)) or replay(*a)
        seen["shapes"][run["name"]] = tuple(engine.runner.kv_caches[0][0].shape)
        outputs = []
        for params in run["params"]:
            ids = [engine.add_request(p, SamplingParams(**params)) for p in run["prompts"]]
            final = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        final[out.req_id] = out
            outputs.append([final[i].token_ids for i in ids])
        seen["outputs"][run["name"]] = outputs
        seen["free_blocks"][run["name"]] = (engine.num_free_blocks, engine.kv.num_blocks,
                                            engine.spec_stats.num_drafts, engine.spec_stats.num_path_wins)
        seen["graph_steps"] = seen.get("graph_steps", []) + graph_steps
        engine.shutdown()
    # whether the collectives' tensors were watched, and gloo's threads let go of them all
    seen["gloo_held"] = (len(_GLOO_HELD._held) > 0, _GLOO_HELD.settle(), _GLOO_HELD.settle in hooks)
    torch.save(seen, Path(out_dir) / f"rank{tp.rank}.pt")
    destroy_tensor_parallel()


if __name__ == "__main__":
    from specserve.distributed import run_main

    run_main(lambda: main(*sys.argv[1:3]))
