"""Run 1's generation cut, reconstructed: before 2026-12-06 every greedy job was generated in
order of prompt length, and run 1 answered 8,192 of its 10,327 prompts, 803 + val + test of
them code. All chat prompts (the self-written ones included) are shorter than the code
prompts kept, so the code prompts answered were the shortest: this prints where the cut
fell and which validation and held-out code prompts it kept: the 816 shortest code jobs,
803 training answers (the log's count) + 13 validation and held-out ones (8,192 answers less
8,131 training ones: 61 of the 96 validation and held-out prompts, all 48 chat ones among
them). Ties at the cut's length make the split between them uncertain by one."""
import types

from specserve.loader import load_tokenizer, resolve_model
from specserve.training.data import select_prompts

tokenizer = load_tokenizer(resolve_model(None))
args = types.SimpleNamespace(seed=0, num_prompts=None, num_val_prompts=64, max_seq_len=1024, eval_prompts=16)
chosen = select_prompts(args, tokenizer)
code = sorted((len(ids), split) for split in ("train", "val", "test") for kind, _, ids in chosen[split]
              if kind == "code")
kept = code[:816]
print(f"{len(code)} code prompts; the 816 shortest end at {kept[-1][0]} tokens")
print("validation code prompts kept:", sum(split == "val" for _, split in kept), "of",
      sum(split == "val" for _, split in code))
print("held-out code prompts kept:", [n for n, split in kept if split == "test"], "of",
      sum(split == "test" for _, split in code))
