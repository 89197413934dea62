import runpy, sys
from specserve.spec import stopping
orig = stopping.DraftStop.after
def after(self, depth, confidence):
    if depth == 0:
        confidence = [max(c, 0.999) for c in confidence]
    return orig(self, depth, confidence)
stopping.DraftStop.after = after
sys.argv = ["per_token_drafting.py"] + sys.argv[1:]
runpy.run_path("benchmarks/per_token_drafting.py", run_name="__main__")
