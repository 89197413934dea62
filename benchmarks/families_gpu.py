"""The new model families at real shapes on one GPU, random bf16 weights made on the GPU:
the batch-1 decode step (CUDA graph replay) against its bandwidth floor, the verify pass
of 1 + 4 tokens against it, and a batch-64 decode step.

The floor is the bytes a step must read over the measured copy bandwidth: every weight
of a dense model; for a mixture of experts the weights outside the experts plus the
experts the step's tokens chose (top-k per layer: every request feeds the same token, so
at batch 64 too), and the KV cache of 512 tokens per request.

    python benchmarks/families_gpu.py --json out.json [--models phi3_mini,qwen3_30b_a3b,mixtral_8x7b]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_bench import _copy_bandwidth, decode_step, kv_read_bytes, log, median_ms  # noqa: E402

SHAPES = {
    "phi3_mini": ("Phi3Config", "Phi3ForCausalLM", dict(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32064, max_position_embeddings=4096)),
    "qwen3_30b_a3b": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, vocab_size=151936, max_position_embeddings=40960, norm_topk_prob=True)),
    "mixtral_8x7b": ("MixtralConfig", "MixtralForCausalLM", dict(
        hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
        max_position_embeddings=32768)),
}


def random_model(name: str, device: torch.device):
    """Our model of ``name``'s shape with random bf16 weights made on ``device``."""
    import transformers

    from specserve.attention import get_backend
    from specserve.distributed import SINGLE
    from specserve.models import ARCHITECTURES, LlamaForCausalLM

    config_cls, arch, shape = SHAPES[name]
    config = getattr(transformers, config_cls)(**shape, tie_word_embeddings=False)
    config.architectures = [arch]
    with torch.device("meta"):
        model = LlamaForCausalLM(config, ARCHITECTURES[arch], get_backend("triton", device), SINGLE)
    model = model.to(torch.bfloat16).to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    for rotary in (model.model.rotary, model.model.rotary_local):
        if rotary is not None:
            rotary.reset_tables(device)
    for module in model.modules():
        if hasattr(module, "finish_loading"):
            module.finish_loading()
    return model.eval()


def read_bytes(model) -> int:
    """Weight bytes a decode step reads: for a MoE, top-k experts per layer. Every request
    of ``gpu_bench.decode_step`` feeds the same token after the same cache, so at batch 64
    too they all choose the same k experts (a best case for MoE, said in the results)."""
    from specserve.models.moe import SparseMoE

    total = 0
    for module in model.modules():
        if isinstance(module, SparseMoE):
            per_expert = sum(p.numel() * p.element_size() for p in module.experts[0].parameters())
            total += module.top_k * per_expert
    expert_params = {id(p) for m in model.modules() if isinstance(m, SparseMoE) for p in m.experts.parameters()}
    return total + sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in expert_params)


def time_step(runner, scheduled, reps: int, device) -> float:
    return median_ms(lambda: runner.execute(scheduled), reps, device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(SHAPES))
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from specserve.config import EngineConfig
    from specserve.model_runner import ModelRunner

    device = torch.device("cuda")
    bandwidth = _copy_bandwidth(device)
    rows, context = [], 512
    for name in args.models.split(","):
        log(f"building {name} with random bf16 weights on the GPU")
        model = random_model(name, device)
        cfg = EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=64, max_num_batched_tokens=2048,
                           num_kv_blocks=2304, block_size=16)
        runner = ModelRunner(model, cfg, device, torch.bfloat16, num_blocks=2304)
        runner.enable_graphs(5, 1024)

        decode, verify, b64 = (time_step(runner, decode_step(b, d, context), args.reps, device)
                               for b, d in ((1, 0), (1, 4), (64, 0)))
        floor = 1000 * (read_bytes(model) + kv_read_bytes(model, context)) / bandwidth
        floor64 = 1000 * (read_bytes(model) + kv_read_bytes(model, context, 64)) / bandwidth
        row = {"model": name, "card": torch.cuda.get_device_name(), "bandwidth_tb_s": round(bandwidth / 1e12, 2),
               "weights_gb": round(sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9, 1),
               "decode_ms": round(decode, 3), "floor_ms": round(floor, 3), "decode_vs_floor": round(decode / floor, 2),
               "verify_ms": round(verify, 3), "verify_vs_decode": round(verify / decode, 3),
               "batch64_ms": round(b64, 3), "batch64_floor_ms": round(floor64, 3)}
        rows.append(row)
        log(json.dumps(row))
        runner = model = None  # freed before the next model is built
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
