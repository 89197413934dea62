"""What rank 0 of a tensor-parallel engine tells the other ranks, in order (``StepChannel``).

Rank 0 owns the scheduler, the drafter, the sampler and the HTTP server. Every forward
pass its ModelRunner runs must run on every rank at the same time (each layer ends in
an all-reduce), so before each one the runner broadcasts the pass's metadata — the
SchedulerOutput flattened into int64s, never Python objects — and the other ranks
rebuild it and call the very same ``ModelRunner.execute`` (``tp_worker.follow``): same batch tensors, same
eager-or-graph choice, same graph bucket, so the collectives line up. CUDA-graph set-up
is announced the same way, so every rank captures the same graphs in the same order.

Message layout (one broadcast of ``FIRST`` int64s, a second one only for a step too
large for the first)::

    [kind, num_reqs, num_tokens, num_layers + 1, payload_len, num_device_ids, b, c | payload ...]
    payload = per request (start_pos, num_token_ids, num_drafts, sample | prompt_logits << 1, num_blocks,
              num_device_ids) + every request's token ids then draft ids + every request's
              block table

A pass whose last tokens are still on rank 0's device (a model drafter's proposals,
``DeviceTokenIds``) broadcasts those ids device to device after the message, so no rank
waits for the host to see them. On CUDA the messages are NCCL broadcasts of device
tensors (built on the host, copied over); on CPU, gloo broadcasts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.batch import DeviceTokenIds
from specserve.distributed import TPGroup
from specserve.sampling_params import SamplingParams
from specserve.scheduler import ScheduledRequest, SchedulerOutput

STEP, GRAPHS, SHUTDOWN, COPY = 1, 2, 3, 4
HEADER = 8
FIRST = 1024  # int64s in the first broadcast: a batch-1 decode over 8k tokens fits
_NO_PARAMS = SamplingParams()  # the runner never reads a request's sampling parameters


@dataclass
class Announcement:
    """What rank 0's runner is about to do."""

    kind: int
    output: SchedulerOutput | None = None       # STEP
    num_layers: int | None = None               # STEP: layer-skip drafting runs a prefix
    device_ids: DeviceTokenIds | None = None    # STEP: tokens whose values came by broadcast
    graphs: tuple[int, int, bool] | None = None  # GRAPHS: max_query_len, max_model_len, capture
    block_copies: list[tuple[int, int]] | None = None  # COPY: (source, destination) block ids


class StepChannel:
    """Rank 0 -> every other rank, in order. Rank 0 calls ``send_*``, the others
    ``receive``; the two sides must make the same sequence of calls."""

    def __init__(self, tp: TPGroup) -> None:
        self.tp = tp

    # ------------------------------------------------------------------ rank 0
    def send_step(self, output: SchedulerOutput, num_layers: int | None,
                  device_ids: DeviceTokenIds | None = None) -> None:
        meta, tokens, tables = [], [], []
        counts = device_ids.counts if device_ids is not None else [0] * len(output.scheduled)
        for p, count in zip(output.scheduled, counts):
            flags = int(p.sample) | int(p.prompt_logits) << 1 | int(p.long_rope) << 2
            meta += (p.start_pos, len(p.token_ids), len(p.draft_token_ids), flags, len(p.block_table), count)
            tokens += p.token_ids
            tokens += p.draft_token_ids
            tables += p.block_table
        num_layers = -1 if num_layers is None else num_layers
        num_device_ids = sum(counts)
        self._send([STEP, len(output.scheduled), len(tokens), num_layers + 1, 0, num_device_ids],
                   meta + tokens + tables)
        if num_device_ids:
            self.tp.broadcast(device_ids.ids.to(self.tp.device, torch.int64))

    def send_graphs(self, max_query_len: int, max_model_len: int, capture: bool) -> None:
        self._send([GRAPHS, max_query_len, max_model_len, int(capture)], [])

    def send_copies(self, block_copies: list[tuple[int, int]]) -> None:
        self._send([COPY], [block for pair in block_copies for block in pair])

    def send_shutdown(self) -> None:
        """The last message; every rank then meets at a barrier (``receive`` does its side),
        so no rank tears its process group down while another's is still mid-message —
        without it, a rank exiting early made the other abort now and then (gloo, CPU)."""
        self._send([SHUTDOWN], [])
        self.tp.barrier()

    def _send(self, head: list[int], payload: list[int]) -> None:
        head = head + [0] * (HEADER - len(head))
        head[4] = len(payload)
        first = torch.zeros(FIRST, dtype=torch.int64)
        inline = min(len(payload), FIRST - HEADER)
        first[:HEADER + inline] = torch.tensor(head + payload[:inline], dtype=torch.int64)
        self.tp.broadcast(first.to(self.tp.device))
        if len(payload) > inline:
            rest = torch.tensor(payload[inline:], dtype=torch.int64)
            self.tp.broadcast(rest.to(self.tp.device))

    # ------------------------------------------------------------------ other ranks
    def receive(self) -> Announcement:
        first = self.tp.broadcast(torch.empty(FIRST, dtype=torch.int64, device=self.tp.device)).tolist()
        kind, num_reqs, num_tokens, num_layers, payload_len, num_device_ids = first[:6]
        if kind == SHUTDOWN:
            self.tp.barrier()  # rank 0's send_shutdown waits here too
            return Announcement(SHUTDOWN)
        if kind == GRAPHS:
            return Announcement(GRAPHS, graphs=(first[1], first[2], bool(first[3])))
        if kind not in (STEP, COPY):
            raise RuntimeError(f"unknown message kind {kind} from rank 0")
        payload = first[HEADER:HEADER + payload_len]
        if payload_len > FIRST - HEADER:
            rest = torch.empty(payload_len - (FIRST - HEADER), dtype=torch.int64, device=self.tp.device)
            payload += self.tp.broadcast(rest).tolist()
        if kind == COPY:
            return Announcement(COPY, block_copies=list(zip(payload[::2], payload[1::2])))
        output, counts = _unpack(payload, num_reqs, num_tokens)
        device_ids = None
        if num_device_ids:
            ids = torch.empty(num_device_ids, dtype=torch.int64, device=self.tp.device)
            device_ids = DeviceTokenIds(self.tp.broadcast(ids), counts)
        return Announcement(STEP, output, None if num_layers == 0 else num_layers - 1, device_ids=device_ids)


def _unpack(payload: list[int], num_reqs: int, num_tokens: int) -> tuple[SchedulerOutput, list[int]]:
    """The SchedulerOutput, and how many of each request's last tokens come by device."""
    tokens_at, tables_at = 6 * num_reqs, 6 * num_reqs + num_tokens
    scheduled, counts = [], []
    for i in range(num_reqs):
        start_pos, num_ids, num_drafts, sample, num_blocks, count = payload[6 * i:6 * i + 6]
        counts.append(count)
        ids = payload[tokens_at:tokens_at + num_ids + num_drafts]
        tokens_at += num_ids + num_drafts
        table = payload[tables_at:tables_at + num_blocks]
        tables_at += num_blocks
        scheduled.append(ScheduledRequest(str(i), ids[:num_ids], start_pos, table, _NO_PARAMS,
                                          sample=bool(sample & 1), num_lookahead=num_drafts,
                                          draft_token_ids=ids[num_ids:], prompt_logits=bool(sample & 2),
                                          long_rope=bool(sample & 4)))
    return SchedulerOutput(scheduled, []), counts
