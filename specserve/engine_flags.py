"""The engine's command-line flags, one per ``EngineConfig`` field: every command that
runs the engine (``generate``, ``serve``, ``tune``, ``bench``) takes them."""
from __future__ import annotations

import argparse
from dataclasses import fields

from specserve.config import DRAFT_QUANTIZATION, DRAFT_STOPPING, GGUF_WEIGHTS, KV_CACHE_DTYPES, SPECULATIVE_METHODS, EngineConfig
from specserve.logprobs import LOGPROBS_MODES

# The flags' destinations: EngineConfig's fields, so that one always matches the other.
ENGINE_FLAGS = tuple(f.name for f in fields(EngineConfig))


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """Add the engine's flags (and ``--config``, ``--quiet``) to ``parser``."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="local checkpoint directory, .gguf file or hub id "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--tokenizer", default=None, help="tokenizer to use instead of the model's")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    g.add_argument("--dtype", default="auto",
                   help="auto (bfloat16 on CUDA and on CPUs with native bf16 GEMM such as AMX, "
                        "else float32), float32, bfloat16, float16; float32 for bit-exact output")
    g.add_argument("--gguf-weights", default="auto", choices=GGUF_WEIGHTS,
                   help="a .gguf model's weights: quantized (kept in their blocks and run by the "
                        "C++ CPU kernels; llama architecture, Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, Q2_K-Q6_K, "
                        "IQ4_NL/IQ4_XS), "
                        "dequantized (to --dtype), or auto: quantized on a CPU where it can be "
                        "(default), else dequantized")
    g.add_argument("--seed", type=int, default=0,
                   help="random seed; the same seed gives the same sampled output (default: 0)")
    g.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="token budget per engine step, shared by decoding and prefill chunks")
    g.add_argument("--max-num-seqs", type=int, default=64, help="maximum requests per step")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="maximum prompt + output tokens (default: the model's maximum)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV-cache blocks (default: sized from the memory budget)")
    g.add_argument("--kv-cache-memory-gib", type=float, default=1.0,
                   help="KV-cache memory on CPU, in GiB (default: 1)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="the target's KV cache: auto (the model's dtype) or fp8 (float8 e4m3 with "
                        "per-layer scales calibrated at start: twice the tokens in the same memory, "
                        "at some accuracy; CUDA); default: auto")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.90,
                   help="fraction of GPU memory the engine may use (default: 0.9)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV cache of prompt prefixes already computed (shared system "
                        "prompts, earlier turns of a chat); default: on")
    g.add_argument("--cpu-threads", type=int, default=None, metavar="N",
                   help="CPU: intra-op threads (default: the cores this process may use, from its "
                        "CPU affinity and cgroup quota; OMP_NUM_THREADS if set)")
    g.add_argument("--attention-backend", default="auto", choices=("auto", "torch", "triton"),
                   help="attention kernels: triton on CUDA, torch (reference) on CPU (default: auto)")
    g.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False,
                   help="CUDA: run every step eagerly, no CUDA graphs (default: graphs for "
                        "decode/verify steps and for steps with prefill chunks)")
    g.add_argument("--cuda-graph-max-tokens", type=int, default=2048, metavar="N",
                   help="CUDA: steps with prefill chunks of up to N tokens in all replay ragged "
                        "CUDA graphs; longer ones, or all with 0, run eagerly (default: 2048)")
    g.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="split the model over N GPUs of this host, one process each (generate "
                        "and serve; the command starts them under torchrun itself; default: 1)")
    g.add_argument("--config", default=None, metavar="FILE",
                   help="YAML or JSON file of settings (any flag of this command, named as the "
                        "flag or with underscores); flags given on the command line win")
    g.add_argument("--logprobs-mode", default="raw_logprobs", choices=LOGPROBS_MODES,
                   help="what reported log-probabilities are: the model's own distribution "
                        "(raw_logprobs, default) or the one sampled from, after penalties, "
                        "logit_bias, temperature, top-k/top-p/min-p (processed_logprobs)")
    g.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=False,
                   help="batch-invariant kernels: each request's output (greedy tokens, logprobs) "
                        "is the same whatever else runs beside it, with or without speculation, in "
                        "bf16 too; costs some speed (default: off)")
    g.add_argument("-q", "--quiet", action="store_true", help="no start-up log or progress bars")
    s = parser.add_argument_group("speculative decoding")
    s.add_argument("--speculative-method", default="none", choices=SPECULATIVE_METHODS,
                   help="how draft tokens are proposed: ngram (prompt lookup), layerskip (the "
                        "target's first layers), draft_model (a separate checkpoint), quantized (the "
                        "target's own weights in 4/8 bits: a GGUF's blocks, else Q4_1 made at load; "
                        "CPU), mtp (the multi-token-prediction layer a target checkpoint carries, as "
                        "MiMo's); default: none")
    s.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="k, the most draft tokens per request per step (default: 6 for a draft model "
                        "planned on a GPU, with adaptive k, no paths and no tree; else 4)")
    s.add_argument("--speculative-adaptive", action=argparse.BooleanOptionalAction, default=True,
                   help="choose each request's k (up to --num-speculative-tokens) every step from "
                        "its measured acceptance and the measured step cost (default: on; "
                        "--no-speculative-adaptive drafts k for every request every step)")
    s.add_argument("--draft-stopping", default="auto", choices=DRAFT_STOPPING,
                   help="adaptive, with a draft model, EAGLE head or n-gram lookup: confidence (each "
                        "request stops drafting token by token by the draft's calibrated confidence; "
                        "n-gram: its match's length), plan (drafts "
                        "the k chosen before drafting), auto (confidence on a CPU, plan on a GPU; default)")
    s.add_argument("--draft-model", default=None,
                   help="draft checkpoint for --speculative-method draft_model (same vocabulary)")
    s.add_argument("--draft-quantization", default="auto", choices=DRAFT_QUANTIZATION,
                   help="draft_model on a CPU: the draft checkpoint's linear layers quantized at load to "
                        "Q8_0, Q4_1 or Q4_0 and run by the C++ kernels, or none; auto: Q4_1 where the "
                        "target runs from quantized weights (a .gguf model; AWQ/GPTQ), else none (default). Changes "
                        "which tokens the draft proposes, never the output")
    s.add_argument("--num-draft-paths", type=int, default=1,
                   help="draft_model / layerskip: draft paths a greedy request verifies per step, "
                        "1-4: its best guesses and up to 3 that take a runner-up candidate at one "
                        "depth (a static draft tree); each costs 1 + k more tokens (default: 1)")
    s.add_argument("--draft-tree-nodes", type=int, default=0,
                   help="draft_model (a draft checkpoint or EAGLE head) / layerskip / quantized: a dynamic "
                        "draft tree; beside its drafted chain of k a request verifies up to this many more "
                        "candidates (a greedy one's chain competing for the k + N places), chosen by the "
                        "draft's confidence (on a GPU: every depth's runner-up, then the next rank), in the "
                        "same pass, exactly (default: 0, off)")
    s.add_argument("--prompt-lookup-max", type=int, default=4, help="ngram: longest suffix matched (default: 4)")
    s.add_argument("--prompt-lookup-min", type=int, default=2, help="ngram: shortest suffix matched (default: 2)")
    s.add_argument("--layerskip-layers", type=int, default=None,
                   help="layerskip: target layers the draft runs (default: a quarter)")

