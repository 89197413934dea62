"""``../ragged_share_2026-12-06/share_ab.py`` (``benchmarks/step_records.py`` with that
study's settings) with one setting more:

- ``adaptive, applied at the plan``: the default, but ``DraftLengthController.settle`` a
  no-op, so the drafts' outcomes are applied to the estimates at the next fresh plan,
  which under load is mostly made between two passes (as before this study).

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


step_records.SETTINGS["adaptive, applied at the plan"] = {}
step_records.SETUP["adaptive, applied at the plan"] = applied_at_the_plan
sys.argv[0] = str(HERE.parent / "ragged_share_2026-12-06" / "share_ab.py")
runpy.run_path(sys.argv[0], run_name="__main__")
