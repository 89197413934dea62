"""The attention as shipped against the one before this change (mode ``645feef``: that
commit's kernel file, copied here as ``paged_attention_645feef.py.txt``, which waits before it
reads the batch's layout) and against itself without the K/V prefetch, in the decode and
verify steps of ``ab.py`` (PDL on in every mode).

    python final_ab.py out.json [schemes] [modes: 645feef,noprefetch,shipped]
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "pdl_2026-12-06"))

import pdl_ab
from specserve.kernels import paged_attention, pdl

_spec = importlib.util.spec_from_file_location(  # (.txt: kept out of the linter, as it was then)
    "paged_attention_645feef", HERE / "paged_attention_645feef.py.txt",
    loader=importlib.machinery.SourceFileLoader("paged_attention_645feef", str(HERE / "paged_attention_645feef.py.txt")))
OLD = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)  # (its dataclass looks itself up)
_spec.loader.exec_module(OLD)
SHIPPED = paged_attention.paged_attention
MODES = {"645feef": (OLD.paged_attention, False), "noprefetch": (SHIPPED, False), "shipped": (SHIPPED, True)}


def set_mode(mode: str) -> None:
    pdl.ENABLED, pdl.TRIGGER, pdl.GEMM_PREFETCH = True, True, None
    paged_attention.paged_attention, paged_attention.PREFETCH_KV = MODES[mode]


if __name__ == "__main__":
    pdl_ab.set_mode = set_mode
    pdl_ab.MODES = MODES
    if len(sys.argv) < 4:
        sys.argv[3:] = [",".join(MODES)]
    pdl_ab.main()
