"""What each drafter adds to a step, beside speculation off, in one run: random-weight
models of the default model's shapes, so every draft is rejected and each step is the
target's verify pass plus the drafter's passes.

- target: SmolLM2-135M-Instruct's shape (30 layers, hidden 576, vocab 49,152), bf16;
- ``eagle1``: a one-layer EAGLE head in the published EAGLE-1/2 layout (``fc`` over
  [embedding; the target's final hidden state], the target's LM head);
- ``eagle3``: a one-layer EAGLE-3 head in the published layout (``midlayer``, ``fc`` over
  three target layers' states, its own LM head over a 16,384-token draft vocabulary);
- ``draft3``: a three-layer draft model of the built-in draft's shape.

Speed does not depend on the weights' values, acceptance does: the tokens/s here are the
worst case (acceptance length 1), and a drafter's tokens/s on real weights is about its
acceptance length over the step time below (``draft_acceptance.py`` measures both on the
default model). Prompts are token ids (150-300), ``--max-tokens`` new tokens each, k fixed;
at batch 1 the prompts run one after another, at batch B all B at once. The methods take
turns round by round. The step time counts prefill steps too (time x batch / tokens).

    python benchmarks/draft_step_cost.py [--batch 1,64] [--rounds 3] [--k 4] [--json out.json]
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

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "tests"))

from tiny_models import make_tokenizer  # noqa: E402

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB, DRAFT_VOCAB = 576, 1536, 9, 3, 64, 49152, 16384


def llama_dir(path: Path, layers: int, intermediate: int) -> str:
    """A llama checkpoint of the default model's shape with ``layers`` random layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         head_dim=HEAD_DIM, max_position_embeddings=8192, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, rope_theta=100000.0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(layers)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    make_tokenizer(2000).save_pretrained(path)
    return str(path)


def _random(generator: torch.Generator, shapes: dict) -> dict:
    return {name: torch.randn(*shape, generator=generator) * 0.03 for name, shape in shapes.items()}


