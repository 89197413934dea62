"""Step records under load with the controller's view: per step, the plan (k, prices)
and the check's state, beside what the step cost.

    PLAIN=bar|fit python load_diag.py OUT.json [step_records.py's flags]
"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
from specserve.spec import controller as C
from specserve.spec import speculator as S

LOG = []
orig_plan = C.DraftLengthController._plan
def _plan(self, caps, num_other_tokens, num_other_spans, padded, context, forkable=(), check=None):
    k, unforked, prices = orig_plan(self, caps, num_other_tokens, num_other_spans, padded, context, forkable, check)
    passes = self.costs.drafter_passes(np.arange(self.max_k + 1))
    D = int(k.max()) if len(k) else 0
    pred = prices.fixed + prices.draft_pass * passes[D] + prices.padded_token * len(k) * D + prices.draft_fixed * (D > 0) \
        + sum(prices.token * ki + prices.draft_token * passes[ki] + prices.span for ki in k if ki)
    LOG.append({"ev": "plan", "n": len(caps), "k": k.tolist(), "fixed": prices.fixed, "pred": pred, "token": prices.token,
                    "span": prices.span, "padded": prices.padded_token, "dpass": prices.draft_pass, "dtok": prices.draft_token,
                    "dfixed": prices.draft_fixed, "other": num_other_tokens, "plain": prices.plain})
    return k, unforked, prices
C.DraftLengthController._plan = _plan
orig_learn = S.Speculator._learn_cost
def _learn_cost(self, choice, drafts, emitted, elapsed):
    ch = choice or self.controller.last
    chk = ch.check
    orig_learn(self, choice, drafts, emitted, elapsed)
    LOG.append({"ev": "step", "planned": ch.planned, "drafted": ch.drafted, "checked": ch.checked, "emitted": emitted,
                    "elapsed": elapsed, "draft_s": drafts.draft_s, "backlog_s": drafts.backlog_s,
                    "ndrafts": sum(len(p.draft_token_ids) for p in drafts.scheduled.scheduled) if drafts.scheduled else 0,
                    "nreq": len(drafts.scheduled.scheduled) if drafts.scheduled else 0,
                    "vetoed": None if chk is None else chk.vetoed, "ratio": None if chk is None else chk.ratio,
                    "z": None if chk is None else chk.z})
S.Speculator._learn_cost = _learn_cost
MEASURED = {"bar": True, "fit": False}[os.environ.get("PLAIN", "bar")]
orig_init = C.DraftLengthController.__init__
def __init__(self, *a, **kw):
    orig_init(self, *a, **kw)
    self.measured_plain = MEASURED
C.DraftLengthController.__init__ = __init__
import step_records

out = sys.argv[1]
rc = step_records.main(sys.argv[2:])
with open(out, "w") as f:
    json.dump(LOG, f)
