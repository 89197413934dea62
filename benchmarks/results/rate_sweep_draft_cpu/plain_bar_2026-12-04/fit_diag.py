"""The target cost model's samples in one run, each with the fit's prediction before it
learned it (``fit_samples.json``; ``fit_replay.py`` fits them again).

    python fit_diag.py OUT.json [step_records.py's flags]
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
from specserve.spec import cost_model as CM

LOG = []
orig = CM.StepCosts.observe
def observe(self, sample):
    if sample.target_s is not None:
        x = CM.target_features(sample.num_tokens, sample.num_reqs, sample.context, sample.num_spans, sample.num_padded, sample.num_prefill)
        LOG.append({"x": x, "y": sample.target_s, "pred": self.target.predict(x), "theta": self.target.theta.tolist(),
                        "depth": sample.depth, "nd": sample.num_drafting, "ds": sample.draft_s, "anchored": self.target.anchored})
    orig(self, sample)
CM.StepCosts.observe = observe
import step_records

rc = step_records.main(sys.argv[2:])
with open(sys.argv[1], "w") as f:
    json.dump(LOG, f)
