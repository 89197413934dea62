"""Per-step records of an engine while a benchmark runs it: what each step fed, drafted
and emitted, when it started (seconds into the recording), its wall time and its drafting
and verify passes', and the host phases around them (choosing k, scheduling, update,
postprocess, the controller's bookkeeping, garbage collection). ``StepRecorder`` wraps the
engine's methods on the instance, only while a run is recorded; ``summarise`` groups a
run's records by kind of step."""
from __future__ import annotations

import gc
import statistics
import time
from contextlib import contextmanager

FIELDS = ("requests", "prefill_tokens", "drafts", "emitted", "step_s", "verify_s",
          "choose_s", "schedule_s", "update_s", "postprocess_s", "controller_s", "gc_s", "start_s")
PHASES = ("choose_s", "schedule_s", "update_s", "postprocess_s", "controller_s", "gc_s")


class StepRecorder:
    """Records every step of one engine while installed (``with recorder.recording():``):
    wraps the engine's step and verify, the speculator's plan and propose, the scheduler's
    and the controller's methods on the instance, and times collections with
    ``gc.callbacks``."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.steps: list[list[float]] = []
        self.seconds = 0.0  # the last recording's wall time, from which the steps' ``start_s`` count
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
        """Record the engine's steps while entered (``steps`` starts empty)."""
        self.steps = []
        e, cur = self.engine, self._cur
        owners = [(e.speculator, "plan", "choose_s"), (e.scheduler, "schedule", "schedule_s"),
                  (e.speculator, "propose", "verify_s"), (e.scheduler, "update", "update_s"),
                  (e, "_apply_stop_strings", "postprocess_s"), (e, "_output", "postprocess_s")]
        controller = e.speculator.controller
        if controller is not None:
            owners += [(controller, "observe_goodput", "controller_s"),
                       (controller, "observe_step", "controller_s")]
        verify, step = e._verify, e.step

        def recorded_verify(drafts):
            planned = drafts.scheduled.scheduled
            cur["requests"] = len(planned)
            cur["prefill_tokens"] = sum(len(p.token_ids) for p in planned if len(p.token_ids) > 1)
            start = time.perf_counter()
            result = verify(drafts)
            cur["verify_s"] = cur.get("verify_s", 0.0) + time.perf_counter() - start
            cur["drafts"] = sum(len(p.draft_token_ids) for p in planned)
            return result

        began = time.perf_counter()

        def recorded_step():
            cur.clear()
            start = time.perf_counter()
            outputs = step()
            elapsed = time.perf_counter() - start
            if "requests" in cur:  # a step that ran a pass
                cur.update(step_s=elapsed, emitted=sum(len(o.delta_token_ids) for o in outputs),
                           start_s=start - began)
                self.steps.append([cur.get(name, 0.0) for name in FIELDS])
            return outputs

        for owner, name, key in owners:
            self._timed(owner, name, key)
        e._verify, e.step = recorded_verify, recorded_step
        gc.callbacks.append(self._gc)
        try:
            yield self
        finally:
            self.seconds = time.perf_counter() - began
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
