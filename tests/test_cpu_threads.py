"""The CPU path's threads: as many as the cores this process may use, sleeping at once
between parallel regions where the machine is already busy."""
from __future__ import annotations

import os

import torch

from specserve import cpu_threads
from specserve.engine import set_cpu_threads


def test_available_cpus_follow_affinity_and_the_cgroup_quota(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(cpu_threads, "_cgroup_quota", lambda: None)
    assert cpu_threads.available_cpus() == 4
    monkeypatch.setattr(cpu_threads, "_cgroup_quota", lambda: 1.5)  # 150 ms per 100 ms
    assert cpu_threads.available_cpus() == 2
    monkeypatch.setattr(cpu_threads, "_cgroup_quota", lambda: 8.0)
    assert cpu_threads.available_cpus() == 4


def test_thread_count_flag_env_and_default(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        assert set_cpu_threads(1) == 1
        monkeypatch.setattr(cpu_threads, "available_cpus", lambda: 2)
        monkeypatch.setattr("specserve.engine.available_cpus", lambda: 2)
        assert set_cpu_threads(None) == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
        assert set_cpu_threads(None) == 1  # the environment's choice stands
    finally:
        torch.set_num_threads(before)


def test_threads_sleep_at_once_only_where_the_machine_is_busy(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setattr(cpu_threads, "available_cpus", lambda: 2)
    monkeypatch.setattr(cpu_threads, "busy_fraction", lambda _s: 0.95)
    policy, why = cpu_threads.wait_policy()
    assert policy == "PASSIVE" and "95% busy" in why
    monkeypatch.setattr(cpu_threads, "busy_fraction", lambda _s: 0.1)
    assert cpu_threads.wait_policy()[0] is None
    monkeypatch.setattr(cpu_threads, "busy_fraction", lambda _s: None)  # no /proc/stat
    assert cpu_threads.wait_policy()[0] is None
    monkeypatch.setattr(cpu_threads, "busy_fraction", lambda _s: 0.95)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # a choice made outside stands
    assert cpu_threads.wait_policy()[0] is None


def test_a_busy_machine_is_seen_at_once():
    """/proc/stat over a tenth of a second: a spinning process per core reads as busy."""
    import multiprocessing

    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(cpu_threads.available_cpus())]
    for p in spinners:
        p.start()
    try:
        busy = cpu_threads.busy_fraction(0.3)
    finally:
        for p in spinners:
            p.terminate()
            p.join()
    assert busy is None or busy > 0.7


def _spin() -> None:
    while True:
        pass
