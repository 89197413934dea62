"""The attention handing its output to the output projection rounded to float8 per head
(``paged_attention.FUSED_FP8``: in its own launches) against a quantizer launch of its
own (the step as it was), for weights whose activation groups are one head (FP8 W8A8 with
128 x 128 block scales at the 8B shape's head_dim of 128). Per-channel W8A8 (groups of a
whole row, never handed) runs as a control. Decode and verify steps of
``../pdl_2026-12-06/pdl_ab.py``'s ``measure`` (PDL on in every mode).

    python ab.py out.json [schemes: blocks,w8a8] [modes: quantizer,fused]
"""
from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "pdl_2026-12-06"))

import pdl_ab
from specserve.kernels import paged_attention, pdl

MODES = {"quantizer": False, "fused": True}


def set_mode(mode: str) -> None:
    pdl.ENABLED, pdl.TRIGGER, pdl.GEMM_PREFETCH = True, True, None
    paged_attention.FUSED_FP8 = MODES[mode]


if __name__ == "__main__":
    pdl_ab.set_mode = set_mode
    pdl_ab.MODES = MODES
    if len(sys.argv) < 4:
        sys.argv[3:] = [",".join(MODES)]
    pdl_ab.main()  # ("x off" and same_logits_as_off: against the first mode, the quantizer)
