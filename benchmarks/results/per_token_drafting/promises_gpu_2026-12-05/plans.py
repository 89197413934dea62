"""``benchmarks/step_records.py`` with every fresh plan of the adaptive engines logged:
its batch, prompt tokens, drafts planned and requests drafting, the goodput it expected,
the prices it compared (the fit's step without drafts, the kind's measured one) and the
kind's promise factor (``GoodputCheck.promise``), and whether that engine keeps promises.
A line ("run", engine's controller id) marks where each recorded run begins.

    python plans.py PLANS_JSON [step_records.py's arguments]
"""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT / "benchmarks"))

from specserve.bench import recorder
from specserve.spec import controller as ctl

LOG: list = []
_plan, _recording = ctl.DraftLengthController._plan, recorder.StepRecorder.recording


def logged(self, caps, num_other_tokens, num_other_spans, padded, context, forkable=(), check=None):
    k, unforked, prices, goodput = _plan(self, caps, num_other_tokens, num_other_spans, padded, context,
                                         forkable, check)
    LOG.append(["plan", id(self), len(caps), int(num_other_tokens), int(k.sum()), int((k > 0).sum()),
                float(goodput), float(prices.fixed), float(prices.plain), float(prices.promise),
                self.keep_promises])
    return k, unforked, prices, goodput


def recording(self):
    controller = self.engine.speculator.controller
    LOG.append(["run", id(controller) if controller is not None else None])
    return _recording(self)


ctl.DraftLengthController._plan = logged
recorder.StepRecorder.recording = recording

import step_records

out = sys.argv[1]
code = step_records.main(sys.argv[2:])
Path(out).write_text(json.dumps({"fields": ["plan", "controller", "requests", "prefill_tokens", "drafts",
                                            "drafting", "goodput", "fixed_s", "plain_s", "promise", "keeps"],
                                 "log": LOG}) + "\n")
sys.exit(code)
