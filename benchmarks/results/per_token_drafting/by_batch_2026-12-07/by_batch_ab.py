"""``benchmarks/step_records.py`` with the settings of this study, beside speculation off:

- ``adaptive``: the default, whose draft model on a GPU is fed lazily in steps of
  ``LAZY_FROM`` requests or more (a request that drafts nothing in such a step is left
  unfed, its prompt chunks included, and catches up when it next drafts, its backlog in
  its first draft pass) and in lockstep in smaller ones;
- ``adaptive, lockstep``: the same, but every step feeds every request (drafts or not,
  a step without drafts after the target's pass), as before this study: no step feeds
  lazily, and a step without drafts right after one with is a switch at every batch;
- ``adaptive, backlog apart``: the default, but a lazily fed request's backlog longer
  than ``LAZY_APART`` tokens (its prompt, at its first drafts) is fed in a pass of its own
  before the first draft pass, as on a CPU (``ModelDrafter.backlog_apart``), not in it.

    python by_batch_ab.py [step_records.py's arguments] --settings "off;adaptive;adaptive, lockstep"
"""
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT / "benchmarks"))

import step_records


def lockstep(engine):
    speculator = engine.speculator
    speculator.drafter.catch_up_lazily(math.inf)
    speculator.controller.switches_below = math.inf


def reported(engine):
    """The default, its lazy threshold printed: what the engine set up."""
    print("adaptive: the draft fed lazily in steps of", engine.speculator.drafter.lazy_from, "requests or more",
          flush=True)


def backlog_apart(engine):
    engine.speculator.drafter.backlog_apart = True


for name, setup in (("adaptive", reported), ("adaptive, lockstep", lockstep),
                    ("adaptive, backlog apart", backlog_apart)):
    step_records.SETTINGS.setdefault(name, {})
    step_records.SETUP[name] = setup
sys.exit(step_records.main(sys.argv[1:]))
