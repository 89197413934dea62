"""Real acceptance traces for the plan simulation (``benchmarks/plan_simulation.py
--traces``): for held-out chat and code prompts, the default model's greedy output and, at
every generated position, whether the built-in draft's greedy token there equals it.

Where a draft's tokens match, its context is the true prefix, so one teacher-forced pass
of the draft over the prompt and the output gives every position's match at once: k
drafts from position t keep the run of matches from t (at most k). Both models run in
transformers, in float32: the target from the default model's checkpoint, the draft
from ``drafts/smollm2_draft`` (its layers, the target's embeddings and LM head, argmax
over its own vocabulary, as the engine drafts).

    python benchmarks/acceptance_traces.py --prompts 16 --json traces.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

DRAFT = Path(__file__).resolve().parents[1] / "drafts" / "smollm2_draft"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16, help="prompts per workload (chat, code)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()

    # lazy: torch and transformers only where the traces are made
    import torch
    from safetensors.torch import load_file
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
    )

    from specserve.bench.prompt_sets import chat_prompts, held_out_prompts
    from specserve.loader import resolve_model

    torch.manual_seed(0)
    path = resolve_model(None).path
    tokenizer = AutoTokenizer.from_pretrained(path)
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    draft = LlamaForCausalLM(LlamaConfig.from_pretrained(DRAFT)).eval()
    state = {name: tensor.float() for name, tensor in load_file(DRAFT / "model.safetensors").items()}
    missing, unexpected = draft.load_state_dict(state, strict=False)
    if unexpected or set(missing) != {"model.embed_tokens.weight", "lm_head.weight"}:
        raise SystemExit(f"the draft checkpoint is not the layers-only layout: missing {missing}, "
                         f"unexpected {unexpected}")
    draft.model.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight.data)
    draft.lm_head.weight = draft.model.embed_tokens.weight
    vocab = torch.tensor(json.loads((DRAFT / "draft_vocab.json").read_text()))

    traces, rates = {}, {}
    for kind in ("chat", "code"):
        traces[kind] = []
        for prompt in chat_prompts(tokenizer, held_out_prompts(kind, args.prompts)):
            ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
            with torch.no_grad():
                out = target.generate(ids, max_new_tokens=args.max_tokens, do_sample=False)
                logits = draft(out).logits[0]
            guess = vocab[logits[:, vocab].argmax(-1)]
            start = ids.shape[1]
            traces[kind].append((guess[start - 1:-1] == out[0, start:]).tolist())
        matched = sum(map(sum, traces[kind]))
        rates[kind] = round(matched / sum(map(len, traces[kind])), 3)
        print(f"{kind}: {len(traces[kind])} outputs, {sum(map(len, traces[kind]))} tokens, "
              f"the draft's token matched at {rates[kind]:.3f} of positions", flush=True)
    Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "args": vars(args),
                                           "match_rate": rates, "traces": traces}))


if __name__ == "__main__":
    main()
