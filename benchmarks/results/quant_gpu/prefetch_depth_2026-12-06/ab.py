"""How deep a W8A8 GEMM's program prefetches its weights before its PDL wait: the first
``t`` K tiles of its share (``FewRowTiles.prefetch``; ``t0`` none, ``t2`` as shipped when
this ran), asked of L2 while the kernel before it still runs. Decode and verify steps of
``../pdl_2026-12-06/pdl_ab.py``'s ``measure`` (PDL on in every mode; the first mode is the
baseline of "x off" and of the logits' bits).

    python ab.py out.json [schemes: w8a8,blocks] [modes: t2,t0,t4,t8,t16]
"""
from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "pdl_2026-12-06"))

import pdl_ab
from specserve.kernels import pdl, quant_matmul

SHIPPED = quant_matmul.FEW_ROW_TILES["w8a8"]
MODES = {f"t{t}": t for t in (2, 0, 4, 8, 16)}


def set_mode(mode: str) -> None:
    pdl.ENABLED, pdl.TRIGGER, pdl.GEMM_PREFETCH = True, True, None
    quant_matmul.FEW_ROW_TILES["w8a8"] = SHIPPED._replace(prefetch=MODES[mode])
    quant_matmul.plan.cache_clear()


if __name__ == "__main__":
    pdl_ab.set_mode = set_mode
    pdl_ab.MODES = MODES
    if len(sys.argv) < 3:
        sys.argv[2:] = ["w8a8,blocks"]
    if len(sys.argv) < 4:
        sys.argv[3:] = [",".join(MODES)]
    pdl_ab.main()
