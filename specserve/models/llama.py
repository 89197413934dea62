"""Llama-family decoder over a flattened ragged batch (``[num_tokens]``, no padding).

One implementation covers Llama 2/3, SmolLM2, Mistral (sliding window), Qwen2 (qkv bias),
Qwen3 (per-head q/k RMSNorm), Phi-3/Phi-4 (projections stored merged, partial rotary),
Gemma 1/2/3 (their norms, GeGLU, Gemma 2's soft-capped attention, Gemma 3's local rope)
and the mixtures of experts Mixtral, Qwen2-MoE and Qwen3-MoE (``moe.py`` in place of the
MLP); ``ArchSpec`` records how they differ. Q/K/V and gate/up projections are merged at
load time so each is one matmul.

With a tensor-parallel group of several ranks each rank builds only its shard
(``parallel.py``): its heads, its MLP rows, its vocabulary rows, and one all-reduce
after o_proj and after down_proj. A group of one builds the whole model and runs no
collective.

The glue between the matmuls (norms, activation, rotary, KV store) runs through the
model's ``LayerOps`` (``layer_ops.py``): torch on CPU, fused Triton kernels with the Triton
backend. Layers hand back ``(hidden, residual)`` un-added, so each residual add is fused
into the next norm (the last one into the final norm).
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import islice

import torch
from torch import nn

from specserve.attention import AttentionBackend
from specserve.batch import ForwardBatch
from specserve.distributed import SINGLE, TPGroup
from specserve.errors import ModelLoadError
from specserve.models.checkpoint_quant import Fp8Rows
from specserve.models.layer_ops import LayerOps, layer_ops_for
from specserve.models.mlp import MLP
from specserve.models.moe import SparseMoE, is_sparse_layer
from specserve.models.parallel import ShardLayout, VocabParallelEmbedding
from specserve.models.rotary import (Rotary, global_rope_config, head_dim_of, local_rope_config,  # noqa: F401
                                     rope_parameters, rotary_order)  # (head_dim_of, rope_parameters: re-exported)


@dataclass(frozen=True)
class ArchSpec:
    qkv_bias: bool | None = None   # None: follow config.attention_bias
    o_bias: bool | None = None
    qk_norm: bool = False
    moe: bool = False              # top-k routed experts in place of the MLP (models/moe.py)
    # Gemma: (1 + weight) norms, embeddings scaled by √hidden.
    gemma: bool = False
    # Gemma 2/3: the attention's and the MLP's outputs normed too (pre/post-feedforward).
    sandwich: bool = False
    # Checkpoint tensors under this prefix are the checkpoint's own multi-token-prediction
    # layers (MiMo's ``model.mtp_layers.``): a draft (``speculative_method "mtp"``), not
    # part of the model, which leaves them to it.
    mtp_prefix: str | None = None


class RMSNorm(nn.Module):
    """``gemma``: Gemma's norm, ``(1 + weight)`` in fp32 (``reference.gemma_rms_norm``)."""

    def __init__(self, dim: int, eps: float, ops: LayerOps, gemma: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops
        self._norm = ops.gemma_rms_norm if gemma else ops.rms_norm
        self._add_norm = ops.gemma_add_rms_norm if gemma else ops.add_rms_norm
        self.fp8_group = 0  # its output rounded to float8 in groups of this many for its consumer (``hand_fp8``)

    def hand_fp8(self, consumer: nn.Module) -> None:
        """Hand ``consumer``, this norm's only reader, its output rounded to float8
        (``Fp8Rows``) where it takes it so (``Fp8Linear.input_group``), reads exactly this
        norm's output (not, as EAGLE-3's first layer, the norm's output beside another),
        and the ops can."""
        group = getattr(consumer, "input_group", None)
        width = self.weight.shape[0]
        takes = group and getattr(consumer, "in_features", None) == width
        self.fp8_group = group if takes and self.ops.fp8_fusable(width, group) else 0

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``norm(x)``; with ``residual``, ``(norm(x + residual), x + residual)``. With
        ``fp8_group``, ``norm(…)`` comes as ``Fp8Rows``."""
        if not self.fp8_group:
            if residual is None:
                return self._norm(x, self.weight, self.eps)
            return self._add_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return Fp8Rows(*self._norm(x, self.weight, self.eps, fp8_group=self.fp8_group), self.fp8_group, x.dtype)
        (q, scales), residual = self._add_norm(x, residual, self.weight, self.eps, fp8_group=self.fp8_group)
        return Fp8Rows(q, scales, self.fp8_group, x.dtype), residual


class Attention(nn.Module):
    """This rank's heads: ``num_heads`` / ``num_kv_heads`` count the local ones."""

    def __init__(self, config, spec: ArchSpec, layer_idx: int, backend: AttentionBackend,
                 ops: LayerOps, layout: ShardLayout, tp: TPGroup) -> None:
        super().__init__()
        self.num_heads = layout.local_heads
        self.num_kv_heads = layout.local_kv_heads
        self.head_dim = layout.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = bias if spec.qkv_bias is None else spec.qkv_bias
        o_bias = bias if spec.o_bias is None else spec.o_bias
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops, spec.gemma) if spec.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops, spec.gemma) if spec.qk_norm else None
        self.scale = (getattr(config, "query_pre_attn_scalar", None) or self.head_dim) ** -0.5
        self.softcap = getattr(config, "attn_logit_softcapping", None) or None  # Gemma 2
        # A float8 KV cache's scales for this layer's K and V (ModelRunner.calibrate_kv_scales).
        self.kv_scales = (1.0, 1.0)
        self.sliding_window = _sliding_window(config, layer_idx)
        # A model with a rope per layer type (Gemma 3) gives sliding layers the local one.
        self.local_rope = local_rope_config(config) is not None and self.sliding_window is not None
        self.rotary_order = rotary_order(config)  # partial rotary: q/k dimensions reordered at load
        self.backend = backend
        self.ops = ops
        self.tp = tp

    def finish_loading(self) -> None:
        """Under partial rotary, reorder each q and k head's rows (and their norms' weights)
        by ``rotary_order``, so the kernels' whole-head rotation rotates just the stored
        rotary dimensions (``models/rotary.py``)."""
        order = self.rotary_order
        if order is None:
            return
        order = torch.tensor(order, device=self.qkv_proj.weight.device)
        with torch.no_grad():
            for param in (self.qkv_proj.weight, self.qkv_proj.bias):
                if param is not None:
                    heads = param[:self.q_size + self.kv_size].unflatten(0, (-1, self.head_dim))
                    heads.copy_(heads[:, order])
            for norm in (self.q_norm, self.k_norm):
                if norm is not None:
                    norm.weight.copy_(norm.weight[order])

    def forward(self, hidden: torch.Tensor, rotary_tables,
                kv_cache: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch) -> torch.Tensor:
        qkv = self.qkv_proj(hidden).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk, v = qkv[:, :self.num_heads + self.num_kv_heads], qkv[:, self.num_heads + self.num_kv_heads:]
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :self.num_heads]), self.k_norm(qk[:, self.num_heads:])), dim=1)
        q = self.ops.rotary_store_kv(qk, v, rotary_tables, kv_cache, batch, self.kv_scales)
        k_cache, v_cache = kv_cache
        out = self.backend.attend(q, k_cache, v_cache, batch, self.scale, self.sliding_window, self.softcap,
                                  self.kv_scales)
        return self.tp.all_reduce(self.o_proj(out.reshape(-1, self.q_size)))


