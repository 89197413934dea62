"""24 prompts queued at once: speculation off and the default, with quantized layers on AMX
tiles from 16 rows and from 12, all four engines in one process taking turns."""
import statistics
import sys

import specserve.models.quantized as Q
from specserve import LLMEngine
from specserve.bench.offline import load_workload, prompt_ids, run_offline, warm_up

rounds = int(sys.argv[1]); workload = sys.argv[2]
engines = {}
for tr in (16, 12):
    Q.TILE_ROWS = tr
    engines[f"off{tr}"] = LLMEngine(speculative_method="none")
    engines[f"ad{tr}"] = LLMEngine(speculative_method="draft_model")
reqs = load_workload(workload, 24, output_len=128, tokenizer=engines["off16"].tokenizer)
ids = prompt_ids(engines["off16"], reqs)
for e in engines.values():
    warm_up(e, reqs, ids, num_requests=4)
res = {k: [] for k in engines}
for r in range(rounds):
    order = list(engines) if r % 2 == 0 else list(engines)[::-1]
    for name in order:
        res[name].append(run_offline(engines[name], reqs, token_ids=ids, progress=False, label=name)["output_throughput"])
    print(f"round {r}: " + " ".join(f"{k} {v[-1]:.1f}" for k, v in res.items()) +
          f" | ad16/off16 {res['ad16'][-1]/res['off16'][-1]:.3f} ad12/off12 {res['ad12'][-1]/res['off12'][-1]:.3f}"
          f" off12/off16 {res['off12'][-1]/res['off16'][-1]:.3f} ad12/off16 {res['ad12'][-1]/res['off16'][-1]:.3f}", flush=True)
med = {k: statistics.median(v) for k, v in res.items()}
print("median tok/s:", {k: round(v, 1) for k, v in med.items()})
