"""The new model families at real shapes on one GPU, random bf16 weights made on the GPU:
the batch-1 decode step (CUDA graph replay) against its bandwidth floor, the verify pass
of 1 + 4 tokens against it, and batch-64 decode steps: every request feeding the same
token (a mixture of experts then runs top-k experts a layer, its best case) and each its
own token (experts routed apart, as in a real batch).

The floor is the bytes a step must read over the measured copy bandwidth: every weight
of a dense model; for a mixture of experts the weights outside the experts plus the
experts the step's tokens chose (counted from the router in an eager run of the same
step), and the KV cache of 512 tokens per request.

    python benchmarks/families_gpu.py --json out.json [--models gemma2_9b,phi4_mini,...]
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
    "gemma2_9b": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        hidden_size=3584, intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, vocab_size=256000, max_position_embeddings=8192,
        sliding_window=4096, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, tie_word_embeddings=True)),
    "phi4_mini": ("Phi3Config", "Phi3ForCausalLM", dict(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=24,
        num_key_value_heads=8, vocab_size=200064, max_position_embeddings=131072,
        original_max_position_embeddings=4096, partial_rotary_factor=0.75, tie_word_embeddings=True,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": [1.0] * 48, "long_factor": [1.0] * 48})),
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
    config = getattr(transformers, config_cls)(**{"tie_word_embeddings": False, **shape})
    config.architectures = [arch]
    with torch.device("meta"):
        model = LlamaForCausalLM(config, ARCHITECTURES[arch], get_backend("triton", device), SINGLE)
    model = model.to(torch.bfloat16).to_empty(device=device)
    model.tie_weights()
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


def experts_touched(model, runner, scheduled) -> list[int]:
    """How many distinct experts each MoE layer's router picks for ``scheduled``'s tokens,
    from one eager run of the step (before graphs are captured); [] for a dense model."""
    from specserve.models.moe import SparseMoE

    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    counts: list[int] = []

    def counting(route):
        def routing(x):
            weights, experts = route(x)
            counts.append(int(experts.unique().numel()))
            return weights, experts
        return routing

    for layer in layers:
        layer.routing = counting(layer.routing)
    try:
        runner.execute(scheduled)
    finally:
        for layer in layers:
            del layer.routing  # the class's method again
    return counts


def read_bytes(model, touched: list[int]) -> int:
    """Weight bytes a step reads: the weights outside the experts, and for each MoE layer
    the ``touched`` experts (``experts_touched``)."""
    from specserve.models.moe import SparseMoE

    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    total = 0
    for layer, count in zip(layers, touched, strict=True):
        total += count * sum(p.numel() * p.element_size() for p in layer.experts[0].parameters())
    expert_params = {id(p) for m in layers for p in m.experts.parameters()}
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
        runner.kv_storage.normal_()  # cached context that is not all zeros: tokens attend, and route, apart
        steps = {"decode": decode_step(1, 0, context), "verify": decode_step(1, 4, context),
                 "batch64": decode_step(64, 0, context), "batch64_mixed": decode_step(64, 0, context, distinct=True)}
        touched = {key: experts_touched(model, runner, step) for key, step in steps.items()}
        runner.enable_graphs(5, 1024)
        ms = {key: time_step(runner, step, args.reps, device) for key, step in steps.items()}

        def floor(key: str, batch: int) -> float:
            return 1000 * (read_bytes(model, touched[key]) + kv_read_bytes(model, context, batch)) / bandwidth

        row = {"model": name, "card": torch.cuda.get_device_name(), "bandwidth_tb_s": round(bandwidth / 1e12, 2),
               "weights_gb": round(sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9, 1),
               "decode_ms": round(ms["decode"], 3), "floor_ms": round(floor("decode", 1), 3),
               "decode_vs_floor": round(ms["decode"] / floor("decode", 1), 2),
               "verify_ms": round(ms["verify"], 3), "verify_vs_decode": round(ms["verify"] / ms["decode"], 3),
               "verify_floor_vs_decode_floor": round(floor("verify", 1) / floor("decode", 1), 3)}
        for key in ("batch64", "batch64_mixed"):
            row |= {f"{key}_ms": round(ms[key], 3), f"{key}_floor_ms": round(floor(key, 64), 3)}
        if touched["decode"]:  # mean experts a layer runs, per step
            row["experts_per_layer"] = {key: round(sum(c) / len(c), 1) for key, c in touched.items()}
        rows.append(row)
        log(json.dumps(row))
        runner = model = None  # freed before the next model is built
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