def _sliding_window(config, layer_idx: int) -> int | None:
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window and layer_types is not None and layer_types[layer_idx] != "sliding_attention":
        return None
    return window or None


class DecoderLayer(nn.Module):
    def __init__(self, config, spec: ArchSpec, layer_idx: int, backend: AttentionBackend,
                 ops: LayerOps, layout: ShardLayout, tp: TPGroup) -> None:
        super().__init__()
        self.self_attn = Attention(config, spec, layer_idx, backend, ops, layout, tp)
        if spec.moe and is_sparse_layer(config, layer_idx):
            self.mlp = SparseMoE(config, ops, tp)
        else:
            self.mlp = MLP(config, ops, layout.local_intermediate, tp)
        norm = lambda: RMSNorm(config.hidden_size, config.rms_norm_eps, ops, spec.gemma)  # noqa: E731
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.sandwich = spec.sandwich
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()

    def linears_replaced(self) -> None:
        """Its projections may now be float8 layers that round their inputs at run time:
        the norm before each, its only reader, hands it its input rounded (``hand_fp8``),
        saving the projection's quantizer launch (MLP's down projection: ``MLP``'s); Gemma
        2/3's MLP reads the second of its two norms (pre-feedforward). Not where the layer's
        first norm is not one (EAGLE-1's first layer adds the residual instead), nor before
        a mixture of experts (its router reads the norm's output too)."""
        if isinstance(self.input_layernorm, RMSNorm):
            self.input_layernorm.hand_fp8(self.self_attn.qkv_proj)
        if isinstance(self.mlp, MLP):
            norm = self.pre_feedforward_layernorm if self.sandwich else self.post_attention_layernorm
            norm.hand_fp8(self.mlp.gate_up_proj)

    def forward(self, hidden, residual, rotary_tables, kv_cache, batch):
        """The residual stream is ``hidden + residual`` (``residual`` None: just ``hidden``,
        the first layer); returns the next layer's ``(hidden, residual)``, not yet added."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rotary_tables, kv_cache, batch)
        if self.sandwich:
            hidden, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(hidden), residual)
            return self.post_feedforward_layernorm(self.mlp(hidden)), residual
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config, spec: ArchSpec, backend: AttentionBackend, layout: ShardLayout,
                 tp: TPGroup) -> None:
        super().__init__()
        self.ops = layer_ops_for(backend)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size) if tp.size == 1 \
            else VocabParallelEmbedding(layout, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, spec, i, backend, self.ops, layout, tp)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, self.ops, spec.gemma)
        max_positions = config.max_position_embeddings if self.ops.fused else None
        local = local_rope_config(config)
        self.rotary = Rotary(global_rope_config(config), max_positions)
        self.rotary_local = Rotary(local, max_positions) if local is not None else None
        if self.rotary_local is not None and (self.rotary.long_offset or self.rotary_local.long_offset):
            raise ModelLoadError("LongRoPE with a rope per layer type is not supported")
        # Gemma scales the embeddings by √hidden, rounded to their dtype as transformers does.
        self.embed_scale = config.hidden_size ** 0.5 if spec.gemma else None
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        if getattr(config, "use_bidirectional_attention", False):
            raise ModelLoadError("bidirectional attention (use_bidirectional_attention) is not supported")


class LlamaForCausalLM(nn.Module):
    """``forward`` returns final hidden states ``[num_tokens, hidden]``;
    ``compute_logits`` maps the rows that need them to ``[num_rows, vocab]`` (on every
    rank of a tensor-parallel group). ``tp``: the group; this rank builds its shard."""

    def __init__(self, config, spec: ArchSpec, backend: AttentionBackend, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.layout = ShardLayout.of(config, tp)
        self.model = LlamaModel(config, spec, backend, self.layout, tp)
        self.attention_backend = backend
        self.lm_head = nn.Linear(config.hidden_size, self.layout.vocab_rows, bias=False)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.mtp_prefix = spec.mtp_prefix

    def tie_weights(self) -> None:
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], batch: ForwardBatch,
                num_layers: int | None = None) -> torch.Tensor:
        """``num_layers`` stops after the first layers (the layer-skip draft), then norms."""
        hidden = self.model.embed_tokens(input_ids)
        if self.model.embed_scale is not None:
            hidden = hidden * torch.tensor(self.model.embed_scale, dtype=hidden.dtype)
        return self.decode(hidden, positions, kv_caches, batch, num_layers)

    def fused_logits(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], batch: ForwardBatch) -> torch.Tensor | None:
        """The float32 logits of ``batch.logits_indices`` from one C++ call over the whole
        pass where the model runs that way (``FusedCpuLayers.logits``), else None: also for
        a model whose own pass is not this class's (an EAGLE or MTP head's)."""
        cls = type(self)
        if (self.fused_cpu is None or cls.forward is not LlamaForCausalLM.forward
                or cls.compute_logits is not LlamaForCausalLM.compute_logits):
            return None
        return self.fused_cpu.logits(self, kv_caches, batch)

    def decode(self, hidden: torch.Tensor, positions: torch.Tensor,
               kv_caches: list[tuple[torch.Tensor, torch.Tensor]], batch: ForwardBatch,
               num_layers: int | None = None) -> torch.Tensor:
        """The decoder layers and the final norm over input vectors ``hidden``."""
        ops = self.model.ops
        rotary_tables = ops.rotary_tables(self.model.rotary, positions, hidden.dtype)
        local_tables = rotary_tables
        if self.model.rotary_local is not None:
            local_tables = ops.rotary_tables(self.model.rotary_local, positions, hidden.dtype)
        fused = self.fused_cpu is not None and self.fused_cpu.covers(batch)
        last = len(range(len(self.model.layers))[:num_layers])  # (a ModuleList's slice is a new module: slow)
        taps = self.feature_layers if num_layers is None and self.feature_layers else ()
        residual, start, features = None, 0, []
        for stop in (*taps, last):  # the layers in runs, the residual stream read between them
            if fused:
                hidden, residual = self.fused_cpu.run(hidden, residual, rotary_tables, kv_caches, batch, start, stop)
            else:
                for layer, kv_cache in zip(islice(self.model.layers, start, stop), kv_caches[start:stop]):
                    tables = local_tables if layer.self_attn.local_rope else rotary_tables
                    hidden, residual = layer(hidden, residual, tables, kv_cache, batch)
            if len(features) < len(taps):
                features.append(hidden if residual is None else hidden + residual)
            start = stop
        if taps:
            self.features = torch.cat(features, dim=-1)
        if residual is None:  # no layer ran
            return self.model.norm(hidden)
        return self.model.norm(hidden, residual)[0]

    # The layers whose input (the residual stream there; layer 0: the embeddings) an EAGLE-3
    # head reads, ascending (set by its drafter, ``drafts/eagle.py``), or None. Each pass
    # then leaves them concatenated, ``[num_tokens, len(feature_layers) * hidden]``, in
    # ``features``: ``kept_rows`` hands them to the runner in place of the final hidden states.
    feature_layers: tuple[int, ...] | None = None
    features: torch.Tensor | None = None

    def kept_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """What a runner that keeps each pass's rows for a drafter keeps: the final hidden
        states ``hidden`` of the pass just run, or the feature layers' states."""
        return self.features if self.feature_layers else hidden

    # Every layer in one C++ call where the model allows it (models/fused_cpu.py; set at load).
    fused_cpu = None

    # A draft may propose among a subset of the vocabulary only (``restrict_vocab``).
    vocab_ids: torch.Tensor | None = None

    def restrict_vocab(self, ids: torch.Tensor) -> bool:
        """Let a draft propose only token ids ``ids`` (the tokens its target writes most,
        as FR-Spec): its LM head becomes those rows of its own, and every other token gets
        logit -inf — probability 0 in q, never proposed, so verification stays exact. On a
        CPU the full LM head is most of a draft step's cost. Returns False (the full head
        kept) where the head's weights cannot be read: an untied head already repacked."""
        if hasattr(self.lm_head, "select_rows"):  # quantized: its rows, still quantized
            self.vocab_head = self.lm_head.select_rows(ids)
            self.vocab_ids = ids.to(dtype=torch.int64).contiguous()
            return True
        if isinstance(self.lm_head, nn.Linear):
            weight = self.lm_head.weight
        elif self.tie_word_embeddings:
            weight = self.model.embed_tokens.weight
        else:
            return False
        ids = ids.to(device=weight.device, dtype=torch.int64)
        head = nn.Linear(weight.shape[1], len(ids), bias=False, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            head.weight.copy_(weight.index_select(0, ids))
        # The same kind of layer as the full head (prepacked, batch-invariant or plain).
        self.vocab_head = head if isinstance(self.lm_head, nn.Linear) else type(self.lm_head)(head)
        self.vocab_ids = ids
        return True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.vocab_ids is not None:
            out = hidden.new_full((hidden.shape[0], self.config.vocab_size), float("-inf"), dtype=torch.float32)
            return out.index_copy_(1, self.vocab_ids, self._softcap(self.vocab_head(hidden).float()))
        logits = self._softcap(self.lm_head(hidden))
        if self.tp.size == 1:
            return logits
        return self.tp.gather_last_dim(logits)[:, :self.config.vocab_size]

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        """``cap · tanh(logits / cap)`` (``final_logit_softcapping``, Gemma 2), else as they are."""
        cap = self.model.final_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap

    # Checkpoint name -> (our parameter, shard index) for the merged projections.
    STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
               "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    # Projections a checkpoint may store merged already (Phi-3): their parts, in order.
    FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    # Checkpoint names written another way, old part -> new, in names with RENAMED_UNDER (Mixtral's experts).
    RENAMED_UNDER = "block_sparse_moe"
    RENAMED = {"block_sparse_moe": "mlp", "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}

    def checkpoint_name(self, name: str) -> str | None:
        """A checkpoint tensor's name as this model's checkpoints write it (a layout that
        names tensors otherwise maps them here); None: a tensor the checkpoint holds for
        another model (its MTP draft layers), left to it."""
        if self.mtp_prefix and name.startswith(self.mtp_prefix):
            return None
        return name

    # Checkpoint tensors that are no weights but index tables the model keeps as stored,
    # in ``index_tables`` (an EAGLE-3 head's d2t / t2d), checked by its ``finish_loading``.
    INDEX_TABLES: frozenset[str] = frozenset()

    def shard_range(self, param_name: str, shard: int) -> tuple[int, int]:
        """Row range of shard ``shard`` inside merged parameter ``param_name`` (this
        rank's rows: the checkpoint tensor is cut to them by ``layout.shard``)."""
        return _part_range(self.merged_sizes(param_name), shard)

    def merged_sizes(self, param_name: str, whole: bool = False) -> list[int]:
        """The parts' rows of merged parameter ``param_name`` on this rank (``whole``: in
        the whole model, as a checkpoint stores them merged)."""
        owner = self.get_submodule(param_name.rsplit(".", 2)[0])
        if ".qkv_proj." in param_name:
            heads, kv_heads = owner.num_heads, owner.num_kv_heads
            if whole:
                heads, kv_heads = self.config.num_attention_heads, self.config.num_key_value_heads
            return [heads * owner.head_dim, kv_heads * owner.head_dim, kv_heads * owner.head_dim]
        rows = owner.intermediate_size * (self.tp.size if whole else 1)
        return [rows, rows]


def _part_range(sizes: list[int], part: int) -> tuple[int, int]:
    start = sum(sizes[:part])
    return start, start + sizes[part]
