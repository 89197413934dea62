"""``../ragged_share_2026-12-06/share_ab.py`` (``benchmarks/step_records.py`` with that
study's settings) with two settings more:

- ``adaptive, applied at the plan``: the default, but ``DraftLengthController.settle`` a
  no-op, so the drafts' outcomes are applied to the estimates at the next fresh plan,
  which under load is mostly made between two passes (as before this study);
- ``adaptive, lazy feed``: the default, but its draft model fed lazily, as where drafting
  stops by confidence (the CPU's default): a request that drafts nothing in a step is
  left unfed, its prompt chunks included, and catches up when it next drafts
  (``ModelDrafter.catch_up_lazily``), so a step without drafts runs no draft pass. The
  controller is told so: no step is a switch, and a draft depth D costs D draft passes
  (``StepCosts.first_free`` 0), as for any lazy drafter.

    python settle_ab.py [step_records.py's arguments] --settings "off;adaptive;..."
"""
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[3] / "benchmarks"))

import step_records


def applied_at_the_plan(engine):
    engine.speculator.controller.settle = lambda: None


def lazy_feed(engine):
    speculator = engine.speculator
    speculator.drafter.catch_up_lazily()
    speculator.controller.switches_below = 0  # (``switches = False`` when the study ran)
    speculator.controller.costs.first_free = 0


for name, setup in (("adaptive, applied at the plan", applied_at_the_plan), ("adaptive, lazy feed", lazy_feed)):
    step_records.SETTINGS[name] = {}
    step_records.SETUP[name] = setup
sys.argv[0] = str(HERE.parent / "ragged_share_2026-12-06" / "share_ab.py")
runpy.run_path(sys.argv[0], run_name="__main__")
