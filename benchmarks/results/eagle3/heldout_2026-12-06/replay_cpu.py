"""An EAGLE-3 head's acceptance on held-out code prompts two ways, in float32 on the CPU:
in the engine (k = 4 fixed, batch 1, the target's weights dequantised) and replayed under
teacher forcing by the training code (``eagle_head.head_losses``, ``chain_acceptance``)
on the same greedy answers. Per prompt: its length, the two acceptance lengths, and how
repetitive the answer is (distinct 8-grams over all).

    python replay_cpu.py HEAD_DIR [--prompts 16] [--max-tokens 256]
"""
from __future__ import annotations

import argparse
import copy

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from specserve import LLM, SamplingParams
from specserve.bench.prompt_sets import held_out_prompts
from specserve.loader import load_tokenizer, resolve_model
from specserve.training.data import Example, collate, encode_prompt
from specserve.training.eagle3_head import Eagle3Head, load_eagle3_weights
from specserve.training.eagle_head import head_losses
from specserve.training.validation import chain_acceptance


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("head")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()
    files = resolve_model(None)
    tokenizer = load_tokenizer(files)
    target = AutoModelForCausalLM.from_pretrained(files.path, dtype=torch.float32).eval()
    weights = f"{args.head}/model.safetensors"
    d2t = load_file(weights)["d2t"]
    vocab = d2t + torch.arange(len(d2t))
    layers = len(target.model.layers)
    head = Eagle3Head(target, copy.deepcopy(target.model.layers[layers - 1]), copy.deepcopy(target.model.norm),
                      (2, layers // 2, layers - 3), vocab)
    load_eagle3_weights(head, weights)
    head.eval()
    common = {"dtype": "float32", "gguf_weights": "dequantized", "max_num_seqs": 1, "max_model_len": 1280}
    plain = LLM(**common)
    eagle = LLM(speculative_method="draft_model", draft_model=args.head, num_speculative_tokens=4,
                speculative_adaptive=False, **common)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    totals = {"engine": [0, 0], "replay": [0, 0]}
    for message in held_out_prompts("code", args.prompts, 0):
        prompt = encode_prompt(tokenizer, message)
        answer = list(plain.generate([prompt], params, use_tqdm=False)[0].token_ids)
        out = eagle.generate([prompt], params, use_tqdm=False)[0]
        assert list(out.token_ids) == answer  # lossless
        ids, rows, cols = collate([Example(prompt + answer, len(prompt), "code", "test", False)],
                                  torch.device("cpu"), 0)
        with torch.no_grad():
            _, _, _, agree = head_losses(head, target, ids, rows, cols, 4, 0.0, vocab)
        steps, accepted = chain_acceptance(agree.tolist(), 4)
        totals["replay"][0] += steps
        totals["replay"][1] += accepted
        totals["engine"][0] += out.spec_stats.num_drafts
        totals["engine"][1] += out.spec_stats.num_accepted_tokens
        grams = [tuple(answer[i:i + 8]) for i in range(len(answer) - 8)]
        print(f"prompt {len(prompt):4d} tokens, answer {len(answer):3d}: engine "
              f"{1 + out.spec_stats.num_accepted_tokens / max(out.spec_stats.num_drafts, 1):.2f}, replay "
              f"{1 + accepted / steps:.2f}; distinct 8-grams {len(set(grams)) / max(len(grams), 1):.2f}", flush=True)
    # The engine counts acceptance per verify step, the replay per chain: both tokens a step.
    for name, (steps, accepted) in totals.items():
        print(f"mean {name}: {1 + accepted / steps:.3f}")


if __name__ == "__main__":
    main()
