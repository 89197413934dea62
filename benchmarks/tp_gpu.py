"""Tensor parallelism on the GPUs of one host: correctness first, then timings, one table last.

    torchrun --nproc-per-node 2 benchmarks/tp_gpu.py [--reps 200] [--json tp.json]
    torchrun --nproc-per-node 2 benchmarks/tp_gpu.py --device cpu      # dry run: tiny, gloo
    python benchmarks/tp_gpu.py                                        # TP=1 only

1. Small random-weight models (seeded, identical on every rank; GQA with the KV heads
   split, and one KV head replicated with qkv bias): greedy outputs of the engine at
   TP=N — rank 0 an LLMEngine, the other ranks ``run_worker``; CUDA graphs, chunked
   prefill, n-gram speculation — against TP=1 on rank 0 alone, same card. float32 must
   agree token for token; bfloat16 agreement is measured and reported.
2. Llama-3.1-8B shape with random bf16 weights made directly sharded on each rank (the
   whole model never exists on one GPU): the decode step at TP=N through the engine's
   runner (metadata broadcast + CUDA-graph replay, CUDA events on rank 0) and the graph
   replay alone on all ranks; then the same at TP=1 on rank 0 while the others wait.
   Each beside its floor: (weight bytes + KV read, per rank) / measured copy bandwidth.

NVLink multicast stays off (specserve.distributed.MULTICAST_OFF, set before NCCL starts).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "tests"))

from gpu_bench import (_card, _copy_bandwidth, agreement, decode_step, kv_read_bytes, llama_8b_config,  # noqa: E402
                       median_ms, random_llama, weight_bytes)

from specserve.distributed import (MULTICAST_OFF, SINGLE, TPGroup, disable_multicast,  # noqa: E402
                                   init_tensor_parallel)

PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef sub(a, b):",
    "import os\nimport sys\nimport os\nimport sys\nimport re\nimport os\n",
    "class Stack:\n    def push(self, x):\n        self.items.append(x)\n    def pop(self):",
    "hello",
    "x = 1\ny = 2\nz = x + y\n" * 12,  # longer than the token budget: chunked prefill
    "for i in range(10):\n    print(i)\nfor j in range(10):\n",
]
SMALL_MODELS = {  # name -> (tests/tiny_models variant, overrides)
    "llama-gqa": ("llama", dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                num_attention_heads=8, num_key_value_heads=2)),
    "qwen2-kv1": ("qwen2_bias", dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                     num_attention_heads=8, num_key_value_heads=1)),
}


def log(tp: TPGroup, msg: str) -> None:
    if tp.is_driver:
        print(msg, flush=True)


# ---------------------------------------------------------------------- 0. preflight
def graph_collectives_work(tp: TPGroup) -> bool:
    """An all-reduce eagerly, then captured in a CUDA graph and replayed twice — what
    every captured forward pass relies on. False (reason printed) when capture fails:
    the rest then runs eagerly (enforce_eager) instead of stopping."""
    if tp.size == 1:
        return True
    if tp.device.type != "cuda":
        return False  # gloo on CPU: the graph path runs its padding eagerly
    x = torch.ones(4, device=tp.device)
    torch.distributed.all_reduce(x)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            torch.distributed.all_reduce(x)
        graph.replay()
        graph.replay()
        torch.cuda.synchronize()
        ok = x[0].item() == tp.size ** 3
        del graph
        log(tp, f"NCCL all-reduce inside a CUDA graph: {'ok' if ok else f'WRONG SUM {x[0].item()}'}")
        return ok
    except Exception as exc:  # noqa: BLE001 - reported; the run goes on without graphs
        log(tp, f"NCCL all-reduce inside a CUDA graph FAILED ({type(exc).__name__}: {exc}); "
                "running eagerly")
        return False


# ---------------------------------------------------------------------- 1. correctness
def write_small_models(folder: Path) -> dict[str, Path]:
    from tiny_models import make_hf_model, make_tokenizer

    tokenizer = make_tokenizer(512)
    paths = {}
    for name, (variant, overrides) in SMALL_MODELS.items():
        paths[name] = folder / name
        make_hf_model(variant, seed=0, **overrides).save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
    return paths


def run_engine(config, tp: TPGroup, max_tokens: int, graphs_eagerly: bool):
    """Rank 0: the engine's greedy outputs for PROMPTS (and engine facts); other ranks:
    follow it (None)."""
    from specserve import LLMEngine, SamplingParams
    from specserve.tp_worker import run_worker

    if not tp.is_driver and config.tensor_parallel_size > 1:
        run_worker(config)
        return None
    engine = LLMEngine(config)
    try:
        if graphs_eagerly:  # CPU dry run: the graph path's padding, eagerly, on every rank
            engine.runner.enable_graphs(1 + config.max_draft_tokens, engine.max_model_len,
                                        capture=False)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        ids = [engine.add_request(p, params) for p in PROMPTS]
        final, steps = {}, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final[out.req_id] = out
            steps += 1
        return {"token_ids": [final[i].token_ids for i in ids], "steps": steps,
                "graphs": "off" if engine.runner.graphs is None else
                          "captured" if engine.runner.graphs.capture else "padded, eager",
                "acceptance_length": round(engine.spec_stats.mean_acceptance_length, 2),
                "free_blocks_ok": engine.num_free_blocks == engine.kv.num_blocks}
    finally:
        engine.shutdown()


def check_section(args, tp: TPGroup, rows: list, paths: dict[str, Path]) -> None:
    from specserve import EngineConfig

    for name, path in paths.items():
        for dtype in ("float32", "bfloat16"):
            common = dict(model=str(path), device=args.device, dtype=dtype, seed=0, block_size=16,
                          num_kv_blocks=512, max_num_seqs=8, max_num_batched_tokens=64,
                          speculative_method="ngram", num_speculative_tokens=4,
                          enforce_eager=not args.graphs)
            start = time.perf_counter()
            eagerly = args.device == "cpu" or not args.graphs
            sharded = run_engine(EngineConfig(**common, tensor_parallel_size=tp.size), tp,
                                 args.max_tokens, eagerly)
            if not tp.is_driver:
                continue
            whole = run_engine(EngineConfig(**common), SINGLE, args.max_tokens, eagerly)
            same = sharded["token_ids"] == whole["token_ids"]
            row = {"section": "greedy TP=N vs TP=1", "model": name, "dtype": dtype, "tp": tp.size,
                   "identical": same,
                   "agreement": round(agreement(sharded["token_ids"], whole["token_ids"]), 4),
                   "tokens": sum(map(len, whole["token_ids"])), "graphs": sharded["graphs"],
                   "acceptance_length": sharded["acceptance_length"],
                   "blocks_freed": sharded["free_blocks_ok"] and whole["free_blocks_ok"],
                   "seconds": round(time.perf_counter() - start, 1), "card": _card()}
            if dtype == "float32" and not same:
                row["verdict"] = "FAIL: float32 outputs differ"
            rows.append(row)
            log(tp, json.dumps(row))


# ---------------------------------------------------------------------- 2. 8B-shape timing
def shape_config(args):
    if args.tiny:
        return llama_8b_config(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                               num_attention_heads=8, num_key_value_heads=2, vocab_size=1000,
                               max_position_embeddings=2048), "tiny Llama shape (dry run)"
    return llama_8b_config(), "Llama-3.1-8B shape"


def time_shape(args, tp: TPGroup, rows: list, bandwidth: float) -> None:
    """Time the decode step on this group (TP=1: ``tp`` is SINGLE on rank 0 only)."""
    from specserve.config import EngineConfig
    from specserve.model_runner import ModelRunner
    from specserve.step_channel import StepChannel
    from specserve.tp_worker import follow

    config, label = shape_config(args)
    device = tp.device if tp.size > 1 else torch.device(args.device)
    cuda = device.type == "cuda"
    capture = cuda and args.graphs
    max_batch = max(args.batches)
    blocks = max_batch * -(-(args.context + 1) // 16) + 16
    log(tp, f"building the {label} with random bf16 weights, TP={tp.size}")
    model = random_llama(config, device, torch.bfloat16, tp if tp.size > 1 else None, seed=tp.rank)
    cfg = EngineConfig(device=args.device, dtype="bfloat16", max_num_seqs=max_batch, block_size=16,
                       max_num_batched_tokens=2048, num_kv_blocks=blocks, tensor_parallel_size=tp.size)
    runner = ModelRunner(model, cfg, device, torch.bfloat16, num_blocks=blocks, tp=tp)
    max_model_len = args.context + 64
    steps = {b: decode_step(b, 0, args.context) for b in args.batches}
    step_ms = {}
    if tp.is_driver:
        start = time.perf_counter()
        runner.enable_graphs(1, max_model_len, capture=capture)  # announced: every rank captures
        log(tp, f"  graphs ready in {time.perf_counter() - start:.1f} s")
        for b, out in steps.items():  # the engine's path: broadcast the metadata, replay
            step_ms[b] = median_ms(lambda: runner.execute(out), args.reps, device)
        if runner.channel is not None:
            runner.channel.send_shutdown()  # the others leave follow(); the graphs stay
            runner.channel = None
    else:
        follow(runner, StepChannel(tp))
    replay_ms = {b: median_ms(lambda: runner.graphs.run(out, 16), args.reps, device)  # all ranks at once
                 for b, out in steps.items()}
    per_rank_weights = weight_bytes(model)
    for b in args.batches:
        floor = 1000 * (per_rank_weights + kv_read_bytes(model, args.context, b)) / bandwidth
        row = {"section": label, "tp": tp.size, "batch": b, "context": args.context,
               "decode_step_ms": round(step_ms.get(b, float("nan")), 3),
               "graph_replay_ms": round(replay_ms[b], 3), "floor_ms": round(floor, 3),
               "step_over_floor": round(step_ms.get(b, float("nan")) / floor, 2),
               "weight_gb_per_rank": round(per_rank_weights / 1e9, 2),
               "copy_bandwidth_tb_s": round(bandwidth / 1e12, 3), "card": _card(),
               "graphs": "captured" if capture else "eager (padded graph path)"}
        rows.append(row)
        log(tp, json.dumps(row))
    runner.graphs = None  # before the communicator may go: NCCL waits for graphs holding it
    del runner, model
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def timing_section(args, tp: TPGroup, rows: list, control) -> None:
    device = tp.device if tp.size > 1 else torch.device(args.device)
    bandwidth = _copy_bandwidth(device, 2**30 if device.type == "cuda" else 2**26)
    if tp.size > 1:
        time_shape(args, tp, rows, bandwidth)
    if tp.is_driver:
        try:
            time_shape(args, SINGLE, rows, bandwidth)
        except Exception:  # report it, and let the other ranks go
            traceback.print_exc()
            rows.append({"section": "TP=1", "error": traceback.format_exc().splitlines()[-1]})
    if control is not None:
        control.barrier()  # the other ranks wait (on gloo, not spinning a GPU) for TP=1


# ---------------------------------------------------------------------- table
def print_table(args, tp: TPGroup, rows: list) -> None:
    name = _card()
    lines = [f"\n{name} x {tp.size}, torch {torch.__version__}{_nccl_version()}; "
             + ", ".join(f"{k}={os.environ.get(k)}" for k in MULTICAST_OFF)]
    checks = [r for r in rows if r.get("section") == "greedy TP=N vs TP=1"]
    if checks:
        lines.append("| model | dtype | TP | greedy identical to TP=1 | agreement | tokens | graph path |")
        lines.append("| --- | --- | ---: | --- | ---: | ---: | --- |")
        for r in checks:
            lines.append(f"| {r['model']} | {r['dtype']} | {r['tp']} | {'yes' if r['identical'] else 'NO'} | "
                         f"{r['agreement']:.3f} | {r['tokens']} | {r['graphs']} |")
    timings = [r for r in rows if "decode_step_ms" in r]
    if timings:
        lines.append("")
        lines.append("| shape (bf16) | TP | batch | decode step (ms) | graph replay (ms) | floor (ms) "
                     "| step / floor | weights per GPU (GB) | card |")
        lines.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        for r in sorted(timings, key=lambda r: (r["batch"], r["tp"])):
            lines.append(f"| {r['section']} | {r['tp']} | {r['batch']} | {r['decode_step_ms']:.3f} | "
                         f"{r['graph_replay_ms']:.3f} | {r['floor_ms']:.3f} | {r['step_over_floor']:.2f} | "
                         f"{r['weight_gb_per_rank']:.2f} | {r['card']} |")
        bw = timings[0]["copy_bandwidth_tb_s"]
        lines.append(f"floor = (weight bytes + KV read) per GPU / {bw:.2f} TB/s measured device copy "
                     f"bandwidth; context {args.context} tokens; decode step = rank 0's runner "
                     "(metadata broadcast + graph replay), graph replay = forward alone on every rank")
    for r in rows:
        if "error" in r:
            lines.append(f"ERROR in {r['section']}: {r['error']}")
    print("\n".join(lines), flush=True)


def _nccl_version() -> str:
    try:
        version = torch.cuda.nccl.version() if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - a label only
        return ""
    if version is None:
        return ""
    return f", NCCL {'.'.join(map(str, version)) if isinstance(version, tuple) else version}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cuda (the real run) or cpu (a dry run over gloo at tiny sizes)")
    parser.add_argument("--tiny", action="store_true", help="tiny shape instead of 8B (default on cpu)")
    parser.add_argument("--reps", type=int, default=200, help="timed repetitions per figure (median)")
    parser.add_argument("--batches", default="1,64", help="decode batch sizes to time (default: 1,64)")
    parser.add_argument("--context", type=int, default=512, help="cached tokens per request (default: 512)")
    parser.add_argument("--max-tokens", type=int, default=48, help="greedy tokens per prompt in the check")
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--timeout-s", type=float, default=300,
                        help="how long a rank waits in a collective before the job fails (default: 300)")
    parser.add_argument("--json", default=None, help="write every row here (rank 0)")
    args = parser.parse_args()
    args.batches = sorted({int(b) for b in args.batches.split(",")})
    args.tiny = args.tiny or args.device == "cpu"
    if args.device == "cpu":
        torch.set_num_threads(1)
    disable_multicast()  # before NCCL starts; init_tensor_parallel does it too
    size = int(os.environ.get("WORLD_SIZE", "1"))
    # Each rank writes the same seeded checkpoints to its own folder, before the process
    # group exists (transformers' save_pretrained writes on rank 0 only once it does).
    folder = Path(tempfile.mkdtemp(prefix=f"specserve-tp-rank{os.environ.get('RANK', '0')}-"))
    paths = {} if args.skip_check or size == 1 else write_small_models(folder)
    tp = init_tensor_parallel(size, args.device, timeout_s=args.timeout_s)
    control = torch.distributed.new_group(backend="gloo") if size > 1 else None
    import logging

    logging.getLogger("specserve").setLevel(logging.WARNING)
    os.environ["TQDM_DISABLE"] = "1"
    rows: list = []
    log(tp, f"tensor parallelism benchmark: {size} rank(s) on {_card()}, device {args.device}")
    args.graphs = graph_collectives_work(tp)
    if not args.skip_check and size > 1:
        check_section(args, tp, rows, paths)
    shutil.rmtree(folder, ignore_errors=True)
    if not args.skip_timing:
        timing_section(args, tp, rows, control)
    if tp.is_driver:
        print_table(args, tp, rows)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    sys.stdout.flush()
    sys.stderr.flush()
    if control is not None:
        control.barrier()
    # Leave without tearing the NCCL communicator down: it can wait on CUDA graphs that
    # captured its collectives, and everything above is already printed.
    os._exit(0)


if __name__ == "__main__":
    main()
