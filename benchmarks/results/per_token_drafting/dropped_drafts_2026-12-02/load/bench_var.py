"""`specserve bench ...` with parts of the CPU default put back to before eaa0c55, by
SPECSERVE_OLD (comma-separated): replan (plans with drafts stand 2 steps), dropped (no
learning from dropped drafts), firstpass (the rule's time without the first pass)."""
import os, sys
from specserve.spec import controller as ctl_mod, stopping, speculator as spec_mod
from specserve.cli import main

old = set(filter(None, os.environ.get("SPECSERVE_OLD", "").split(",")))
if "replan" in old:
    init = ctl_mod.DraftLengthController.__init__
    def __init__(self, *a, **kw):
        init(self, *a, **kw)
        self.draft_replan = ctl_mod.DRAFT_REPLAN
    ctl_mod.DraftLengthController.__init__ = __init__
if "dropped" in old:
    calibrate = spec_mod.Speculator._calibrate
    spec_mod.Speculator._calibrate = lambda self, confidence, dropped, updates, trees: calibrate(self, confidence, {}, updates, trees)
if "firstpass" in old:
    begin = stopping.StopRule.begin
    def old_begin(self, rows):
        stop = begin(self, rows)
        stop.time = max(self.prices.fixed, 1e-9)
        return stop
    stopping.StopRule.begin = old_begin
print("old parts:", sorted(old), file=sys.stderr)
sys.exit(main())
