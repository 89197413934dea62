"""How a Llama-family model is split over the ranks of a tensor-parallel group.

Megatron-style, two collectives per layer:

* column-parallel: the merged QKV projection holds this rank's ``[q heads | k heads |
  v heads]`` and gate/up this rank's ``[gate rows | up rows]``, so attention and the
  activation run on local heads / rows with no communication;
* row-parallel: o_proj and down_proj hold the matching input columns; each rank's
  output is a partial sum, made whole by one all-reduce (a bias is added on rank 0 only);
* KV heads are split like the query heads they serve; with fewer KV heads than ranks
  each rank keeps the one KV head its query heads use (replicated), so the KV cache of
  a rank holds only the heads it attends with;
* vocab-parallel: embedding and LM head hold a contiguous range of vocabulary rows
  (the last rank's range padded with zero rows when the size does not divide); the
  embedding masks tokens it does not own and all-reduces, the LM head's logits are
  gathered and the padding cut off.

Each rank slices the checkpoint's full tensors as they stream in (``ShardLayout.shard``),
keeping only its own shard. Norms (and q/k norms) are replicated.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specserve.distributed import SINGLE, TPGroup
from specserve.errors import SpecserveError
from specserve.models.rotary import head_dim_of


def check_tensor_parallel(config, size: int) -> None:
    """Refuse a model that ``size`` ranks cannot split evenly (SpecserveError)."""
    if size == 1:
        return
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % size:
        raise SpecserveError(f"tensor_parallel_size {size} must divide the model's "
                             f"{heads} attention heads")
    if kv_heads % size and size % kv_heads:
        raise SpecserveError(f"the model's {kv_heads} KV heads can be neither split over nor "
                             f"replicated across {size} ranks")
    for name in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        rows = getattr(config, name, None) or 0
        if rows % size:
            raise SpecserveError(f"tensor_parallel_size {size} must divide the model's "
                                 f"{name.replace('_', ' ')} {rows}")


@dataclass(frozen=True)
class ShardLayout:
    """Which heads, MLP rows and vocabulary rows rank ``rank`` of ``size`` holds."""

    rank: int
    size: int
    num_heads: int             # the model's, all ranks together
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def of(cls, config, tp: TPGroup = SINGLE) -> "ShardLayout":
        check_tensor_parallel(config, tp.size)
        return cls(tp.rank, tp.size, config.num_attention_heads, config.num_key_value_heads,
                   head_dim_of(config), config.intermediate_size, config.vocab_size)

    # ------------------------------------------------------------------ per-rank sizes
    @property
    def local_heads(self) -> int:
        return self.num_heads // self.size

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.size)

    @property
    def local_intermediate(self) -> int:
        return self.intermediate_size // self.size

    @property
    def vocab_rows(self) -> int:
        """Rows of the embedding / LM head per rank (the vocabulary rounded up)."""
        return -(-self.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows

    # ------------------------------------------------------------------ slices
    def q_rows(self) -> slice:
        """This rank's rows of q_proj (and columns of o_proj)."""
        start = self.rank * self.local_heads * self.head_dim
        return slice(start, start + self.local_heads * self.head_dim)

    def kv_rows(self) -> slice:
        """This rank's rows of k_proj / v_proj: its share of the KV heads, or with fewer
        KV heads than ranks the one KV head its query heads belong to."""
        if self.num_kv_heads >= self.size:
            first = self.rank * self.local_kv_heads
        else:
            first = self.rank * self.num_kv_heads // self.size
        return slice(first * self.head_dim, (first + self.local_kv_heads) * self.head_dim)

    def mlp_rows(self, intermediate: int | None = None) -> slice:
        """This rank's rows of gate_proj / up_proj (and columns of down_proj), of a dense
        MLP or of an MLP of ``intermediate`` rows (an expert's)."""
        local = (intermediate or self.intermediate_size) // self.size
        return slice(self.rank * local, (self.rank + 1) * local)

    def shard(self, param_name: str, index: int | None, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of checkpoint tensor ``tensor`` bound for our parameter
        ``param_name`` (``index``: q/k/v = 0/1/2, gate/up = 0/1 within a merged one)."""
        if self.size == 1:
            return tensor
        if ".qkv_proj." in param_name:
            return tensor[self.q_rows() if index == 0 else self.kv_rows()]
        if ".gate_up_proj." in param_name:  # gate or up: its own rows, a dense MLP's or an expert's
            return tensor[self.mlp_rows(tensor.shape[0])]
        if param_name.endswith((".o_proj.weight", ".down_proj.weight")):
            return tensor[:, self.q_rows() if ".o_proj." in param_name else self.mlp_rows(tensor.shape[1])]
        if param_name.endswith((".o_proj.bias", ".down_proj.bias")):
            return tensor if self.rank == 0 else torch.zeros_like(tensor)  # summed once
        if param_name in ("model.embed_tokens.weight", "lm_head.weight"):
            rows = tensor[self.vocab_start:self.vocab_start + self.vocab_rows]
            if rows.shape[0] < self.vocab_rows:
                rows = torch.cat((rows, rows.new_zeros(self.vocab_rows - rows.shape[0], *rows.shape[1:])))
            return rows
        return tensor  # norms: replicated


class VocabParallelEmbedding(nn.Module):
    """The embedding rows ``[vocab_start, vocab_start + vocab_rows)``: tokens owned by
    another rank embed to zero here, and the all-reduce sums each token's one owner."""

    def __init__(self, layout: ShardLayout, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.start, self.rows = layout.vocab_start, layout.vocab_rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size))
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.rows)
        out = nn.functional.embedding(torch.where(mine, local, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(~mine[:, None], 0))
