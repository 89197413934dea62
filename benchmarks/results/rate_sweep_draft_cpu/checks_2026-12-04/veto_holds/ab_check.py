"""The goodput check at large batches, A/B in one process: speculation off, the default
with the check as committed at 8dbd748 ("a": before the veto stood against a draining
batch; read with ``git show``) and with the tree's ("b"), each its own engine, taking turns over
ROUNDS bursts of 24 chat prompts queued at once. Variant a's methods are swapped into
``GoodputCheck`` for its runs only.

    PYTHONPATH=<repo root> python ab_check.py ROUNDS
"""
import statistics
import subprocess
import sys
import types

from specserve import LLMEngine
from specserve.bench.offline import load_workload, prompt_ids, run_offline, warm_up
from specserve.spec import goodput as G

goodput_a = types.ModuleType("goodput_a")
OLD = subprocess.run(["git", "show", "8dbd748:specserve/spec/goodput.py"], check=True, capture_output=True,
                     text=True).stdout
exec(OLD, goodput_a.__dict__)  # noqa: S102 (the committed module, read from git)
METHODS = ("stale", "observe", "saw", "interval", "z", "ratio", "plain_step", "running", "inherit", "_compute_z")
B = {m: G.GoodputCheck.__dict__[m] for m in METHODS}
A = {m: goodput_a.GoodputCheck.__dict__[m] for m in METHODS}


def use(variant):
    for m, f in (A if variant == "a" else B).items():
        setattr(G.GoodputCheck, m, f)


rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 6
engines = {"off": LLMEngine(speculative_method="none"), "a": LLMEngine(speculative_method="draft_model"),
           "b": LLMEngine(speculative_method="draft_model")}
reqs = load_workload("chat", 24, output_len=128, tokenizer=engines["off"].tokenizer)
ids = prompt_ids(engines["off"], reqs)
for name, engine in engines.items():
    use(name)
    warm_up(engine, reqs, ids, num_requests=4)
ratios = {"a": [], "b": []}
orders = [("off", "a", "b"), ("b", "off", "a"), ("a", "b", "off")]
for r in range(rounds):
    tps = {}
    for name in orders[r % 3]:
        use(name)
        tps[name] = run_offline(engines[name], reqs, token_ids=ids, progress=False, label=name)["output_throughput"]
    for v in "ab":
        ratios[v].append(tps[v] / tps["off"])
    print(f"round {r}: off {tps['off']:.1f}  a {tps['a']:.1f} ({ratios['a'][-1]:.3f}x)  "
          f"b {tps['b']:.1f} ({ratios['b'][-1]:.3f}x)", flush=True)
for v in "ab":
    print(f"{v}: burst 0 {ratios[v][0]:.3f}x, later bursts median {statistics.median(ratios[v][1:]):.3f}x "
          f"mean {statistics.mean(ratios[v][1:]):.3f}x")
