"""The decode step's attention under PDL: its first keys and values asked of L2 before its
wait (``paged_attention.PREFETCH_KV``), its KV splits combined in its own launch
(``REDUCE_IN_LAUNCH``), finer splits (``_MIN_SPLIT_TOKENS``), and W8A8's K splits summed
in the GEMM's launch (``FEW_ROW_TILES["w8a8"].sum_in_launch``), against the step as it was
(PDL on, none of these). Batch-1 decode (512 cached tokens) and verify (1 + 4) steps of the
Llama-3.1-8B shape, random weights, CUDA-graph replay, modes taking turns in one process
(``../pdl_2026-12-06/pdl_ab.py``'s ``measure``); logits must be the same bits in every mode.

    python ab.py out.json [schemes: bf16,w8a8,blocks,w8a16,int4,small] [modes]

Run at 9141c32: the next commit took ``REDUCE_IN_LAUNCH`` out (measured slower), so only the
modes without it (``before``, ``prefetch``) run after that.
"""
from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "pdl_2026-12-06"))

import pdl_ab
from specserve.kernels import paged_attention, pdl, quant_matmul

SHIPPED = dict(quant_matmul.FEW_ROW_TILES)
# mode -> (PREFETCH_KV, REDUCE_IN_LAUNCH, _MIN_SPLIT_TOKENS, W8A8 sums in launch)
MODES = {"before": (False, False, 128, False), "prefetch": (True, False, 128, False),
         "reduce": (False, True, 128, False), "both": (True, True, 128, False),
         "both64": (True, True, 64, False), "w8a8sum": (True, True, 128, True)}


def set_mode(mode: str) -> None:
    pdl.ENABLED, pdl.TRIGGER, pdl.GEMM_PREFETCH = True, True, None
    prefetch, reduce, paged_attention._MIN_SPLIT_TOKENS, w8a8_sum = MODES[mode]
    paged_attention.PREFETCH_KV = prefetch
    if not hasattr(paged_attention, "REDUCE_IN_LAUNCH"):
        assert not reduce, f"mode {mode!r} needs 9141c32 (REDUCE_IN_LAUNCH)"
    else:
        paged_attention.REDUCE_IN_LAUNCH = reduce
    quant_matmul.FEW_ROW_TILES["w8a8"] = SHIPPED["w8a8"]._replace(sum_in_launch=w8a8_sum)
    quant_matmul.plan.cache_clear()


if __name__ == "__main__":
    pdl_ab.set_mode = set_mode
    pdl_ab.MODES = MODES
    if len(sys.argv) < 4:
        sys.argv[3:] = [",".join(MODES)]
    pdl_ab.main()  # (same_logits_as_off and "x off": against the first mode, "before")
