"""Speculation off, the default and fixed k = 1 in one process, ROUNDS bursts of 24 WORKLOAD
prompts queued at once each, taking turns; every step of the default recorded (requests,
kept drafts, tokens, time, the plan's prices, the goodput check) into trace_WORKLOAD.json.
From the repository root: PYTHONPATH=$PWD python trace.py ROUNDS WORKLOAD
"""
import json
import statistics
import sys
import time as _t

from specserve import LLMEngine
from specserve import engine as _E
from specserve.bench.offline import load_workload, prompt_ids, run_offline, warm_up
from specserve.spec import speculator as S

LOG = []
orig = S.Speculator._learn_cost
def _learn_cost(self, choice, drafts, emitted, elapsed):
    ch = choice or self.controller.last
    chk = ch.check
    sc = drafts.scheduled.scheduled if drafts.scheduled else []
    rec = {'el': elapsed, 'bl': drafts.backlog_s, 'ds': drafts.draft_s, 'dr': drafts.drafted, 'n': len(sc),
           'ks': [len(p.draft_token_ids) for p in sc], 'em': emitted, 'planned': ch.planned, 'checked': ch.checked,
           'drafted': ch.drafted, 'veto': None if chk is None else chk.vetoed,
           'ratio': None if chk is None else round(chk.ratio, 3), 'z': None if chk is None else round(chk.z, 2)}
    st = getattr(drafts, '_stop', None)
    if st is not None:
        p = st.rule.prices
        rec.update(ctx=sum(p.start_pos for p in sc), pg=st.gain, pt=st.time, fixed=p.fixed, tok=p.token, span=p.span, dp=p.draft_pass, dt=p.draft_token, plain=p.plain, passes=st.passes)
    out = orig(self, choice, drafts, emitted, elapsed)
    LOG.append(rec)
    return out
S.Speculator._learn_cost = _learn_cost
from specserve.spec import stopping as ST

CUR = {}
_begin = ST.StopRule.begin
def begin(self, rows):
    d = _begin(self, rows); CUR['stop'] = d; return d
ST.StopRule.begin = begin
_prop = S.Speculator.propose
def propose(self, scheduled, scheduler):
    CUR['stop'] = None
    d = _prop(self, scheduled, scheduler)
    d._stop = CUR['stop']
    return d
S.Speculator.propose = propose
STEPS = {}
_ostep = _E.LLMEngine.step
def _step(self):
    n = len(self.scheduler.running); t = _t.perf_counter(); out = _ostep(self)
    STEPS.setdefault(id(self), []).append((n, _t.perf_counter() - t)); return out
_E.LLMEngine.step = _step
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
workload = sys.argv[2] if len(sys.argv) > 2 else "chat"
engines = {"off": LLMEngine(speculative_method="none"),
           "ad": LLMEngine(speculative_method="draft_model"),
           "k1": LLMEngine(speculative_method="draft_model", num_speculative_tokens=1, speculative_adaptive=False),
}
reqs = load_workload(workload, 24, output_len=128, tokenizer=engines["off"].tokenizer)
ids = prompt_ids(engines["off"], reqs)
for e in engines.values():
    warm_up(e, reqs, ids, num_requests=4)
allsteps = []
for r in range(rounds):
    res = {}
    order = list(engines) if r % 2 == 0 else list(engines)[::-1]
    for name in order:
        e = engines[name]
        LOG.clear(); STEPS.clear()
        run = run_offline(e, reqs, token_ids=ids, progress=False, label=name)
        res[name] = run['output_throughput']
        import collections
        by = collections.defaultdict(list)
        for n, el in STEPS[id(e)]:
            by[n].append(el)
        print(f"  {name} engine steps by running:", " ".join(f"{n}:{statistics.median(v)*1e3:.1f}/{len(v)}" for n, v in sorted(by.items(), reverse=True) if n >= 12), flush=True)
        if name == "ad":
            allsteps.append(list(LOG))
        if name == "k1":
            k1steps = list(LOG)
    print(f"round {r}: " + " ".join(f"{k} {v:.1f}" for k, v in res.items()) +
          f"  ad/off {res['ad']/res['off']:.3f} k1/off {res['k1']/res['off']:.3f}", flush=True)
    steps = allsteps[-1]
    for nm, st in (("ad", steps), ("k1", k1steps)):
        tot = sum(x['el'] for x in st)
        dr = [x for x in st if x['dr']]
        pl = [x for x in st if not x['dr']]
        print(f"  {nm}: steps {len(st)} total {tot:.2f}s drafted {len(dr)} ({sum(x['el'] for x in dr):.2f}s, em {sum(x['em'] for x in dr)}, draft_s {sum(x['ds'] for x in dr):.2f}) "
              f"plain {len(pl)} ({sum(x['el'] for x in pl):.2f}s, em {sum(x['em'] for x in pl)}) backlog {sum(x['bl'] for x in st):.2f}s", flush=True)
with open(f"trace_{workload}.json", "w") as out:  # every default step of every round
    json.dump(allsteps, out)
