"""``benchmarks/step_records.py`` with the settings of this study, beside speculation off:

- ``adaptive``: the default (the goodput check's plain side measured in the plain regime
  at a large batch: ``GoodputCheck.observe``'s ``after_drafts``, ``continues``; the draft's feed in a step without drafts replaying on the target's
  inputs, ``ModelDrafter.shares_target_inputs``), and ``adaptive b``, a second engine
  alike, to see how far two alike engines differ;
- ``adaptive, own inputs``: the plain regime, the draft building its own inputs;
- ``adaptive, as before``: neither (the default at 6fb784c): every step without drafts
  teaches the plain side and a plain check is one step.

The runs of this study's README were made at 13ef308 (a switch was then any step without
drafts after one with them, whatever its kind, read from the controller's choices); this
script sets up the same settings on the code as it is now.

    python regime_ab.py [step_records.py's arguments] --settings "off;adaptive;..."
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT / "benchmarks"))

import step_records


def setup(shared: bool = True, regime: bool = True):
    def apply(engine):
        speculator = engine.speculator
        speculator.drafter.shares_target_inputs = shared
        controller = speculator.controller
        if not regime:
            choose, learn_cost = controller.choose, speculator._learn_cost

            def choose_as_before(*args, **kwargs):
                k = choose(*args, **kwargs)
                for check in controller.checks.values():
                    check._continuing = False  # a plain check is one step
                return k

            def learn_cost_as_before(choice, drafts, emitted, elapsed, after_drafts):
                # every step without drafts teaches the plain side
                return learn_cost(choice, drafts, emitted, elapsed, False)
            # (not observe_goodput: the step recorder wraps it for a recording, then deletes it)
            controller.choose, speculator._learn_cost = choose_as_before, learn_cost_as_before
    return apply


for name, apply in (("adaptive, own inputs", setup(shared=False)),
                    ("adaptive, as before", setup(shared=False, regime=False)),
                    ("adaptive b", setup()),
                    ("adaptive", setup())):
    step_records.SETTINGS.setdefault(name, {})
    step_records.SETUP[name] = apply

sys.exit(step_records.main(sys.argv[1:]))
