"""Bursts after bursts: 24 chat prompts queued at once, ROUNDS times, speculation off and
the CPU default taking turns in one process. Per round, the two throughputs and every step
of the default that drafted or fed its lazy draft's backlog, with its kind's goodput check
as the step found it (veto, ratio, z; ``cx``: what the last check under a veto added to a
plain step, where the engine keeps it). Run from the root of the specserve tree to measure
(PYTHONPATH=$PWD):

    python bursts.py ROUNDS > OUT.log
"""
import statistics
import sys

from specserve import LLMEngine
from specserve.bench.offline import load_workload, prompt_ids, run_offline, warm_up
from specserve.spec import speculator as S

LOG = []
orig = S.Speculator._learn_cost
def _learn_cost(self, choice, drafts, emitted, elapsed):
    ch = choice or self.controller.last
    chk = ch.check
    rec = {'el': elapsed, 'bl': drafts.backlog_s, 'dr': drafts.drafted, 'n': len(drafts.scheduled.scheduled) if drafts.scheduled else 0,
               'nd': sum(len(p.draft_token_ids) for p in drafts.scheduled.scheduled) if drafts.scheduled else 0,
               'em': emitted, 'planned': ch.planned, 'checked': ch.checked, 'drafted': ch.drafted,
               'veto': None if chk is None else chk.vetoed, 'ratio': None if chk is None else round(chk.ratio, 3),
               'z': None if chk is None else round(chk.z, 2), 'cx': None if chk is None else getattr(chk, '_check_extra_s', None), 'since': None if chk is None else [round(x, 2) for x in chk._since], 'cid': id(chk) % 10000}
    out = orig(self, choice, drafts, emitted, elapsed)
    LOG.append(rec)
    return out
S.Speculator._learn_cost = _learn_cost
import time as _t

from specserve import engine as _E

STEPS = {}
_orig_step = _E.LLMEngine.step
def _step(self):
    t = _t.perf_counter(); out = _orig_step(self); STEPS.setdefault(id(self), []).append(_t.perf_counter() - t); return out
_E.LLMEngine.step = _step
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
off = LLMEngine(speculative_method="none")
ad = LLMEngine(speculative_method="draft_model")
reqs = load_workload("chat", 24, output_len=128, tokenizer=off.tokenizer)
ids = prompt_ids(off, reqs)
for e in (off, ad):
    warm_up(e, reqs, ids, num_requests=4)
for r in range(rounds):
    res = {}
    for name, e in ((("off", off), ("ad", ad)) if r % 2 == 0 else (("ad", ad), ("off", off))):
        LOG.clear(); STEPS.clear()
        run = run_offline(e, reqs, token_ids=ids, progress=False, label=name)
        res[name] = run['output_throughput']
        st = STEPS[id(e)]; print(f'  {name}: engine steps {len(st)} sum {sum(st):.2f}s first3 {[round(x*1e3) for x in st[:3]]} median {statistics.median(st)*1e3:.1f}ms', flush=True)
        if name == "ad":
            steps = list(LOG)
    dr = [(i, x) for i, x in enumerate(steps) if x["dr"] or x["bl"]]
    plain = statistics.median([x["el"] for x in steps if not x["dr"] and not x["bl"]])
    print(f"round {r}: off {res['off']:.1f} ad {res['ad']:.1f} ratio {res['ad']/res['off']:.3f} steps {len(steps)} "
          f"plain median {plain*1e3:.1f} ms; total {sum(x['el'] for x in steps):.2f}s", flush=True)
    for i, x in dr:
        print(f"   step {i}: n={x['n']} nd={x['nd']} em={x['em']} el={x['el']*1e3:.0f}ms bl={x['bl']*1e3:.0f}ms planned={x['planned']} checked={x['checked']} veto={x['veto']} ratio={x['ratio']} z={x['z']} cx={x['cx']} since={x['since']} cid={x['cid']}")
