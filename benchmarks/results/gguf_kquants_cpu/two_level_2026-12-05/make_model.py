"""A random llama whose every projection is 256-wide (hidden 2048, intermediate 5632, 6 layers,
16 heads of 128, 4 KV heads; ~270 M weights), written as a float32 GGUF by the tests' writer
and quantized by llama.cpp into Q4_K_M and Q6_K files, where nothing falls back to another
format (the default model's 576-wide rows do). Its weights are larger than a cache holds.

    PYTHONPATH=.:tests python make_model.py DIR
"""
import ctypes
import sys
from pathlib import Path

import llama_cpp
import tiny_models

directory = Path(sys.argv[1])
directory.mkdir(parents=True, exist_ok=True)
tiny_models.TINY_GGUF.update(hidden_size=2048, intermediate_size=5632, num_hidden_layers=6, num_attention_heads=16,
                             num_key_value_heads=4, max_position_embeddings=1024)
parts = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "token_embd")
path, _ = tiny_models.write_tiny_gguf(directory, types=dict.fromkeys(parts, "F32"))
for kind in ("Q4_K_M", "Q6_K"):
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    out = directory / f"wide.{kind}.gguf"
    assert llama_cpp.llama_model_quantize(str(path).encode(), str(out).encode(), ctypes.byref(params)) == 0, kind
    print(out, out.stat().st_size // 2**20, "MiB")