def eagle1_dir(path: Path, target: str) -> str:
    """A one-layer head as the EAGLE repository saves EAGLE-1/2 heads (``fc`` with bias,
    ``layers.0.*``, no input norm in layer 0, no final norm, a copy of the embeddings)."""
    from safetensors.torch import load_file

    path.mkdir()
    config = json.loads((Path(target) / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    g = torch.Generator().manual_seed(1)
    state = _random(g, {"fc.weight": (HIDDEN, 2 * HIDDEN), "layers.0.self_attn.q_proj.weight": (q, HIDDEN),
                        "layers.0.self_attn.k_proj.weight": (kv, HIDDEN), "layers.0.self_attn.v_proj.weight": (kv, HIDDEN),
                        "layers.0.self_attn.o_proj.weight": (HIDDEN, q), "layers.0.mlp.gate_proj.weight": (INTER, HIDDEN),
                        "layers.0.mlp.up_proj.weight": (INTER, HIDDEN), "layers.0.mlp.down_proj.weight": (HIDDEN, INTER)})
    state.update({"fc.bias": torch.zeros(HIDDEN), "layers.0.post_attention_layernorm.weight": torch.ones(HIDDEN),
                  "embed_tokens.weight": load_file(Path(target) / "model.safetensors")["model.embed_tokens.weight"]})
    torch.save(state, path / "pytorch_model.bin")
    return str(path)


def eagle3_dir(path: Path, target: str) -> str:
    """A one-layer EAGLE-3 head in the published layout (``LlamaForCausalLMEagle3``)."""
    path.mkdir()
    config = json.loads((Path(target) / "config.json").read_text())
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
            "vocab_size", "max_position_embeddings", "hidden_act", "bos_token_id", "eos_token_id", "head_dim")
    config = {k: config[k] for k in keep}
    config.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                  tie_word_embeddings=False, draft_vocab_size=DRAFT_VOCAB, target_hidden_size=HIDDEN,
                  rope_theta=100000.0, torch_dtype="bfloat16")
    (path / "config.json").write_text(json.dumps(config))
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    g = torch.Generator().manual_seed(2)
    state = _random(g, {"midlayer.self_attn.q_proj.weight": (q, 2 * HIDDEN),
                        "midlayer.self_attn.k_proj.weight": (kv, 2 * HIDDEN),
                        "midlayer.self_attn.v_proj.weight": (kv, 2 * HIDDEN), "midlayer.self_attn.o_proj.weight": (HIDDEN, q),
                        "midlayer.mlp.gate_proj.weight": (INTER, HIDDEN), "midlayer.mlp.up_proj.weight": (INTER, HIDDEN),
                        "midlayer.mlp.down_proj.weight": (HIDDEN, INTER), "fc.weight": (HIDDEN, 3 * HIDDEN),
                        "lm_head.weight": (DRAFT_VOCAB, HIDDEN)})
    for name in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        state[f"{name}.weight"] = torch.ones(HIDDEN)
    used = torch.sort(torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB]).values
    state["d2t"] = used - torch.arange(DRAFT_VOCAB)
    state["t2d"] = torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, used, True)
    torch.save(state, path / "pytorch_model.bin")
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,64", help="comma-separated batch sizes")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--methods", default="off,eagle1,eagle3,draft3")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from specserve import LLM, SamplingParams

    work = Path(tempfile.mkdtemp(prefix="draft_step_cost_"))
    target = llama_dir(work / "target", 30, INTER)
    drafts = {"off": {}, "eagle1": {"draft_model": eagle1_dir(work / "eagle1", target)},
              "eagle3": {"draft_model": eagle3_dir(work / "eagle3", target)},
              "draft3": {"draft_model": llama_dir(work / "draft3", 3, 1024)}}
    methods = args.methods.split(",")
    engines = {}
    for method in methods:
        began = time.perf_counter()
        spec = {"speculative_method": "draft_model", **drafts[method]} if drafts[method] else {}
        engines[method] = LLM(target, device=args.device, dtype="bfloat16", num_speculative_tokens=args.k,
                              speculative_adaptive=False, max_num_seqs=64, max_model_len=4096,
                              num_kv_blocks=2048, **spec)
        print(f"{method}: ready in {time.perf_counter() - began:.1f} s"
              f"{'; ' + engines[method].engine.speculator.describe() if spec else ''}", flush=True)
    device = engines[methods[0]].engine.device
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    g = torch.Generator().manual_seed(5)
    batches = [int(b) for b in args.batch.split(",")]
    prompts = [torch.randint(100, 40000, (int(n),), generator=g).tolist()
               for n in torch.randint(150, 301, (max(batches),), generator=g)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for llm in engines.values():  # warm-up
        llm.generate(prompts[0][:50], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    times = {(m, b): [] for m in methods for b in batches}
    for _ in range(args.rounds):
        for batch in batches:
            chunks = [[p] for p in prompts[:6]] if batch == 1 else [prompts[:batch]]
            for method, llm in engines.items():
                sync()
                began = time.perf_counter()
                tokens = sum(len(o.token_ids) for chunk in chunks for o in llm.generate(chunk, params, use_tqdm=False))
                sync()
                times[method, batch].append((time.perf_counter() - began, tokens))

    rows = []
    for batch in batches:
        base = None
        for method in methods:
            runs = times[method, batch]
            tok_s = statistics.median(t / s for s, t in runs)
            step_ms = statistics.median(s * batch / t for s, t in runs) * 1e3
            base = base or tok_s
            rows.append({"batch": batch, "method": method, "tokens_per_s": round(tok_s, 1),
                         "step_ms": round(step_ms, 3), "vs_off": round(tok_s / base, 3)})
    print(f"\n{card} (torch {torch.__version__}); random weights of the default model's shapes, bf16, "
          f"k = {args.k} fixed, every draft rejected; median of {args.rounds} rounds\n")
    print("| batch | method | step, ms | tokens/s | vs off |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['batch']} | {r['method']} | {r['step_ms']:.2f} | {r['tokens_per_s']:.1f} | {r['vs_off']:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps({"card": card, "torch": torch.__version__, "k": args.k,
                                               "max_tokens": args.max_tokens, "date": time.strftime("%Y-%m-%d"),
                                               "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
