"""Speculation off, the default, fixed k = 1 and a "lockstep" default in one process,
ROUNDS bursts of 24 WORKLOAD prompts queued at once each, taking turns. Prints each
engine's steps by how many requests were running (steps, seconds, emitted tokens per ms),
and records every step of the default (requests, kept drafts, tokens, time, the plan's
prices, the goodput check) into TRACE_OUT (default trace_WORKLOAD.json).

The lockstep engine (a dropped experiment): once no request waits, a request more than
LK_MARGIN tokens ahead of the one with the most left to generate may draft at most LK_CAP
tokens. NO_LK=1 leaves it out.

From the repository root: PYTHONPATH=$PWD python trace.py ROUNDS WORKLOAD
"""
import json
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
        rec.update(o=p.draft_fixed, g=getattr(p, 'draft_request', 0.0), ctx=sum(p.start_pos for p in sc), pg=st.gain, pt=st.time, fixed=p.fixed, tok=p.token, span=p.span, dp=p.draft_pass, dt=p.draft_token, plain=p.plain, passes=len(st.pass_rows) if hasattr(st, 'pass_rows') else st.passes)
    out = orig(self, choice, drafts, emitted, elapsed)
    LOG.append(rec)
    return out
S.Speculator._learn_cost = _learn_cost
from specserve.spec import stopping as ST

CUR = {}
_begin = ST.StopRule.begin
def begin(self, *a):
    d = _begin(self, *a); CUR['stop'] = d; return d
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
    run = list(self.scheduler.running); n = len(run); before = sum(r.num_output_tokens for r in run)
    t = _t.perf_counter(); out = _ostep(self); el = _t.perf_counter() - t
    STEPS.setdefault(id(self), []).append((n, el, sum(r.num_output_tokens for r in run) - before)); return out
_E.LLMEngine.step = _step
_ochoose = S.Speculator._choose
MARGIN = int(__import__('os').environ.get('LK_MARGIN', '2'))
LK_CAP = int(__import__("os").environ.get("LK_CAP", "1"))
def _choose(self, scheduler):
    if getattr(self, 'lockstep', False) and not scheduler.waiting:
        decoding = self._decoding
        free = decoding.free
        rem = {r.req_id: r.params.max_tokens - r.num_output_tokens for r in scheduler.running}
        top = max(rem.values(), default=0)
        saved = dict(free)
        for r in list(free):
            if rem.get(r, top) < top - MARGIN:
                free[r] = min(free[r], LK_CAP)
        try:
            return _ochoose(self, scheduler)
        finally:
            free.update(saved)
    return _ochoose(self, scheduler)
S.Speculator._choose = _choose
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
workload = sys.argv[2] if len(sys.argv) > 2 else "chat"
engines = {"off": LLMEngine(speculative_method="none"),
           "ad": LLMEngine(speculative_method="draft_model"),
           "k1": LLMEngine(speculative_method="draft_model", num_speculative_tokens=1, speculative_adaptive=False),
           "lk": LLMEngine(speculative_method="draft_model"),
}
engines["lk"].speculator.lockstep = True
if __import__('os').environ.get('NO_LK'):
    del engines["lk"]
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
        by = collections.defaultdict(lambda: [0, 0.0, 0])
        for n, el, em in STEPS[id(e)]:
            g = '24' if n >= 22 else '16-21' if n >= 16 else '8-15' if n >= 8 else '1-7'
            by[g][0] += 1; by[g][1] += el; by[g][2] += em
        print(f"  {name} by batch (steps, s, tok/ms):", "  ".join(f"{g}: {v[0]} {v[1]:.2f} {v[2]/v[1]/1e3:.3f}" for g, v in by.items()), flush=True)
        if name == "ad":
            allsteps.append(list(LOG))
        if name == "k1":
            k1steps = list(LOG)
    print(f"round {r}: " + " ".join(f"{k} {v:.1f}" for k, v in res.items()) +
          f"  ad/off {res['ad']/res['off']:.3f} k1/off {res['k1']/res['off']:.3f}" + (f" lk/off {res['lk']/res['off']:.3f}" if 'lk' in res else ""), flush=True)
    steps = allsteps[-1]
    for nm, st in (("ad", steps), ("k1", k1steps)):
        tot = sum(x['el'] for x in st)
        dr = [x for x in st if x['dr']]
        pl = [x for x in st if not x['dr']]
        print(f"  {nm}: steps {len(st)} total {tot:.2f}s drafted {len(dr)} ({sum(x['el'] for x in dr):.2f}s, em {sum(x['em'] for x in dr)}, draft_s {sum(x['ds'] for x in dr):.2f}) "
              f"plain {len(pl)} ({sum(x['el'] for x in pl):.2f}s, em {sum(x['em'] for x in pl)}) backlog {sum(x['bl'] for x in st):.2f}s", flush=True)
with open(__import__("os").environ.get("TRACE_OUT", f"trace_{workload}.json"), "w") as out:  # every default step of every round
    json.dump(allsteps, out)
