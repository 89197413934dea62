"""How the CPU path's threads run: how many (the cores this process may actually use) and
how they wait (spinning, or sleeping where other work already keeps the cores busy).

``os.cpu_count()`` counts the machine's cores, not the ones a container's quota or a
``taskset`` leaves this process; threads beyond those only take turns with each other.
Between parallel regions OpenMP's threads spin for a while before they sleep; on a quiet
machine that makes the next region start sooner, but where other processes keep every core
busy a spinning thread takes the core a working one needs, and a step waits at each barrier
for a thread the OS has put aside: ``benchmarks/results/busy_cpu`` measured 41.7 tokens/s
quiet and 1.6 beside two busy processes with spinning, 18.6 and 13.7 with sleeping. So
threads sleep at once only where other work already keeps the machine busy at start.

Torch-free: the wait policy must be chosen before torch loads its OpenMP runtime.
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path


def available_cpus() -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup CPU quota."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        count = os.cpu_count() or 1
    quota = _cgroup_quota()
    return max(1, min(count, math.ceil(quota)) if quota else count)


def _cgroup_quota() -> float | None:
    """CPUs' worth of time per period the cgroup allows (v2 ``cpu.max``, v1 CFS files), or None."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def wait_policy(window_s: float = 0.1) -> tuple[str | None, str]:
    """The OpenMP wait policy to set before torch loads (None: leave the runtime's default)
    and why: PASSIVE where other work keeps at least half the machine's cores busy, sampled
    over ``window_s`` (the load average would lag a minute behind); nothing where
    ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` is set outside, or the use is unknown."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return None, "OMP_WAIT_POLICY / GOMP_SPINCOUNT set outside"
    busy = busy_fraction(window_s)
    if busy is None:
        return None, "the machine's use is unknown"
    if busy >= 0.5:
        return "PASSIVE", f"the machine was {busy:.0%} busy at start"
    return None, f"the machine was {busy:.0%} busy at start"


def busy_fraction(window_s: float) -> float | None:
    """The share of the machine's CPU time spent working over the next ``window_s``
    seconds (``/proc/stat``), or None where it cannot be read."""
    first = _cpu_times()
    if first is None:
        return None
    time.sleep(window_s)
    second = _cpu_times()
    total = sum(second) - sum(first)
    idle = (second[3] + second[4]) - (first[3] + first[4])  # idle + iowait
    return None if total <= 0 else 1 - idle / total


def _cpu_times() -> list[int] | None:
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    return [int(x) for x in fields[1:9]] if fields and fields[0] == "cpu" else None


# Why OpenMP's threads wait as they do (for the start-up log); set by ``choose_wait_policy``.
wait_reason = "torch was loaded before specserve"


# How OpenMP's threads wait between parallel regions, by OMP_WAIT_POLICY.
_WAITS = {"PASSIVE": "sleep at once", "ACTIVE": "spin", "": "spin a while, then sleep"}


def waiting() -> str:
    """How OpenMP's threads wait, and why (for the start-up log)."""
    policy = os.environ.get("OMP_WAIT_POLICY", "").upper()
    return f"{_WAITS.get(policy, _WAITS[''])} ({wait_reason})"


def choose_wait_policy() -> None:
    """Set ``OMP_WAIT_POLICY`` from ``wait_policy``: call before torch is imported."""
    global wait_reason
    policy, wait_reason = wait_policy()
    if policy is not None:
        os.environ["OMP_WAIT_POLICY"] = policy
