"""Where the time goes under load, step by step: speculation off, fixed k and adaptive
with every request queued, each engine step recorded — its requests, prefill tokens,
drafts, emitted tokens, wall time, the verify pass's time, and the host phases around it
(choosing k, scheduling, update, postprocess, the controller's bookkeeping, garbage
collection) — and summarised per run by kind of step (plain, drafted, with a prefill
chunk, both) and, for full plain steps, by phase.

Throughput at max load moves by 10–30 % with a GPU host from run to run; a step's
records show what moved, and what one setting adds to the same kind of step. The
settings take turns over the rounds, as in ``adaptive_check.py``.

    python benchmarks/step_records.py                                   # CPU, chat, 128 requests
    python benchmarks/step_records.py --device cuda --num-prompts 384 --num-kv-blocks 4096 --rounds 3
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from contextlib import contextmanager

SETTINGS = {  # name -> engine kwargs beside n-gram speculation
    "off": dict(speculative_method="none"),
    "fixed k": dict(speculative_adaptive=False),
    "adaptive": dict(),
}
FIELDS = ("requests", "prefill_tokens", "drafts", "emitted", "step_s", "verify_s",
          "choose_s", "schedule_s", "update_s", "postprocess_s", "controller_s", "gc_s")
PHASES = ("choose_s", "schedule_s", "update_s", "postprocess_s", "controller_s", "gc_s")


class StepRecorder:
    """Records every step of one engine while installed (``with recorder.recording():``):
    wraps the engine's step, verify, draft-length, scheduler and controller methods on
    the instance, and times collections with ``gc.callbacks``."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.steps: list[list[float]] = []
        self._cur: dict[str, float] = {}
        self._gc_start = 0.0

    def _timed(self, owner, name: str, key: str) -> None:
        inner, cur = getattr(owner, name), self._cur

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                cur[key] = cur.get(key, 0.0) + time.perf_counter() - start
        setattr(owner, name, timed)

    def _gc(self, phase: str, _info) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self._cur["gc_s"] = self._cur.get("gc_s", 0.0) + time.perf_counter() - self._gc_start

    @contextmanager
    def recording(self):
        e, cur = self.engine, self._cur
        owners = [(e, "_draft_lengths", "choose_s"), (e.scheduler, "schedule", "schedule_s"),
                  (e.scheduler, "update", "update_s"), (e, "_postprocess", "postprocess_s")]
        if e.controller is not None:
            owners += [(e.controller, "observe_goodput", "controller_s"),
                       (e.controller, "observe_step", "controller_s")]
        verify, step = e._verify, e.step

        def recorded_verify(scheduled):
            planned = scheduled.scheduled
            cur["requests"] = len(planned)
            cur["prefill_tokens"] = sum(len(p.token_ids) for p in planned if len(p.token_ids) > 1)
            start = time.perf_counter()
            result = verify(scheduled)
            cur["verify_s"] = time.perf_counter() - start
            cur["drafts"] = sum(len(p.draft_token_ids) for p in planned)
            return result

        def recorded_step():
            cur.clear()
            start = time.perf_counter()
            outputs = step()
            elapsed = time.perf_counter() - start
            if "requests" in cur:  # a step that ran a pass
                cur.update(step_s=elapsed, emitted=sum(len(o.delta_token_ids) for o in outputs))
                self.steps.append([cur.get(name, 0.0) for name in FIELDS])
            return outputs

        for owner, name, key in owners:
            self._timed(owner, name, key)
        e._verify, e.step = recorded_verify, recorded_step
        gc.callbacks.append(self._gc)
        try:
            yield self
        finally:
            gc.callbacks.remove(self._gc)
            for owner, name, _ in owners + [(e, "_verify", ""), (e, "step", "")]:
                del owner.__dict__[name]  # the class's method again


def summarise(steps: list[list[float]], full_batch: int) -> dict:
    """Per kind of step: count, mean ms, emitted tokens per step; for plain steps of at
    least ``full_batch`` requests: the mean of each host phase in µs."""
    col = {name: i for i, name in enumerate(FIELDS)}
    kinds: dict[str, list[list[float]]] = {"plain": [], "drafted": [], "prefill": [], "prefill+drafted": []}
    for s in steps:
        prefill, drafted = s[col["prefill_tokens"]] > 0, s[col["drafts"]] > 0
        kind = "prefill+drafted" if prefill and drafted else "prefill" if prefill else \
            "drafted" if drafted else "plain"
        kinds[kind].append(s)
    out = {"kinds": {name: {"steps": len(rows),
                            "mean_ms": 1e3 * statistics.fmean(r[col["step_s"]] for r in rows),
                            "tokens_per_step": statistics.fmean(r[col["emitted"]] for r in rows)}
                     for name, rows in kinds.items() if rows}}
    full = [r for r in kinds["plain"] if r[col["requests"]] >= full_batch]
    if full:
        out["full_plain_us"] = {name: 1e6 * statistics.fmean(r[col[name]] for r in full)
                                for name in ("step_s", "verify_s") + PHASES}
        out["full_plain_steps"] = len(full)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    from specserve.bench.offline import (add_settings_flags, add_turns_flags, chosen_settings,
                                         engine_flags, report, take_turns)

    add_turns_flags(parser, num_prompts=128)
    parser.set_defaults(workloads="chat")
    add_settings_flags(parser, SETTINGS)
    args = parser.parse_args(argv)
    chosen = chosen_settings(parser, args, SETTINGS)

    from specserve import LLMEngine
    from specserve.bench.cli import describe_machine

    common = engine_flags(args, speculative_method="ngram", num_speculative_tokens=args.k)
    engines = {name: LLMEngine(**{**common, **SETTINGS[name]}) for name in chosen}
    recorders = {name: StepRecorder(engine) for name, engine in engines.items()}
    full_batch = int(0.9 * args.max_num_seqs)

    @contextmanager
    def around(name):
        recorders[name].steps = []
        with recorders[name].recording():
            yield

    results = {"machine": describe_machine(), "args": vars(args), "fields": list(FIELDS), "runs": []}
    for workload, round_, name, run in take_turns(engines, args.workloads.split(","), args.num_prompts,
                                                  args.output_len, args.rounds, args.num_warmups, around):
        steps = recorders[name].steps
        results["runs"].append({"workload": workload, "setting": name, "round": round_,
                                "output_throughput": run["output_throughput"],
                                "summary": summarise(steps, full_batch), "steps": steps})
        print(f"{workload:9s} round {round_} {name:9s} {run['output_throughput']:9.1f} tok/s "
              f"{len(steps)} steps", flush=True)
    report(results, table(results["runs"]), args.json)
    return 0


def table(runs: list[dict]) -> str:
    lines = ["| workload | round | setting | tok/s | steps: plain / drafted / prefill / prefill+drafted "
             "(count, mean ms) | full plain step µs: step, verify | choose, schedule, update, "
             "postprocess, controller, gc |", "| --- | ---: | --- | ---: | --- | --- | --- |"]
    for r in runs:
        s = r["summary"]
        kinds = " / ".join(f"{k['steps']}, {k['mean_ms']:.2f}" if k else "-"
                           for k in (s["kinds"].get(n) for n in ("plain", "drafted", "prefill", "prefill+drafted")))
        full = s.get("full_plain_us")
        main_us = f"{full['step_s']:.0f}, {full['verify_s']:.0f}" if full else ""
        phases = ", ".join(f"{full[p]:.0f}" for p in PHASES) if full else ""
        lines.append(f"| {r['workload']} | {r['round']} | {r['setting']} | {r['output_throughput']:,.1f} | "
                     f"{kinds} | {main_us} | {phases} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
