import sys, collections
import numpy as np
from specserve.bench import cli as bcli
from specserve.spec.controller import DraftLengthController

rec = []
orig_choose = DraftLengthController.choose
def choose(self, caps, *a, **kw):
    r = orig_choose(self, caps, *a, **kw)
    last = self._last
    if caps: rec.append((len(caps), sum(r.values()), bool(last and last.check.vetoed), bool(last and last.checked),
                kw.get("num_other_tokens", 0) > 0, self.stop is not None))
    return r
DraftLengthController.choose = choose
orig_run = bcli.run_offline
def run(engine, requests, **kw):
    rec.clear()
    out = orig_run(engine, requests, **kw)
    c = engine.speculator.controller if engine.speculator is not None else None
    if c is not None and rec:
        a = np.array(rec, dtype=float)
        byb = collections.defaultdict(list)
        for b, k, v, ch, pf, st in rec:
            byb[int(b).bit_length()].append((k / b, v, ch, pf))
        print(kw.get("label"), "steps", len(rec), "mean k", round(a[:, 1].sum() / a[:, 0].sum(), 2), "vetoed share", round(a[:, 2].mean(), 2))
        for kb, xs in sorted(byb.items()):
            x = np.array(xs, dtype=float)
            print(f"  batch {1 << (kb - 1)}-{(1 << kb) - 1}: steps {len(xs)}, k/req {x[:, 0].mean():.2f}, vetoed {x[:, 1].mean():.2f}, checked {x[:, 2].mean():.2f}, prefill {x[:, 3].mean():.2f}")
        for regime, ch in c.checks.items():
            print("  check", regime, "vetoed", ch.vetoed, "ratio", round(ch.ratio, 3), "z", round(ch.z, 2), "counts", ch._counts, "checks", ch.num_checks)
        t = c.costs.target.theta; d = c.costs.draft.theta
        print("  target theta ms", [round(x * 1e3, 3) for x in t], "draft", [round(x * 1e3, 3) for x in d])
    return out
bcli.run_offline = run
from specserve.cli import main
sys.exit(main(sys.argv[1:]))
