"""ForwardBatch: the tensors of one ragged step, built by the runner, read by the model."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ForwardBatch:
    """All requests' tokens flattened into one batch, no padding.

    Request i owns rows ``cu_query_lens[i]:cu_query_lens[i+1]``; after this step's KV is
    stored it has ``seq_lens[i]`` cached tokens, reachable through ``block_tables[i]``.
    """

    input_ids: torch.Tensor       # [num_tokens] int64
    positions: torch.Tensor       # [num_tokens] int64
    slot_mapping: torch.Tensor    # [num_tokens] int64, -1 = padding row, not stored
    block_tables: torch.Tensor    # [num_reqs, max_blocks_per_req] int32 (padded with 0)
    cu_query_lens: torch.Tensor   # [num_reqs + 1] int32
    seq_lens: torch.Tensor        # [num_reqs] int32
    logits_indices: torch.Tensor  # [num_logits] int64, rows whose logits are needed
    query_lens_host: list[int]    # host copies, so backends need no device->host sync
    seq_lens_host: list[int]
    has_padding: bool = False     # some slot_mapping rows are -1
    # Filled by the attention backend on first use in this step, keyed by sliding window.
    attn_plans: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]
