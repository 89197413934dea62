"""``benchmarks/step_records.py`` with the settings of this study, beside speculation off
and the default (adaptive):

- what a step without drafts costs the draft model's feed: the built-in draft with k = 0
  for every request (every step without drafts) fed beside the target's pass building
  its own inputs, replaying on the target's (``GraphRunner.replay_inputs_of``), or not
  fed at all (the floor any feed could reach);
- the default building its own inputs, teaching its steps with their fresh plans' host
  time in (``DraftLengthController.plans_apart`` False), or both (the engine before this
  study); and a second engine of the default, to see how far two alike engines' verdicts
  differ. ``plans_apart`` (a step taught without its fresh plan's host time) was tried at
  7aa0fed and taken out after: the settings that set it run only there. The draft shares
  the target's inputs in every setting but the "own inputs" ones, as it did by default
  when the study ran (it is off by default since).

    python plain_ab.py [step_records.py's arguments] --settings "off;adaptive;..."
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT / "benchmarks"))

import step_records


def setup(k_zero: bool = False, shared: bool = True, fed: bool = True, plans_apart: bool = True):
    def apply(engine):
        speculator = engine.speculator
        if k_zero:
            speculator.max_k = 0  # a fixed k of 0: every request's plan, every step without drafts
        speculator.drafter.shares_target_inputs = shared
        if not fed:
            speculator.drafter.feed = lambda *args: None  # (it never drafts: its cache is never read)
        controller = speculator.controller
        if controller is not None and not plans_apart:
            if not hasattr(controller, "plans_apart"):
                raise SystemExit("the plans_apart settings run at commit 7aa0fed, where the controller has it")
            controller.plans_apart = False
    return apply


FIXED = {"speculative_adaptive": False}
for name, kwargs, apply in (("k = 0, own inputs", FIXED, setup(True, shared=False)),
                            ("k = 0, shared inputs", FIXED, setup(True)),
                            ("k = 0, unfed", FIXED, setup(True, fed=False)),
                            ("adaptive, own inputs", {}, setup(shared=False)),
                            ("adaptive, plans counted", {}, setup(plans_apart=False)),
                            ("adaptive, as before", {}, setup(shared=False, plans_apart=False)),
                            ("adaptive b", {}, setup()),
                            ("adaptive", {}, setup())):
    step_records.SETTINGS.setdefault(name, kwargs)
    step_records.SETUP[name] = apply

sys.exit(step_records.main(sys.argv[1:]))
