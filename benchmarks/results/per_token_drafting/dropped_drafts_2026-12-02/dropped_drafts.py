"""The CPU default on held-out prompts (``python dropped_drafts.py chat 8`` from the repository
root): its depth-0 drafts, kept or dropped, and the rule's threshold with and without the spent
first pass; how often the target accepted the kept ones and would have accepted the dropped
ones (its next token equal to the draft); the greedy map's depth-0 and depth-1 rows."""
import collections
import statistics
import sys
import time

from specserve import LLM, SamplingParams
from specserve.bench.prompt_sets import chat_prompts, held_out_prompts
from specserve.spec import calibration, stopping

kind, n = sys.argv[1], int(sys.argv[2])
judged = {}  # confidence -> (P, old threshold, new threshold, kept)
orig_after = stopping.DraftStop.after
def after(self, depth, confidence):
    if depth == 0:
        rule, prices = self.rule, self.rule.prices
        first = prices.draft_pass + prices.draft_token * len(self.caps)
        c = prices.token + prices.span
        new_thr = self.gain / self.time * c
        old_thr = self.gain / (self.time - first) * c
        P = rule.calibration.predict(self.greedy[0], 0, [confidence[0]]).tolist()[0]
        r = orig_after(self, depth, confidence)
        judged[confidence[0]] = (P, old_thr, new_thr, self.kept[0] > 0, prices)
        return r
    return orig_after(self, depth, confidence)
stopping.DraftStop.after = after
outcomes = collections.defaultdict(list)  # class -> accepted flags
orig_obs = calibration.ConfidenceCalibration.observe
def observe(self, greedy, depth, confidence, accepted):
    for d, c, a in zip(depth, confidence, accepted):
        if d == 0 and c in judged and judged[c][3]:  # kept, verified
            P, old_thr, new_thr, kept, _ = judged[c]
            outcomes["newly kept" if P < old_thr else "kept by both"].append((a, P))
    return orig_obs(self, greedy, depth, confidence, accepted)
calibration.ConfidenceCalibration.observe = observe

from specserve.drafts import model_drafter

from specserve.spec import speculator as spec_mod

captured, dropped_out = {}, []
Drafter = [c for c in vars(model_drafter).values() if isinstance(c, type) and hasattr(c, "_proposal")][0]
orig_prop = Drafter._proposal
def _proposal(self, scheduled, order, columns, q_columns, session, confidence, n):
    out = orig_prop(self, scheduled, order, columns, q_columns, session, confidence, n)
    if session is not None:
        first = columns[0].tolist()
        for r, i in enumerate(order):
            if scheduled[i].num_lookahead:
                captured[scheduled[i].req_id] = (first[r], session.kept[r], session.confidence[r][:1])
    return out
Drafter._proposal = _proposal
orig_record = spec_mod.Speculator.record
def record(self, drafts, updates):
    for u in updates:
        got = captured.pop(u.req.req_id, None)
        if got is not None and got[1] == 0 and u.new_token_ids:
            dropped_out.append(u.new_token_ids[0] == got[0])
    return orig_record(self, drafts, updates)
spec_mod.Speculator.record = record
llm = LLM(speculative_method="draft_model")
prompts = chat_prompts(llm.engine.tokenizer, held_out_prompts(kind, n))
p = SamplingParams(temperature=0, max_tokens=128)
llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
judged.clear(); outcomes.clear(); dropped_out.clear()
t, toks, steps0 = 0.0, 0, None
for pr in prompts:
    llm.engine.kv.reset_prefix_cache()
    t0 = time.perf_counter(); o = llm.generate([pr], p, use_tqdm=False)[0]; t += time.perf_counter() - t0; toks += len(o.token_ids)
vals = list(judged.values())
print(f"{kind}: {toks} tokens in {t:.2f} s = {toks / t:.1f} tok/s; depth-0 judgments {len(vals)}, kept {sum(v[3] for v in vals)}")
dropped = [v for v in vals if not v[3]]
print("dropped by the new rule:", len(dropped), "kept though below the old threshold:", sum(1 for v in vals if v[3] and v[0] < v[1]))
pr = vals[-1][4]
print("last prices (ms):", {f: round(getattr(pr, f) * 1e3, 3) for f in ("fixed", "token", "span", "draft_pass", "draft_token")})
print("median thresholds old/new:", round(statistics.median(v[1] for v in vals), 3), round(statistics.median(v[2] for v in vals), 3))
for cls, xs in outcomes.items():
    print(f"{cls}: {len(xs)} verified, accepted {sum(a for a, _ in xs)} ({sum(a for a, _ in xs) / len(xs):.2f}), mean predicted {statistics.mean(P for _, P in xs):.2f}")
print(f"dropped at depth 0: {len(dropped_out)}, the target's token equalled the draft in {sum(dropped_out)} ({sum(dropped_out) / max(len(dropped_out), 1):.2f})")
c = llm.engine.speculator.controller.calibration
d = c.describe()
print("greedy depth-0 map:", [round(x, 2) for x in d["greedy"]["acceptance"][0]])
print("greedy depth-0 obs:", [round(x) for x in d["greedy"]["observations"][0]])
print("greedy depth-1 map:", [round(x, 2) for x in d["greedy"]["acceptance"][1]])
print("greedy depth-1 obs:", [round(x) for x in d["greedy"]["observations"][1]])
