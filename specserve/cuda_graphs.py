"""CUDA graphs for decode and verify steps.

A step in which every request feeds at most ``max_query_len`` tokens (decode, verify of
one known token plus its drafts, a draft model's catch-up of one or two tokens) is run as
a replay of a graph captured for its shape: ``num_reqs`` rounded up to a batch bucket,
and every request padded to the step's longest query ``q``. Padding is harmless by
construction:

* extra draft rows of a request come *after* its real rows, so causal attention keeps
  them out of the real rows; their slot is -1, so their K/V is never stored;
* padding requests own ``q`` rows each, slot -1, position 0.., and attend only to the
  first ``q`` keys of block 0 — whatever is there, their outputs are thrown away.

Only the real rows' logits are handed back (each sampling request's last 1 + k rows), in
the same order as the eager path's, so the sampler never sees the padding. Longer prefill
chunks (and the layer-skip draft, which runs a prefix of the layers) stay eager.

The attention kernels plan their launch (tile sizes, KV splits) from host-side lengths;
graphs are captured with the worst case (``max_model_len`` keys for every request), so
one graph serves every context length. All inputs live in static buffers that each step
fills with one asynchronous host->device copy per dtype, built in one pass over the
requests; token ids still on the device (a model drafter's proposals) are scattered in
there, so the host never waits for them.
"""
from __future__ import annotations

import logging
import time

import torch

from specserve.batch import DeviceTokenIds, ForwardBatch, append_slots, block_table_array
from specserve.scheduler import SchedulerOutput
from specserve.transfer import copy_into

logger = logging.getLogger("specserve")

BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def batch_buckets(max_num_seqs: int) -> list[int]:
    buckets = [b for b in BATCH_BUCKETS if b < max_num_seqs]
    return buckets + [max_num_seqs]


