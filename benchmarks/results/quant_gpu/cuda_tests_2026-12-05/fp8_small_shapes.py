"""The FP8 GEMM test (tests/test_checkpoint_quant.py: test_the_fp8_gemm_computes_its_reference)
at the tiny test model's shapes (hidden 64, intermediate 128: K of 64 and 128, N of 64 to
256), which its CUDA shapes (4096 and up, 200 x 1024) leave out; every case, failures
printed rather than raised.

    PYTHONPATH=.:tests python fp8_small_shapes.py
"""
import itertools
import traceback

import test_checkpoint_quant as t
import torch
from _pytest.monkeypatch import MonkeyPatch

t.SHAPES = [(128, 64), (64, 64), (256, 64), (64, 128), (192, 128)]
failed = 0
for (block, activations), dtype, split in itertools.product(t.FP8_CASES, (torch.float32, torch.bfloat16), (False, True)):
    patch = MonkeyPatch()
    try:
        t.test_the_fp8_gemm_computes_its_reference(block, activations, dtype, split, patch)
        print("ok  ", block, activations, dtype, "split" if split else "planned", flush=True)
    except AssertionError as exc:
        failed += 1
        print("FAIL", block, activations, dtype, "split" if split else "planned", repr(exc)[:300], flush=True)
    except Exception:  # noqa: BLE001 (a diagnostic: every case reported, none stops the rest)
        failed += 1
        print("ERROR", block, activations, dtype, split, traceback.format_exc()[-600:], flush=True)
    finally:
        patch.undo()
print("failed", failed)
