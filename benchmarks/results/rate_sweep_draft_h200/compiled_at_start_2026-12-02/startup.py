"""Start-up time of an engine with and without ModelRunner.compile_kernels: the default
model's shapes with random weights (bf16), speculation off, a fresh process per trial and
Triton's disk cache warm (a first, untimed start fills it)."""
import json, os, subprocess, sys, time

W = "/tmp/rand_smollm2"
DEVICE = os.environ.get("DEVICE", "cuda")
mode = sys.argv[1] if len(sys.argv) > 1 else "driver"
if mode == "driver":
    if not os.path.exists(W):
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        sys.path.insert(0, "tests")
        from tiny_models import make_tokenizer
        cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                          rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)
        torch.manual_seed(0)
        LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(W)
        make_tokenizer(1000).save_pretrained(W)
    out = {}
    for trial in ("with", "with", "without", "with", "without", "with", "without"):
        r = subprocess.run([sys.executable, __file__, trial], capture_output=True, text=True, timeout=150)
        line = [l for l in r.stdout.splitlines() if l.startswith("RESULT")]
        logs = [l for l in r.stderr.splitlines() if "compiled the" in l or "captured" in l]
        print(trial, line[-1] if line else r.stderr[-600:], *logs, flush=True)
        out.setdefault(trial, []).append(float(line[-1].split()[1]) if line else None)
    json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "startup.json"), "w"))
else:
    import logging
    logging.basicConfig(level=logging.INFO)
    from specserve.model_runner import ModelRunner
    if mode == "without":
        ModelRunner.compile_kernels = lambda self, max_model_len: 0
    from specserve.engine import LLMEngine
    t = time.perf_counter()
    LLMEngine(model=W, device=DEVICE, max_model_len=4096, speculative_method="none")
    print("RESULT", round(time.perf_counter() - t, 2), flush=True)
