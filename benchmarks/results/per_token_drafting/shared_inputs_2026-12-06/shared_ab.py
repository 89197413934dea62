"""``benchmarks/step_records.py`` with settings that take apart what a step without drafts
costs the draft model's feed: beside speculation off, the built-in draft with k = 0 for
every request (every step without drafts) fed beside the target's pass building its own
inputs, replaying on the target's (``GraphRunner.replay_inputs_of``), or not fed at all
(the floor any feed could reach); and the default (adaptive) sharing the target's inputs
or building its own.

    python shared_ab.py [step_records.py's arguments] --settings "off;k = 0, own inputs;..."
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT / "benchmarks"))

import step_records


def setup(k_zero: bool, shared: bool, fed: bool = True):
    def apply(engine):
        speculator = engine.speculator
        if k_zero:
            speculator.max_k = 0  # a fixed k of 0: every request's plan, every step without drafts
        speculator.drafter.shares_target_inputs = shared
        if not fed:
            speculator.drafter.feed = lambda *args: None  # (it never drafts: its cache is never read)
    return apply


FIXED = dict(speculative_adaptive=False)
for name, kwargs, apply in (("k = 0, own inputs", FIXED, setup(True, False)),
                            ("k = 0, shared inputs", FIXED, setup(True, True)),
                            ("k = 0, unfed", FIXED, setup(True, True, fed=False)),
                            ("adaptive, own inputs", {}, setup(False, False))):
    step_records.SETTINGS[name] = kwargs
    step_records.SETUP[name] = apply

sys.exit(step_records.main(sys.argv[1:]))
