"""What a verify pass costs a mixture of experts, beside a dense model: the wall time of a
target step over 1 token (decode) and over 1 + k tokens (verify) per request, and how
many distinct experts a layer runs for them.

A decode row picks k experts; a verify span of 1 + k tokens picks each token's own, so
it runs more experts than a decode row does, and its step costs more than a dense
model's verify step does relative to its decode step. That is the known reason
speculation pays less on MoE models. Random weights at the shapes below (small enough
for a CPU), one request with ``--context`` tokens cached, in the model's dtype:

- ``dense``: a Llama of hidden 1024, 4 layers, MLP 2816;
- ``mixtral``: the same with 8 experts of 2816, top 2 (Mixtral's routing);
- ``qwen3moe``: the same with 64 experts of 256, top 8 (Qwen3-30B-A3B's ratios).

    python benchmarks/moe_verify.py --json out.json
    python benchmarks/moe_verify.py --device cuda    # every expert runs on a GPU (no grouped GEMM yet)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

COMMON = dict(vocab_size=32000, hidden_size=1024, num_hidden_layers=4, num_attention_heads=16,
              num_key_value_heads=4, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False)
MODELS = {
    "dense": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=2816)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=2816, num_local_experts=8,
                                                            num_experts_per_tok=2)),
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(intermediate_size=2816, moe_intermediate_size=256,
                                                               num_experts=64, num_experts_per_tok=8, head_dim=64)),
}


def build(name: str, dtype: torch.dtype, device: torch.device, path: str):
    import transformers

    from specserve.attention import get_backend
    from specserve.loader import ModelFiles, build_model, load_hf_config

    config_cls, model_cls, extra = MODELS[name]
    torch.manual_seed(0)
    getattr(transformers, model_cls)(getattr(transformers, config_cls)(**COMMON, **extra)).save_pretrained(path)
    files = ModelFiles(name, Path(path))
    backend = get_backend("triton" if device.type == "cuda" else "torch", device)
    return build_model(files, load_hf_config(files), dtype, device, backend)


def step_times(model, device, dtype, context: int, widths: list[int], repeats: int) -> dict:
    """Median seconds of a step over each width's span (and, under ("experts", width),
    the experts a MoE layer runs for it)."""
    from specserve.config import EngineConfig
    from specserve.kv_cache import KVCacheManager
    from specserve.model_runner import ModelRunner
    from specserve.sampling_params import SamplingParams
    from specserve.scheduler import ScheduledRequest, SchedulerOutput

    runner = ModelRunner(model, EngineConfig(block_size=16, num_kv_blocks=(context + 64) // 16 + 1),
                         device, dtype)
    kv = KVCacheManager(runner.num_blocks, 16)
    kv.allocate_slots("r", context + max(widths))
    table = kv.block_table("r")
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 32000, (context + max(widths),), generator=g).tolist()
    params = SamplingParams(temperature=0)
    with torch.inference_mode():
        for start in range(0, context, 256):  # the context, cached
            n = min(256, context - start)
            runner.execute(SchedulerOutput([ScheduledRequest("r", prompt[start:start + n], start, table, params)], []))
        out = {}
        for width in widths:
            span = SchedulerOutput([ScheduledRequest("r", prompt[context:context + width], context, table, params)], [])
            for _ in range(3):
                runner.execute(span)
            times = []
            for _ in range(repeats):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                began = time.perf_counter()
                runner.execute(span)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - began)
            out[width] = statistics.median(times)
            out[("experts", width)] = experts_touched(model, lambda: runner.execute(span))
    return out


def experts_touched(model, runner_step) -> float:
    """Distinct experts per MoE layer per call while ``runner_step()`` runs (0: dense)."""
    from specserve.models.moe import SparseMoE

    counts = []

    def count(moe, inputs):
        counts.append(len(set(moe.routing(inputs[0])[1].flatten().tolist())))

    hooks = [layer.mlp.register_forward_pre_hook(count) for layer in model.model.layers
             if isinstance(layer.mlp, SparseMoE)]
    with torch.inference_mode():
        runner_step()
    for hook in hooks:
        hook.remove()
    return statistics.fmean(counts) if counts else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--k", type=int, default=4, help="drafts per verify span")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from specserve.bench.cli import describe_machine

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    rows = []
    for name in MODELS:
        with tempfile.TemporaryDirectory() as path:
            model = build(name, dtype, device, path)
            times = step_times(model, device, dtype, args.context, [1, 1 + args.k], args.repeats)
            row = {"model": name, "decode_ms": 1e3 * times[1], "verify_ms": 1e3 * times[1 + args.k],
                   "ratio": times[1 + args.k] / times[1], "experts_decode": times[("experts", 1)],
                   "experts_verify": times[("experts", 1 + args.k)]}
            rows.append(row)
            print(f"{name:10s} decode {row['decode_ms']:7.2f} ms  verify(1+{args.k}) {row['verify_ms']:7.2f} ms  "
                  f"ratio {row['ratio']:.2f}  experts per layer {row['experts_decode']:.1f} -> "
                  f"{row['experts_verify']:.1f}", flush=True)
            del model
    machine = describe_machine()
    print(machine)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
