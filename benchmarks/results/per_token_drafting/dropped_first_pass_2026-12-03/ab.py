"""A/B in one process: the adaptive default (new) against HEAD's behaviour (old: no first-pass
decision, the cost model taught by planned steps only) and 'fit' (every step teaches the cost
model, no first-pass decision), beside off and fixed k. Settings take turns prompt by prompt."""
import os
import sys
import types

sys.path.insert(0, os.environ.get("REPO", "/work/main") + "/benchmarks")
from workloads import drafter_settings, run_cold

import specserve.spec.controller as ctl
from specserve import LLM, SamplingParams
from specserve.bench.prompt_sets import chat_prompts, held_out_prompts

n = int(sys.argv[1]); kinds = sys.argv[2].split(",") if len(sys.argv) > 2 else ["chat", "code"]
fixed = [int(x) for x in (sys.argv[3].split(",") if len(sys.argv) > 3 else ["1", "2"])]
common = {"max_num_seqs": 8, "max_model_len": 4096, "device": "cpu"}
dr = drafter_settings("draft_model")
variants = {"new": (False, False), "fit": (True, False), "old": (True, True)}  # (no DP, planned-only fit)
engines = {"off": LLM(speculative_method="none", **common),
           "fixed": LLM(num_speculative_tokens=6, speculative_adaptive=False, **dr, **common)}
real = ctl.drafting_pays
def old_learn_cost(self, choice, drafts, emitted, elapsed):  # HEAD: only planned steps teach the cost model
    choice = choice or self.controller.last
    self.controller.observe_goodput(emitted, elapsed - drafts.backlog_s, choice)
    if choice.planned:
        self.controller.observe_step(self._step_sample(drafts, elapsed), choice)
for name, (no_dp, planned_fit) in variants.items():
    llm = engines[name] = LLM(num_speculative_tokens=4, draft_stopping="confidence", **dr, **common)
    e = llm.engine
    if no_dp:
        def patched(step=e.step):
            ctl.drafting_pays = lambda *a, **k: True
            try: return step()
            finally: ctl.drafting_pays = real
        e.step = patched
    if planned_fit:
        e.speculator._learn_cost = types.MethodType(old_learn_cost, e.speculator)
settings = [("off", 0)] + [("fixed", k) for k in fixed] + [(v, None) for v in variants]
names = ["off"] + [f"k={k}" for k in fixed] + list(variants)
wl = {kind: chat_prompts(engines["off"].engine.tokenizer, held_out_prompts(kind, n)) for kind in kinds}
def run(i, p, mt):
    e, k = settings[i]
    d = run_cold(engines[e], p, SamplingParams(temperature=0, max_tokens=mt, num_speculative_tokens=k))
    return d.seconds, len(d.token_ids), d.steps, d.token_ids
for i in range(len(settings)):
    for ps in wl.values(): run(i, ps[0], 16)
for kind, ps in wl.items():
    acc = {nm: [0.0, 0, {}] for nm in names}; ids = {nm: [] for nm in names}
    for j, p in enumerate(ps):
        order = list(range(len(settings)))
        order = order[j % len(order):] + order[:j % len(order)]
        for i in order:
            s, t, steps, tid = run(i, p, 128)
            a = acc[names[i]]; a[0] += s; a[1] += t
            for kk, c in steps.items(): a[2][kk] = a[2].get(kk, 0) + c
            ids[names[i]].append(tid)
    rate = {nm: a[1] / a[0] for nm, a in acc.items()}
    best = max((nm for nm in names if nm.startswith("k=")), key=rate.get)
    for nm in names:
        st = acc[nm][2]; tot = sum(st.values())
        mk = sum(k * c for k, c in st.items()) / tot if tot else 0
        same = sum(x == y for x, y in zip(ids[nm], ids["off"]))
        print(f"| {kind} | {nm} | {rate[nm]:.1f} | {rate[nm]/rate['off']:.3f} | {rate[nm]/rate[best]:.3f} ({best}) | {mk:.2f} | {same}/{len(ps)} |", flush=True)
print("first drafts (greedy):", engines["new"].engine.speculator.controller.calibration.describe()["greedy"]["first_drafts"])
