"""Batch 1, 8 held-out chat prompts one after another (128 tokens, EOS ignored) after 4
others warmed the engine up, under cProfile: steps, a step's time, its target pass's, the
difference (host work around the pass) and the speculator's pieces, per step. ``MODE``:
off, k1 (n-gram at a fixed k = 1) or adaptive (n-gram, the CPU default: stopping by its
match).

    python batch1_profile.py MODE"""
import cProfile
import io
import pstats
import sys

from specserve import LLM, SamplingParams
from specserve.bench.prompt_sets import chat_prompts, held_out_prompts

mode = sys.argv[1]
settings = {"off": {}, "k1": {"speculative_method": "ngram", "speculative_adaptive": False,
                              "num_speculative_tokens": 1},
            "adaptive": {"speculative_method": "ngram"}}[mode]
llm = LLM(**settings)
prompts = chat_prompts(llm.tokenizer, held_out_prompts("chat", 16))
params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
for prompt in prompts[8:12]:
    llm.generate([prompt], params, use_tqdm=False)
profile = cProfile.Profile()
profile.enable()
for prompt in prompts[:8]:
    llm.generate([prompt], params, use_tqdm=False)
profile.disable()
stats = {f"{k[0].split('/')[-1]}:{k[2]}": v for k, v in pstats.Stats(profile, stream=io.StringIO()).stats.items()}
step, forward = stats["engine.py:step"], stats["model_runner.py:forward"]
n = step[0]
print(f"{mode}: {n} steps, {step[3] / n * 1e3:.3f} ms a step, its pass {forward[3] / n * 1e3:.3f} ms, "
      f"the rest {(step[3] - forward[3]) / n * 1e3:.3f} ms; total {step[3]:.2f} s")
for name in ("speculator.py:learn", "speculator.py:_choose", "speculator.py:propose", "ngram.py:propose",
             "stopping.py:after", "rejection_sampler.py:sample"):
    if name in stats:
        print(f"  {name}: {stats[name][3] / n * 1e3:.3f} ms a step (cumulative, {stats[name][0]} calls)")
