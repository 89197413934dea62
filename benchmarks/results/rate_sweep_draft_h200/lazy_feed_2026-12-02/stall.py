"""step_records under a Triton compile hook: which kernels compile during the recorded runs, and the slowest steps."""
import json, sys, time
import triton
from triton import knobs

T0 = time.perf_counter()
def hook(*args, **kwargs):
    fn = kwargs.get("fn")
    name = getattr(getattr(fn, "jit_function", fn), "__name__", None) or str(kwargs.get("key", ""))[:60]
    print(f"COMPILE {time.perf_counter() - T0:8.2f}s {name}", flush=True)
    return False
knobs.runtime.jit_post_compile_hook = hook
sys.argv = ["step_records"] + sys.argv[1:]
sys.path.insert(0, "benchmarks")
import step_records
step_records.main(sys.argv[1:])
out = sys.argv[sys.argv.index("--json") + 1]
r = json.load(open(out))
c = {n: i for i, n in enumerate(r["fields"])}
for run in r["runs"]:
    steps = run["steps"]
    tot = sum(s[c["step_s"]] for s in steps)
    em = sum(s[c["emitted"]] for s in steps)
    kinds = {}
    for s in steps:
        k = ("P" if s[c["prefill_tokens"]] > 0 else "") + ("D" if s[c["drafts"]] > 0 else "") or "plain"
        kinds.setdefault(k, []).append(s)
    print(run["setting"], run["round"], f"{run['output_throughput']:.0f} tok/s; steps {len(steps)}, {tot*1e3:.0f} ms, {em:.0f} tokens")
    for k, v in kinds.items():
        T = sum(s[c["step_s"]] for s in v); E = sum(s[c["emitted"]] for s in v)
        print(f"   {k:6s} n={len(v):4d} {T*1e3:7.1f} ms emitted {E:6.0f} reqs {sum(s[c['requests']] for s in v)/len(v):5.1f} "
              f"drafts {sum(s[c['drafts']] for s in v)/len(v):6.1f} verify {1e3*sum(s[c['verify_s']] for s in v)/len(v):.2f} "
              f"choose {1e3*sum(s[c['choose_s']] for s in v)/len(v):.2f} step {1e3*T/len(v):.2f}")
    slow = sorted(range(len(steps)), key=lambda i: -steps[i][c["step_s"]])[:6]
    for i in sorted(slow):
        s = steps[i]
        print(f"   slow step {i}: " + ", ".join(f"{n}={s[c[n]]*1e3:.1f}ms" if n.endswith("_s") else f"{n}={s[c[n]]:.0f}" for n in r["fields"]))
