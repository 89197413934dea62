import time, sys
from line_profiler import LineProfiler
from specserve import LLM, SamplingParams
from specserve.bench.prompt_sets import chat_prompts, held_out_prompts
import specserve.engine as E, specserve.model_runner as MR, specserve.spec.rejection_sampler as RS, specserve.sampler as S
llm = LLM(kv_cache_memory_gib=0.25, max_num_seqs=4)
texts = chat_prompts(llm.engine.tokenizer, held_out_prompts("chat", 3))
params = SamplingParams(temperature=0, max_tokens=128)
llm.generate(texts[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
lp = LineProfiler()
fns = [E.LLMEngine.step, E.LLMEngine._verify, MR.ModelRunner.prepare, MR.ModelRunner.execute, MR.ModelRunner._forward, RS.RejectionSampler.sample, S.greedy_tokens]
for f in fns: lp.add_function(f)
lp.enable_by_count()
n=0
for tx in texts: n+=len(llm.generate([tx], params, use_tqdm=False)[0].token_ids)
lp.disable_by_count()
print("tokens", n)
lp.print_stats(output_unit=1e-6, stripzeros=True)
