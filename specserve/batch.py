"""ForwardBatch: the tensors of one ragged step, built by the runner, read by the model;
and the one builder of a step's host lists (``host_batch``), which the eager runner and
both CUDA-graph layouts share."""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate, chain

import numpy as np
import torch

from specserve.kernels.reference import TREE_SPAN


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
    # [num_tokens] int64: each row's visibility mask where the step verifies draft trees
    # (``tree_rows``; 0: a causal row); None: every row attends causally.
    tree_masks: torch.Tensor | None = None
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
class HostBatch:
    """A step's per-token and per-request host lists (``host_batch``)."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]          # -1: a padding row, its K/V never stored
    logits_rows: list[int]    # rows whose logits the sampler needs (prompt rows first)
    query_lens: list[int]     # per request, padding requests included
    seq_lens: list[int]
    device_rows: list[int]    # rows whose token ids are still on the device
    tree_masks: list[int] | None = None  # per row (``tree_rows``); None: no request drafts a tree

    @property
    def cu_query_lens(self) -> list[int]:
        return [0, *accumulate(self.query_lens)]

    def add_padding(self, rows: int, count: int = 1) -> None:
        """``count`` padding requests of ``rows`` rows each after the real ones: token 0 at
        slot -1 (never stored), positions from 0; their outputs are thrown away."""
        if rows <= 0 or count <= 0:
            return
        self.input_ids += [0] * (rows * count)
        self.positions += range(rows) if count == 1 else list(range(rows)) * count
        self.slots += [-1] * (rows * count)
        self.query_lens += [rows] * count
        self.seq_lens += [rows] * count


def host_batch(planned, block_size: int, device_counts: list[int] | None = None,
               span: int | None = None, long_offset: int = 0) -> HostBatch:
    """The host lists of a step, for the eager pass and both graph layouts alike.

    Per request, in order: its tokens (fed, then drafts), their positions and cache slots,
    the rows whose logits are needed (a sampling request's last 1 + k), its query and
    sequence lengths, and the rows whose token ids are still on the device (its last
    ``device_counts[i]``). ``span``: every request is padded to that many rows (a padded
    CUDA graph), the extra rows after its real ones, token 0 at slot -1, so causal
    attention keeps them out of the real rows. A graph adds padding requests after them
    (``HostBatch.add_padding``). ``long_offset``: the model's ``Rotary.long_offset``, by
    which a LongRoPE long-mode request's positions are shifted (0: no long mode)."""
    out = HostBatch([], [], [], [], [], [], [])
    input_ids, positions, slots, logits_rows, query_lens, seq_lens, device_rows = (
        out.input_ids, out.positions, out.slots, out.logits_rows, out.query_lens, out.seq_lens,
        out.device_rows)  # locals: this runs for every request of every step
    num_rows = 0
    counts = device_counts if device_counts is not None else [0] * len(planned)
    for p, count in zip(planned, counts):
        num_drafts = len(p.draft_token_ids)
        n = len(p.token_ids) + num_drafts
        parents = p.draft_parents
        input_ids += p.token_ids
        input_ids += p.draft_token_ids
        append_slots(slots, p.block_table, p.start_pos, n, block_size)
        if span is None:
            width = n
            query_lens.append(n)
        else:  # padded after the real rows
            width = span
            if span > n:
                input_ids += [0] * (span - n)
                slots += [-1] * (span - n)
        first = p.start_pos + long_offset if p.long_rope else p.start_pos
        nodes = p.tree_nodes
        if parents is None and nodes is None:
            positions += range(first, first + width)
            if out.tree_masks is not None:
                out.tree_masks += [0] * width
        else:  # tree nodes: each at its depth's position, seeing its ancestors
            if span is not None and span > n:
                raise ValueError("tree nodes are not fed in a padded pass")
            if out.tree_masks is None:
                out.tree_masks = [0] * num_rows
            if nodes is not None:  # (a drafter's pass over nodes: positions given)
                offset = first - p.start_pos
                positions += [offset + pos for pos in nodes[0]]
                out.tree_masks += nodes[1]
            else:
                depths, masks = tree_rows(parents)
                fed = len(p.token_ids)
                positions += range(first, first + fed)
                positions += [first + fed + depth for depth in depths]
                out.tree_masks += [0] * fed
                out.tree_masks += masks
        end = num_rows + n
        if p.prompt_logits:  # every fed token's but a sampling row's, before it
            logits_rows += range(num_rows, num_rows + len(p.token_ids) - p.sample)
        if p.sample:
            logits_rows += range(end - 1 - num_drafts, end)
        device_rows += range(end - count, end)
        seq_lens.append(p.start_pos + width)
        num_rows += width
    if span is not None:
        out.query_lens = [span] * len(planned)
    return out


def tree_rows(parents: list[int]) -> tuple[list[int], list[int]]:
    """The depths and visibility masks of a draft tree's nodes, fed after its request's
    last token (the root): ``parents[i]`` is node i's parent, an earlier node, or -1 for
    the root. A node sees the context up to the root, its ancestors and itself: bit j of
    its mask is the position j before the request's last (``reference.TREE_SPAN``)."""
    n = len(parents)
    if n >= TREE_SPAN:
        raise ValueError(f"a draft tree of {n} nodes; at most {TREE_SPAN - 1} are verified at once")
    depths: list[int] = []
    lines: list[int] = []  # each node's ancestors and itself, as mask bits
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"draft tree node {i} has parent {parent}, not an earlier node or the root (-1)")
        own = 1 << (n - 1 - i)
        depths.append(0 if parent < 0 else depths[parent] + 1)
        lines.append(own if parent < 0 else own | lines[parent])
    context = -1 << n  # the root and everything before it
    return depths, [line | context for line in lines]


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

