"""Compile Triton kernels for Hopper (sm_90) on a machine without a GPU: catches what the
interpreter misses (types in loops, layouts), in a subprocess without TRITON_INTERPRET."""
from __future__ import annotations

import os
import subprocess
import sys


def compiles_for_sm90(script: str) -> None:
    """Run ``script`` (which prints "compiled" at the end) and assert it succeeded."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences a triton 3.9 notice
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
