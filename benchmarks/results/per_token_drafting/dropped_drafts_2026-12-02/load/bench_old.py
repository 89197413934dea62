"""`specserve bench ...` with the CPU default put back to its old behaviour (before eaa0c55):
plans with drafts standing 2 steps, no learning from dropped drafts, the rule's time without
the first pass. (Per-request estimates stay out: that part changes only host time.)"""
import sys
from specserve.spec import controller as ctl_mod, stopping, speculator as spec_mod
from specserve.cli import main

init = ctl_mod.DraftLengthController.__init__
def __init__(self, *a, **kw):
    init(self, *a, **kw)
    self.draft_replan = ctl_mod.DRAFT_REPLAN
ctl_mod.DraftLengthController.__init__ = __init__
calibrate = spec_mod.Speculator._calibrate
spec_mod.Speculator._calibrate = lambda self, confidence, dropped, updates, trees: calibrate(self, confidence, {}, updates, trees)
begin = stopping.StopRule.begin
def old_begin(self, rows):
    stop = begin(self, rows)
    stop.time = max(self.prices.fixed, 1e-9)
    return stop
stopping.StopRule.begin = old_begin
sys.exit(main())
