"""Engine configuration: one validated dataclass shared by the engine, CLI and server."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from specserve.distributed import check_tensor_parallel_size
from specserve.errors import SpecserveError
from specserve.logprobs import LOGPROBS_MODES
from specserve.models.packed_linear import bf16_packing_supported

SPECULATIVE_METHODS = ("none", "ngram", "draft_model", "layerskip", "quantized", "mtp")
# A .gguf model's weights: quantized (kept in their blocks, run by the C++ CPU kernels),
# dequantized (converted to the model's dtype), or auto (quantized on a CPU where it can).
GGUF_WEIGHTS = ("auto", "quantized", "dequantized")
# A draft checkpoint's float linear layers on the CPU: quantized at load to one of these GGUF
# kinds (run by the C++ kernels, one call per layer), kept as they are (none), or auto: the
# draft follows its target, quantized (AUTO_DRAFT_QUANTIZATION) where the target runs from
# quantized weights on a CPU. A draft's numerics change which tokens it proposes, never the output.
DRAFT_QUANTIZATION = ("auto", "none", "Q8_0", "Q4_1", "Q4_0")
AUTO_DRAFT_QUANTIZATION = "Q4_1"
DRAFT_STOPPING = ("auto", "confidence", "plan")
# The target's KV cache: the model's dtype (auto), or float8 e4m3 (fp8; fp8_e4m3 as vLLM
# spells it) with per-layer scales calibrated at start, half the bytes of bf16. A draft
# model's own cache keeps its dtype.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
PATH_METHODS = ("draft_model", "layerskip")  # drafters that rank candidates: num_draft_paths > 1
TREE_METHODS = (*PATH_METHODS, "quantized")   # draft models whose candidates grow a tree
# The most draft tokens a request may verify a step where num_speculative_tokens is not
# given (EngineConfig.max_draft_tokens): DEFAULT_DRAFT_TOKENS, or PLANNED_GPU_DRAFT_TOKENS
# where a GPU's controller plans a draft model's single chain.
DEFAULT_DRAFT_TOKENS = 4
PLANNED_GPU_DRAFT_TOKENS = 6

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


@dataclass
class EngineConfig:
    """Everything that shapes one engine instance.

    model: a local directory (config.json + safetensors + tokenizer), a ``.gguf`` file, a hub
    id (only where a network exists), or None for the embedded default model.
    """

    model: str | None = None
    tokenizer: str | None = None
    device: str = "auto"                 # auto | cpu | cuda | cuda:N
    dtype: str = "auto"                  # auto: bfloat16 on CUDA, float32 on CPU
    gguf_weights: str = "auto"           # a .gguf model: auto | quantized | dequantized (GGUF_WEIGHTS)
    seed: int = 0
    # Scheduling: one token budget per step shared by decode/verify and prefill chunks.
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int | None = None     # None: the model's max_position_embeddings
    # KV cache: fixed-size blocks sized from a memory budget.
    block_size: int = 16
    num_kv_blocks: int | None = None     # explicit override of the memory budget
    kv_cache_memory_gib: float = 1.0     # CPU budget for the KV cache
    kv_cache_dtype: str = "auto"         # auto (the model's dtype) | fp8 (KV_CACHE_DTYPES)
    # Reuse the KV of committed blocks across requests that start with the same tokens.
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.90  # CUDA: fraction of total memory the engine may use
    enforce_eager: bool = False          # CUDA: no CUDA graphs at all
    # CUDA: steps with prefill chunks of up to this many tokens (all requests together)
    # replay ragged CUDA graphs; longer ones, or all with 0, run eagerly.
    cuda_graph_max_tokens: int = 2048
    attention_backend: str = "auto"      # auto (triton on CUDA, torch on CPU) | torch | triton
    # CPU: intra-op threads. None: the cores this process may run on (its CPU affinity and
    # cgroup quota), unless OMP_NUM_THREADS says otherwise.
    cpu_threads: int | None = None
    # Tensor parallelism: the target model split over this many ranks (one process and
    # one GPU each, started by torchrun); rank 0 runs the engine (see tp_worker.py).
    tensor_parallel_size: int = 1
    # Speculation: a drafter proposes k tokens per running request, verified in the same pass.
    speculative_method: str = "none"     # none | ngram | draft_model | layerskip | quantized | mtp
    # k, the most draft tokens per request per step; None: chosen by max_draft_tokens.
    num_speculative_tokens: int | None = None
    speculative_adaptive: bool = True    # choose each request's k <= max_draft_tokens per step
    # Adaptive with a draft model, EAGLE head or n-gram lookup: "confidence" stops each request's
    # drafting token by token by the draft's calibrated confidence (n-gram: its match's
    # length; spec/stopping.py); "plan" drafts
    # what the controller planned; "auto": confidence on a CPU, plan on a GPU (DRAFT_STOPPING).
    draft_stopping: str = "auto"
    draft_model: str | None = None       # draft_model: checkpoint (same vocabulary as the target)
    draft_quantization: str = "auto"     # draft_model, CPU: auto | none | Q8_0 | Q4_1 | Q4_0 (DRAFT_QUANTIZATION)
    # draft_model / layerskip: draft paths a greedy request verifies per step — its best
    # guesses, and up to 3 more that take a runner-up candidate at one depth (a static
    # draft tree; see spec/paths.py). Each costs 1 + k more tokens a step.
    num_draft_paths: int = 1
    # draft_model (a checkpoint or an EAGLE head) / layerskip / quantized: a dynamic draft
    # tree. Beside its drafted chain of k a request verifies this many more of the draft's
    # candidates (a greedy one's chain competes with them for its k + N places), chosen
    # each step by the draft's confidence along the way (priced by the cost model where
    # drafting stops by confidence), all in one pass with tree attention, exactly
    # (spec/tree.py). On a GPU a greedy request's tree has a fixed shape instead: every
    # depth's runner-up, then the next rank, up to N. 0: off.
    draft_tree_nodes: int = 0
    prompt_lookup_max: int = 4           # ngram: longest suffix to match
    prompt_lookup_min: int = 2           # ngram: shortest suffix to match
    layerskip_layers: int | None = None  # layerskip: target layers the draft runs (default: 1/4)
    # What reported log-probabilities are: the model's own distribution (raw_logprobs) or
    # the one sampled from, after penalties, bias, temperature and filters (processed_logprobs).
    logprobs_mode: str = "raw_logprobs"
    # Batch-invariant kernels: a request's logits, and so its greedy tokens and logprobs, do
    # not depend on the other requests in its steps, on chunked prefill or on speculation
    # (draft length, drafter, acceptance), in bf16 as in float32.
    deterministic: bool = False

    def __post_init__(self) -> None:
        positive = ("max_num_batched_tokens", "max_num_seqs", "block_size")
        optional = ("max_model_len", "num_kv_blocks", "layerskip_layers", "cpu_threads")
        for name in positive + optional:
            value = getattr(self, name)
            if value is None and name in optional:
                continue
            if not _is_int(value) or value < 1:
                raise SpecserveError(f"{name} must be a positive integer, got {value!r}")
        if not _is_int(self.seed):
            raise SpecserveError(f"seed must be an integer, got {self.seed!r}")
        for name in ("kv_cache_memory_gib", "gpu_memory_utilization"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise SpecserveError(f"{name} must be a finite number, got {value!r}")
        for name in ("model", "tokenizer", "draft_model"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise SpecserveError(f"{name} must be a path or hub id, got {value!r}")
        if self.block_size & (self.block_size - 1):
            raise SpecserveError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise SpecserveError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise SpecserveError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0 < self.kv_cache_memory_gib:
            raise SpecserveError(f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise SpecserveError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise SpecserveError("attention_backend must be 'auto', 'torch' or 'triton', "
                                 f"got {self.attention_backend!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise SpecserveError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                                 f"got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype != "auto" and self.tensor_parallel_size != 1:
            raise SpecserveError(f"kv_cache_dtype {self.kv_cache_dtype} does not run under tensor "
                                 "parallelism yet (its scales are calibrated on one rank)")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise SpecserveError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, "
                                 f"got {self.logprobs_mode!r}")
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise SpecserveError(f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                                 f"got {self.speculative_method!r}")
        if not _is_int(self.cuda_graph_max_tokens) or self.cuda_graph_max_tokens < 0:
            raise SpecserveError(f"cuda_graph_max_tokens must be an integer >= 0, got {self.cuda_graph_max_tokens!r}")
        if not isinstance(self.enforce_eager, bool):
            raise SpecserveError(f"enforce_eager must be true or false, got {self.enforce_eager!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise SpecserveError(f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}")
        if self.gguf_weights not in GGUF_WEIGHTS:
            raise SpecserveError(f"gguf_weights must be one of {', '.join(GGUF_WEIGHTS)}, got {self.gguf_weights!r}")
        if not isinstance(self.deterministic, bool):
            raise SpecserveError(f"deterministic must be true or false, got {self.deterministic!r}")
        if self.draft_stopping not in DRAFT_STOPPING:
            raise SpecserveError(f"draft_stopping must be one of {', '.join(DRAFT_STOPPING)}, "
                                 f"got {self.draft_stopping!r}")
        if not isinstance(self.speculative_adaptive, bool):
            raise SpecserveError(f"speculative_adaptive must be true or false, got {self.speculative_adaptive!r}")
        if self.num_speculative_tokens is not None and (
                not _is_int(self.num_speculative_tokens) or not 0 <= self.num_speculative_tokens <= 32):
            raise SpecserveError(f"num_speculative_tokens must be in [0, 32], got {self.num_speculative_tokens!r}")
        if not (_is_int(self.prompt_lookup_min) and _is_int(self.prompt_lookup_max)
                and 1 <= self.prompt_lookup_min <= self.prompt_lookup_max):
            raise SpecserveError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                                 f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.layerskip_layers is not None and self.layerskip_layers < 1:
            raise SpecserveError(f"layerskip_layers must be >= 1, got {self.layerskip_layers}")
        if not _is_int(self.num_draft_paths) or not 1 <= self.num_draft_paths <= 4:
            raise SpecserveError(f"num_draft_paths must be in [1, 4], got {self.num_draft_paths!r}")
        if self.num_draft_paths > 1 and self.speculative_method not in PATH_METHODS:
            raise SpecserveError(f"num_draft_paths {self.num_draft_paths} needs speculative_method "
                                 f"draft_model or layerskip (a drafter that ranks candidates), "
                                 f"not {self.speculative_method!r}")
        if not _is_int(self.draft_tree_nodes) or not 0 <= self.draft_tree_nodes <= 32:
            raise SpecserveError(f"draft_tree_nodes must be in [0, 32], got {self.draft_tree_nodes!r}")
        if self.draft_tree_nodes:
            if self.speculative_method not in TREE_METHODS:
                raise SpecserveError(f"draft_tree_nodes {self.draft_tree_nodes} needs speculative_method "
                                     f"{', '.join(TREE_METHODS)} (a draft model that ranks candidates), "
                                     f"not {self.speculative_method!r}")
            if self.num_draft_paths > 1:
                raise SpecserveError("draft_tree_nodes and num_draft_paths > 1 are two draft trees; choose one")
            if self.tensor_parallel_size != 1:
                raise SpecserveError("draft_tree_nodes is not supported with tensor parallelism yet")
        if self.speculative_method == "quantized" and self.gguf_weights == "quantized":
            raise SpecserveError("speculative_method 'quantized' drafts with the target's quantized weights for "
                                 "its full-precision ones: gguf_weights must not be 'quantized'")
        if self.draft_model is not None and self.speculative_method != "draft_model":
            raise SpecserveError("draft_model is set but speculative_method is not 'draft_model'")
        if self.draft_quantization not in DRAFT_QUANTIZATION:
            raise SpecserveError(f"draft_quantization must be one of {', '.join(DRAFT_QUANTIZATION)}, "
                                 f"got {self.draft_quantization!r}")
        if self.draft_quantization not in ("auto", "none") and self.speculative_method != "draft_model":
            raise SpecserveError(f"draft_quantization {self.draft_quantization} quantizes a draft checkpoint: it "
                                 f"needs speculative_method 'draft_model', not {self.speculative_method!r}")
        _ = self.torch_device  # raises on a bad or unavailable device
        check_tensor_parallel_size(self.tensor_parallel_size, self.device)
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise SpecserveError(
                f"dtype must be 'auto' or one of {sorted(set(_DTYPES))}, got {self.dtype!r}")
        if self.deterministic:
            self._check_deterministic()

    def _check_deterministic(self) -> None:
        if self.tensor_parallel_size > 2:
            # Two ranks' partial sums add the same either way round (a + b = b + a); with
            # more, the all-reduce's order follows its chunking, which follows the batch.
            raise SpecserveError("deterministic mode supports tensor_parallel_size 1 or 2, got "
                                 f"{self.tensor_parallel_size}")
        if self.torch_device.type == "cpu" and self.torch_dtype == torch.float16:
            raise SpecserveError("deterministic mode on a CPU runs bfloat16 or float32, not float16")

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    @property
    def speculation_enabled(self) -> bool:
        return self.speculative_method != "none" and self.max_draft_tokens > 0

    @property
    def max_draft_tokens(self) -> int:
        """k as the engine runs it: ``num_speculative_tokens`` where given, else
        ``default_draft_tokens`` for this device and these settings."""
        if self.num_speculative_tokens is not None:
            return self.num_speculative_tokens
        return default_draft_tokens(self.torch_device.type, self.speculative_method, self.speculative_adaptive,
                                    self.draft_stopping, self.num_draft_paths, self.draft_tree_nodes)

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            device = torch.device(self.device)
        except RuntimeError:
            raise SpecserveError(f"device must be auto, cpu or cuda[:N], got {self.device!r}") from None
        if device.type not in ("cpu", "cuda"):
            raise SpecserveError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise SpecserveError("device 'cuda' was asked for but no CUDA GPU is available")
        return device

    @property
    def torch_dtype(self) -> torch.dtype:
        """``auto``: bfloat16 on CUDA, and on CPUs with native bf16 GEMM (AMX / AVX-512
        BF16), where it is much faster; float32 elsewhere."""
        if self.dtype == "auto":
            if self.torch_device.type == "cuda":
                return torch.bfloat16
            return torch.bfloat16 if bf16_packing_supported() else torch.float32
        return _DTYPES[self.dtype]

    def kv_torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The target's KV cache dtype: float8 e4m3 for ``fp8``, else the model's."""
        return model_dtype if self.kv_cache_dtype == "auto" else torch.float8_e4m3fn

    @property
    def target_gguf_weights(self) -> str:
        """``gguf_weights`` for the target: ``auto`` keeps a GGUF quantized, except when the
        quantized copy is the draft (``speculative_method`` 'quantized'): the target then
        runs dequantised, so that the two differ."""
        if self.gguf_weights == "auto" and self.speculative_method == "quantized":
            return "dequantized"
        return self.gguf_weights


def default_draft_tokens(device_type: str, method: str, adaptive: bool, draft_stopping: str,
                         num_draft_paths: int, draft_tree_nodes: int) -> int:
    """The cap on a request's draft length where the user set none. On a GPU, where the
    controller plans each request's k (adaptive, ``draft_stopping`` auto or plan) for a
    draft model's single chain, ``PLANNED_GPU_DRAFT_TOKENS``: at small batches a verify
    token costs next to nothing there, and the plan, which prices every draft it chooses,
    was held below the best fixed k on code by a cap of 4, and ran about level with it on
    chat and under load at 6 (``benchmarks/results/per_token_drafting/harness_2026-12-07/``). Elsewhere
    ``DEFAULT_DRAFT_TOKENS``: on a CPU drafts cost more, a fixed k would draft the cap on
    every step, prompt lookup with a higher cap lost with chat queued on a GPU, and draft
    paths and trees spend 1 + k tokens a path."""
    planned_chain = (adaptive and draft_stopping != "confidence" and method == "draft_model"
                     and num_draft_paths == 1 and not draft_tree_nodes)
    return PLANNED_GPU_DRAFT_TOKENS if device_type == "cuda" and planned_chain else DEFAULT_DRAFT_TOKENS


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
