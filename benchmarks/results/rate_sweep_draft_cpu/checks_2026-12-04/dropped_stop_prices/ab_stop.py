"""The stopping rule's prices at 24 chat requests, A/B in one process: speculation off, the
default as committed ("a") and the default with the two changes of ``stopping.patch``
("b": the step's base time from the measured step without drafts; a further pass priced
as the rows it runs), each its own engine, taking turns over ROUNDS bursts of 24 prompts
queued at once. Variant b's methods are swapped in for its runs only.

    PYTHONPATH=<repo root> [B=pass] python ab_stop.py ROUNDS

``B=pass``: variant b is the pass pricing alone (the base time as committed).
"""
import os
import statistics
import sys

from specserve import LLMEngine
from specserve.bench.offline import load_workload, prompt_ids, run_offline, warm_up
from specserve.spec import stopping as S

A_INIT, A_NEXT = S.DraftStop.__init__, S.DraftStop._next_pass


def b_init(self, rule, rows):
    A_INIT(self, rule, rows)
    base = rule.prices.plain or rule.prices.fixed
    self.time = max(base, 1e-9) + rule.prices.draft_pass + rule.prices.draft_token * len(rows)


def b_next_pass(self, depth, keep, acceptance, pad):
    prices = self.rule.prices
    ratio = self.gain / self.time
    pinned = [r for r in keep if not self.free[r] and self.caps[r] > depth + 1]
    candidates = [r for r in keep if self.free[r] and self.caps[r] > depth + 1]
    each = prices.token + prices.draft_token
    going = [r for r in candidates if self.chance[r] * acceptance[r] >= ratio * each]
    if going:
        pinned_rows = max(pinned) + 1 if pinned else 0
        pass_s = prices.draft_token * max(max(going) + 1 - pinned_rows, 0)
        if not pinned:
            pass_s += prices.draft_pass + pad
        if sum(self.chance[r] * acceptance[r] for r in going) < ratio * (prices.token * len(going) + pass_s):
            going = []
    for r in set(candidates) - set(going):
        self.going[r] = False
    for r in keep:
        if self.caps[r] <= depth + 1:
            self.going[r] = False
    running = pinned + going
    if not running:
        return 0
    n = max(running) + 1
    self.passes += 1
    self.time += prices.draft_pass + prices.draft_token * n
    return n


def use(variant):
    if variant == "a":
        S.DraftStop.__init__, S.DraftStop._next_pass = A_INIT, A_NEXT
    else:
        S.DraftStop.__init__ = A_INIT if os.environ.get("B") == "pass" else b_init
        S.DraftStop._next_pass = b_next_pass


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