class GraphRunner:
    """Graphs of ``forward + logits`` for (batch bucket, query length) shapes.

    ``capture`` False runs the same padded static-buffer path eagerly — what the CPU tests
    use to check the padding, since there is no CUDA there.
    """

    def __init__(self, model, kv_caches, *, max_num_seqs: int, max_query_len: int,
                 max_blocks_per_seq: int, max_model_len: int, device: torch.device,
                 capture: bool = True) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.buckets = batch_buckets(max_num_seqs)
        self.max_query_len = max_query_len
        self.max_model_len = max_model_len
        self.device = device
        self.capture = capture
        max_tokens = self.buckets[-1] * max_query_len
        self.max_blocks_per_seq = max_blocks_per_seq
        # Static inputs, laid out per graph shape so that each step's are one contiguous
        # copy. int64: tokens, positions, slots (then, outside the graph, the logits rows
        # to keep and the rows of device token ids); int32: cu_query_lens, seq_lens, tables.
        self._long = torch.zeros(5 * max_tokens, dtype=torch.int64, device=device)
        self._int = torch.zeros(2 * self.buckets[-1] + 1 + self.buckets[-1] * max_blocks_per_seq,
                                dtype=torch.int32, device=device)
        self._graphs: dict[tuple[int, int], tuple[object, torch.Tensor, ForwardBatch]] = {}
        self._pool = None

    # ------------------------------------------------------------------ eligibility
    def fits(self, output: SchedulerOutput) -> bool:
        """Every request within the captured query length; longer prefill chunks do not."""
        planned = output.scheduled
        return self.fits_lengths(len(planned), max(len(p.token_ids) + len(p.draft_token_ids) for p in planned))

    def fits_lengths(self, num_reqs: int, max_query_len: int) -> bool:
        """``fits`` for a step of ``num_reqs`` requests whose longest query is ``max_query_len``."""
        return num_reqs <= self.buckets[-1] and max_query_len <= self.max_query_len

    # ------------------------------------------------------------------ capture
    def capture_all(self, query_lens: list[int]) -> None:
        """Capture every bucket for each query length, largest first (they share a pool)."""
        start = time.perf_counter()
        for q in sorted(query_lens, reverse=True):
            for bucket in reversed(self.buckets):
                self._get(bucket, q)
        logger.info("captured %d CUDA graphs in %.1f s", len(self._graphs), time.perf_counter() - start)

    def _get(self, bucket: int, q: int):
        key = (bucket, q)
        if key not in self._graphs:
            self._graphs[key] = self._build(bucket, q)
        return self._graphs[key]

    def _build(self, bucket: int, q: int):
        batch = self._static_batch(bucket, q)
        self._fill_padding(bucket, q)

        def forward() -> torch.Tensor:
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch)
            return self.model.compute_logits(hidden).float()

        if not self.capture:
            return forward, None, batch
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: autotuning and lazy initialisation happen here
                forward()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = forward()
        self._pool = graph.pool()
        return graph, logits, batch

    def _static_batch(self, bucket: int, q: int) -> ForwardBatch:
        n, ints = bucket * q, self._int
        return ForwardBatch(
            input_ids=self._long[:n], positions=self._long[n:2 * n], slot_mapping=self._long[2 * n:3 * n],
            cu_query_lens=ints[:bucket + 1], seq_lens=ints[bucket + 1:2 * bucket + 1],
            block_tables=ints[2 * bucket + 1:2 * bucket + 1 + bucket * self.max_blocks_per_seq]
            .view(bucket, self.max_blocks_per_seq),
            logits_indices=self._long[:0],  # unused: logits are computed for every row
            # Worst-case lengths: the kernels plan for them, so any real step fits the graph.
            query_lens_host=[q] * bucket, seq_lens_host=[self.max_model_len] * bucket,
            has_padding=True)

    def _fill_padding(self, bucket: int, q: int) -> None:
        """Inputs of an all-padding step (for warm-up and capture)."""
        self.prepare([], bucket, q, 1)

    # ------------------------------------------------------------------ replay
    @torch.inference_mode()
    def run(self, output: SchedulerOutput, block_size: int,
            device_ids: DeviceTokenIds | None = None) -> torch.Tensor:
        """Logits ``[Σ(1 + k_i), vocab]`` of the real rows, in schedule order."""
        planned = output.scheduled
        q = max(len(p.token_ids) + len(p.draft_token_ids) for p in planned)
        bucket = next(b for b in self.buckets if b >= len(planned))
        graph, logits, batch = self._get(bucket, q)  # before writing: building overwrites inputs
        rows, seq_lens = self.prepare(planned, bucket, q, block_size, device_ids)
        if self.capture:
            graph.replay()
        else:  # eager: host-planned backends (torch) need the real lengths
            batch.seq_lens_host = seq_lens
            batch.attn_plans.clear()
            logits = graph()
        return logits if rows is None else logits.index_select(0, rows)

    def prepare(self, planned, bucket: int, q: int, block_size: int,
                device_ids: DeviceTokenIds | None = None) -> tuple[torch.Tensor | None, list[int]]:
        """Write the step's inputs into the static buffers: request i owns rows
        ``i*q .. i*q + q - 1``, its real tokens first; padding rows and padding requests
        get slot -1. One pass over the requests, one asynchronous copy per dtype.
        Returns the logits rows to keep (None: all of them) and the padded seq_lens."""
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        seq_lens: list[int] = []
        device_rows: list[int] = []
        counts = device_ids.counts if device_ids is not None else [0] * len(planned)
        for i, (p, count) in enumerate(zip(planned, counts)):
            num_drafts = len(p.draft_token_ids)
            n = len(p.token_ids) + num_drafts
            tokens += p.token_ids
            tokens += p.draft_token_ids
            tokens += [0] * (q - n)
            positions += range(p.start_pos, p.start_pos + q)
            append_slots(slots, p.block_table, p.start_pos, n, block_size)
            slots += [-1] * (q - n)
            seq_lens.append(p.start_pos + q)
            end = i * q + n
            if p.sample:
                rows += range(end - 1 - num_drafts, end)
            device_rows += range(end - count, end)
        num_pad = bucket - len(planned)
        tokens += [0] * (q * num_pad)
        positions += list(range(q)) * num_pad
        slots += [-1] * (q * num_pad)
        seq_lens += [q] * num_pad
        count = bucket * q
        keep_all = len(rows) == count
        copy_into(self._long, [tokens, positions, slots] + ([] if keep_all else [rows]) + [device_rows])
        tables = block_table_array(planned, bucket, self.max_blocks_per_seq)
        copy_into(self._int, [list(range(0, count + 1, q)), seq_lens, tables])
        offset = 3 * count
        rows_t = None
        if not keep_all:
            rows_t, offset = self._long[offset:offset + len(rows)], offset + len(rows)
        if device_ids is not None:
            self._long[:count].index_copy_(0, self._long[offset:offset + len(device_rows)], device_ids.ids)
        return rows_t, seq_lens
