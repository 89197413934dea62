"""llama.cpp-written blocks of every K-quant and IQ4_XS: a tiny float32 llama of 256-wide
rows (tests/tiny_models.py, so nothing falls back) quantized by llama.cpp into each file
kind, and every quantized tensor decoded by specserve against the gguf package's
dequantisation, value for value. (The default model's files hold no Q2_K tensor: its
576-wide rows fall back to Q4_0.)

    PYTHONPATH=.:tests python benchmarks/results/gguf_kquants_cpu/real_blocks.py DIR
"""
import collections
import ctypes
import sys
from pathlib import Path

import gguf
import llama_cpp
import numpy as np
from gguf.quants import dequantize
from tiny_models import write_tiny_gguf

from specserve.models.quantized import FORMATS, GGUFWeight, decode

directory = Path(sys.argv[1])
directory.mkdir(parents=True, exist_ok=True)
parts = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "token_embd")
path, _ = write_tiny_gguf(directory, types=dict.fromkeys(parts, "F32"))
for kind in ("Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_XS", "IQ4_NL", "Q5_0", "Q5_1"):
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    out = directory / f"tiny.{kind}.gguf"
    if llama_cpp.llama_model_quantize(str(path).encode(), str(out).encode(), ctypes.byref(params)):
        print(kind, "llama.cpp could not write it")
        continue
    reader = gguf.GGUFReader(out)
    equal, unequal = collections.Counter(), []
    for tensor in reader.tensors:
        name = tensor.tensor_type.name
        if name not in FORMATS:
            continue
        rows, k = int(tensor.shape[1]), int(tensor.shape[0])
        raw = np.asarray(tensor.data).reshape(rows, -1)
        want = dequantize(raw, tensor.tensor_type).reshape(rows, k)
        if np.array_equal(decode(GGUFWeight(name, raw, k)).dequantize(), want):
            equal[name] += 1
        else:
            unequal.append(tensor.name)
    print(f"{kind} file: tensors equal to gguf's dequantisation {dict(equal)}; unequal {unequal}", flush=True)
