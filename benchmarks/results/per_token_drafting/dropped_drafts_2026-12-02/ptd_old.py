"""per_token_drafting.py with the second adaptive engine ("adaptive, max k=4") run the old
way: the stopping rule's time without the spent first pass, and no learning from dropped drafts."""
import runpy
import sys

from specserve import LLM
from specserve.spec.speculator import Speculator
from specserve.spec.stopping import StopRule


class OldRule(StopRule):
    def begin(self, rows):
        stop = super().begin(rows)
        stop.time = max(self.prices.fixed, 1e-9)
        return stop

made = []
orig_init = LLM.__init__
def init(self, *a, **kw):
    orig_init(self, *a, **kw)
    if kw.get("draft_stopping") == "confidence":
        made.append(self)
        if len(made) == 2:
            spec = self.engine.speculator
            spec._calibrate = lambda confidence, dropped, updates, trees: Speculator._calibrate(spec, confidence, {}, updates, trees)
            ctl = spec.controller
            choose = ctl.choose
            def old_choose(*a, **kw):
                r = choose(*a, **kw)
                if ctl.stop is not None:
                    s = ctl.stop
                    ctl.stop = OldRule(s.calibration, s.prices, s.num_reqs, s.free, s.padded)
                return r
            ctl.choose = old_choose
            ctl.draft_replan = 2
            print("patched the second adaptive engine to the old rule", file=sys.stderr)
LLM.__init__ = init
sys.argv = ["per_token_drafting.py"] + sys.argv[1:]
runpy.run_path("benchmarks/per_token_drafting.py", run_name="__main__")
