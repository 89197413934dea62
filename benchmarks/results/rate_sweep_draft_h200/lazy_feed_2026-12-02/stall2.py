"""bench offline (code-edit, 256 req/s, adaptive) with every engine step timed and Triton compiles logged."""
import sys, time
from triton import knobs
from specserve import engine as engine_module
from specserve.drafts import model_drafter

T0 = time.perf_counter()
def hook(*args, **kwargs):
    fn = kwargs.get("fn")
    print(f"COMPILE {time.perf_counter() - T0:8.2f}s {getattr(getattr(fn, 'jit_function', fn), '__name__', '?')}", flush=True)
    return False
knobs.runtime.jit_post_compile_hook = hook
steps = []
inner = engine_module.LLMEngine.step
def step(self, *a, **k):
    t = time.perf_counter()
    try:
        return inner(self, *a, **k)
    finally:
        d = self.speculator.drafter
        c = self.speculator.controller
        steps.append((t - T0, time.perf_counter() - t, getattr(d, "last_backlog_s", 0.0), getattr(d, "last_catch_up_s", 0.0),
                      len(self.scheduler.running) if hasattr(self.scheduler, "running") else -1,
                      sum(ch.vetoed for ch in c.checks.values()) if c is not None else -1))
engine_module.LLMEngine.step = step
from specserve.cli import main
rc = main(sys.argv[1:])
import statistics
long = [s for s in steps if s[1] > 0.015]
print(f"steps {len(steps)}, over 15 ms: {len(long)}; total backlog {sum(s[2] for s in steps):.3f} s over {sum(s[2] > 0 for s in steps)} steps; catch-up {sum(s[3] for s in steps):.3f} s")
for s in sorted(long, key=lambda s: -s[1])[:15]:
    print(f"  at {s[0]:.2f}s step {s[1]*1e3:.1f} ms backlog {s[2]*1e3:.1f} catch-up {s[3]*1e3:.1f} running {s[4]} vetoed kinds {s[5]}")
# the last run's steps (after the warm-up): durations by decile
last = steps[-600:]
print("last 600 steps, ms deciles:", [round(1e3 * q, 2) for q in statistics.quantiles([s[1] for s in last], n=10)])
print("backlog share of last 600:", round(sum(s[2] for s in last) / sum(s[1] for s in last), 3))
