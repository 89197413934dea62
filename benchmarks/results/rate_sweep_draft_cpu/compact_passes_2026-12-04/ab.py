"""Speculation off, three default engines and fixed k = 1 in one process, taking turns:
output tokens/s of each over off's per round. Needs switches.patch applied (the attributes
that turn each change off in one engine). PYTHONPATH=$PWD python ab.py ROUNDS WORKLOAD
"""
import statistics
import sys

from specserve import LLMEngine
from specserve.bench.offline import load_workload, prompt_ids, run_offline, warm_up

rounds = int(sys.argv[1]); workload = sys.argv[2]
engines = {"off": LLMEngine(speculative_method="none"), "new": LLMEngine(speculative_method="draft_model"),
           "compact": LLMEngine(speculative_method="draft_model"), "old": LLMEngine(speculative_method="draft_model"),
           "k1": LLMEngine(speculative_method="draft_model", num_speculative_tokens=1, speculative_adaptive=False)}
engines["compact"].speculator.controller.crossing = False
engines["old"].speculator.drafter.compact_passes = False
engines["old"].speculator.controller.crossing = False
reqs = load_workload(workload, 24, output_len=128, tokenizer=engines["off"].tokenizer)
ids = prompt_ids(engines["off"], reqs)
for e in engines.values():
    warm_up(e, reqs, ids, num_requests=4)
res = {k: [] for k in engines}
for r in range(rounds):
    order = list(engines) if r % 2 == 0 else list(engines)[::-1]
    for name in order:
        res[name].append(run_offline(engines[name], reqs, token_ids=ids, progress=False, label=name)["output_throughput"])
    print(f"round {r}: " + " ".join(f"{k} {v[-1]:.1f}" for k, v in res.items()) + " | " +
          " ".join(f"{k}/off {res[k][-1]/res['off'][-1]:.3f}" for k in engines if k != "off"), flush=True)
print("median ratio to off:", {k: round(statistics.median(a / b for a, b in zip(res[k], res['off'])), 3) for k in engines if k != "off"})
