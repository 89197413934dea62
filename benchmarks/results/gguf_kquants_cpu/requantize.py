"""The default model's Q4_1 file requantized by llama.cpp (llama_model_quantize, as its
llama-quantize tool does; requantizing allowed) into the K-quant and IQ4 file kinds."""
import collections
import ctypes
import os
import sys

import gguf
import llama_cpp

src = sys.argv[1]
out = sys.argv[2]
kinds = sys.argv[3].split(",")
for kind in kinds:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    params.allow_requantize = True
    params.nthread = 2
    dst = f"{out}/SmolLM2-135M-Instruct.{kind}.gguf"
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    r = gguf.GGUFReader(dst)
    counts = collections.Counter(t.tensor_type.name for t in r.tensors)
    print(kind, "rc", rc, f"{os.path.getsize(dst)/1e6:.1f} MB", dict(counts), flush=True)
