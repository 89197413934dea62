"""Line timings of an engine step's Python on the CPU (line_profiler): the default model
from its Q4_1 file, speculation off, batch 1, greedy, 3 held-out chat prompts of up to
128 new tokens, after a warm-up. Output: ``lp_host.log``.

    pip install line_profiler && python lp_host.py
"""
from line_profiler import LineProfiler

import specserve.engine as engine_module
import specserve.model_runner as runner_module
import specserve.sampler as sampler_module
import specserve.spec.rejection_sampler as rejection_module
from specserve import LLM, SamplingParams
from specserve.bench.prompt_sets import chat_prompts, held_out_prompts

llm = LLM(kv_cache_memory_gib=0.25, max_num_seqs=4)
texts = chat_prompts(llm.engine.tokenizer, held_out_prompts("chat", 3))
params = SamplingParams(temperature=0, max_tokens=128)
llm.generate(texts[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
profiler = LineProfiler()
for function in (engine_module.LLMEngine.step, engine_module.LLMEngine._verify, runner_module.ModelRunner.prepare,
                 runner_module.ModelRunner.execute, runner_module.ModelRunner._forward,
                 rejection_module.RejectionSampler.sample, sampler_module.greedy_tokens):
    profiler.add_function(function)
profiler.enable_by_count()
tokens = sum(len(llm.generate([text], params, use_tqdm=False)[0].token_ids) for text in texts)
profiler.disable_by_count()
print("tokens", tokens)
profiler.print_stats(output_unit=1e-6, stripzeros=True)
