"""ForwardBatch: the tensors of one ragged step, built by the runner, read by the model;
and the numpy helpers the runner and the graph runner build its host arrays with."""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np
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
    # [num_tokens, hidden]: per-token conditioning for a draft head that reads its
    # target's hidden states (``models/eagle.py``); None for every other model.
    features: torch.Tensor | None = None
    # Filled by the attention backend on first use in this step, keyed by sliding window.
    attn_plans: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


@dataclass
class DeviceTokenIds:
    """Token ids that are still on the device when a step is prepared (a model drafter's
    proposals): the last ``counts[i]`` tokens fed for the step's i-th request are taken
    from ``ids``, in schedule order, instead of the placeholders in its token lists.
    Their positions and slots depend only on the counts, so the host can plan the step
    without waiting for their values."""

    ids: torch.Tensor             # [sum(counts)] int64, on the device
    counts: list[int]             # [num_reqs]


# ---------------------------------------------------------------------- host arrays
# A step's per-token inputs are built in one pass over the requests, whole runs of
# tokens at a time (list extends of ranges, at C speed), never one Python op per token;
# each dtype then reaches the device in one asynchronous copy (``transfer.py``).

def append_slots(slots: list[int], block_table: list[int], start: int, num_tokens: int,
                 block_size: int) -> None:
    """Append the cache slots of positions ``start .. start + num_tokens - 1``, a block's
    run of consecutive slots at a time."""
    pos, end = start, start + num_tokens
    while pos < end:
        block, offset = divmod(pos, block_size)
        run = min(block_size - offset, end - pos)
        first = block_table[block] * block_size + offset
        slots.extend(range(first, first + run))
        pos += run


@dataclass
class RaggedArrays:
    """A ragged step's per-token and per-request host lists (``ragged_arrays``)."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    logits_rows: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    device_rows: list[int]


def ragged_arrays(planned, block_size: int, device_counts: list[int] | None = None) -> RaggedArrays:
    """The host lists of a ragged step, no padding: each request's tokens (fed, then
    drafts), positions and cache slots, the rows whose logits are needed (a sampling
    request's last 1 + k), its query and sequence lengths, and the rows whose token ids
    are still on the device (each request's last ``device_counts[i]``)."""
    out = RaggedArrays([], [], [], [], [], [], [])
    input_ids, positions, slots, logits_rows, query_lens, seq_lens, device_rows = (
        out.input_ids, out.positions, out.slots, out.logits_rows, out.query_lens, out.seq_lens,
        out.device_rows)  # locals: this runs for every request of every step
    num_tokens = 0
    counts = device_counts if device_counts is not None else [0] * len(planned)
    for p, count in zip(planned, counts):
        num_drafts = len(p.draft_token_ids)
        n = len(p.token_ids) + num_drafts
        input_ids += p.token_ids
        input_ids += p.draft_token_ids
        positions += range(p.start_pos, p.start_pos + n)
        append_slots(slots, p.block_table, p.start_pos, n, block_size)
        num_tokens += n
        if p.sample:
            logits_rows += range(num_tokens - 1 - num_drafts, num_tokens)
        device_rows += range(num_tokens - count, num_tokens)
        query_lens.append(n)
        seq_lens.append(p.start_pos + n)
    return out


def block_table_array(planned, num_rows: int, width: int) -> np.ndarray:
    """Block tables ``[num_rows, width]`` int32, padded with block 0 (and rows of zeros
    past the requests)."""
    tables = np.zeros((num_rows, width), np.int32)
    if len(planned) <= 8:
        for row, p in zip(tables, planned):
            row[:len(p.block_table)] = p.block_table
    else:
        lens = np.fromiter((len(p.block_table) for p in planned), np.int64, len(planned))
        tables[:len(planned)][np.arange(width) < lens[:, None]] = np.fromiter(
            chain.from_iterable(p.block_table for p in planned), np.int32, int(lens.sum()))
    return tables

