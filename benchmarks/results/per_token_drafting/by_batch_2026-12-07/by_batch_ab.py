"""``benchmarks/step_records.py`` with the settings of this study, beside speculation off:

- ``adaptive``: the default, whose draft model on a GPU is fed every request every step
  (lockstep: a step without drafts feeds it after the target's pass);
- ``adaptive, lazy from 8``: the same, but fed lazily in steps of 8 requests or more (a
  request that drafts nothing in such a step is left unfed, its prompt chunks included,
  and catches up when it next drafts, a backlog longer than ``LAZY_APART`` tokens in a
  pass of its own) and in lockstep in smaller ones; no step of 8 requests or more is a
  switch for the goodput check (``DraftLengthController.switches_below``).

The sets of the README ran this script as it was at commit 61dab61, when the engine fed
lazily from 8 requests by default: its ``adaptive`` is set 1's (this ``adaptive, lazy
from 8``) and set 2's (the same with the backlog in the first draft pass, not kept), its
``adaptive, lockstep`` this ``adaptive``, its ``adaptive, backlog apart`` this ``adaptive,
lazy from 8``.

    python by_batch_ab.py [step_records.py's arguments] --settings "off;adaptive;adaptive, lazy from 8"
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT / "benchmarks"))

import step_records

LAZY_FROM = 8


def lazy_from(engine):
    speculator = engine.speculator
    speculator.drafter.catch_up_lazily(LAZY_FROM)
    speculator.controller.switches_below = LAZY_FROM


step_records.SETTINGS["adaptive, lazy from 8"] = {}
step_records.SETUP["adaptive, lazy from 8"] = lazy_from
sys.exit(step_records.main(sys.argv[1:]))
