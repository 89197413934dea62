"""CUDA graphs for decode and verify steps.

A step in which every request feeds one known token plus its drafts (no prefill chunk) is
run as a replay of a graph captured for its shape: ``num_reqs`` rounded up to a batch
bucket, and every request padded to the same query length ``q = 1 + max k_i`` of the
step. Padding is harmless by construction:

* extra draft rows of a request come *after* its real rows, so causal attention keeps
  them out of the real rows; their slot is -1, so their K/V is never stored;
* padding requests own ``q`` rows each, slot -1, position 0.., and attend only to the
  first ``q`` keys of block 0 — whatever is there, their outputs are thrown away.

Only the real rows' logits are handed back, in the same order as the eager path's, so
the sampler never sees the padding. Prefill chunks (and the layer-skip draft, which runs
a prefix of the layers) stay eager.

The attention kernels plan their launch (tile sizes, KV splits) from host-side lengths;
graphs are captured with the worst case (``max_model_len`` keys for every request), so
one graph serves every context length. All inputs live in static buffers that each step
fills with one host->device copy per dtype.
"""
from __future__ import annotations

import logging
import time

import torch

from specserve.batch import ForwardBatch
from specserve.scheduler import SchedulerOutput

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
        # Static inputs. int64: tokens, positions, slots; int32: cu_query_lens, seq_lens, tables.
        self._long = torch.zeros(3 * max_tokens, dtype=torch.int64, device=device)
        self._int = torch.zeros(2 * self.buckets[-1] + 1 + self.buckets[-1] * max_blocks_per_seq,
                                dtype=torch.int32, device=device)
        self._max_tokens = max_tokens
        pin = device.type == "cuda"
        self._long_host = torch.zeros_like(self._long, device="cpu", pin_memory=pin)
        self._int_host = torch.zeros_like(self._int, device="cpu", pin_memory=pin)
        self._graphs: dict[tuple[int, int], tuple[object, torch.Tensor, ForwardBatch]] = {}
        self._pool = None

    # ------------------------------------------------------------------ eligibility
    def fits(self, output: SchedulerOutput) -> bool:
        """Decode/verify only, within the captured shapes."""
        planned = output.scheduled
        return (len(planned) <= self.buckets[-1]
                and all(p.sample and len(p.token_ids) == 1 for p in planned)
                and 1 + max(len(p.draft_token_ids) for p in planned) <= self.max_query_len)

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
        tokens, n = bucket * q, self._max_tokens
        ints = self._int
        return ForwardBatch(
            input_ids=self._long[:tokens], positions=self._long[n:n + tokens],
            slot_mapping=self._long[2 * n:2 * n + tokens],
            cu_query_lens=ints[:bucket + 1], seq_lens=ints[bucket + 1:2 * bucket + 1],
            block_tables=ints[2 * bucket + 1:2 * bucket + 1 + bucket * self.max_blocks_per_seq]
            .view(bucket, self.max_blocks_per_seq),
            logits_indices=self._long[:0],  # unused: logits are computed for every row
            # Worst-case lengths: the kernels plan for them, so any real step fits the graph.
            query_lens_host=[q] * bucket, seq_lens_host=[self.max_model_len] * bucket,
            has_padding=True)

    def _fill_padding(self, bucket: int, q: int) -> None:
        """Inputs of an all-padding step (for warm-up and capture)."""
        self._write(bucket, q, [[0] * q] * bucket, [list(range(q))] * bucket,
                    [[-1] * q] * bucket, [q] * bucket, [[]] * bucket)

    # ------------------------------------------------------------------ replay
    @torch.inference_mode()
    def run(self, output: SchedulerOutput, block_size: int) -> torch.Tensor:
        """Logits ``[Σ(1 + k_i), vocab]`` of the real rows, in schedule order."""
        planned = output.scheduled
        q = 1 + max(len(p.draft_token_ids) for p in planned)
        bucket = next(b for b in self.buckets if b >= len(planned))
        graph, logits, batch = self._get(bucket, q)  # before writing: building overwrites inputs
        tokens, positions, slots, seq_lens, tables, rows = [], [], [], [], [], []
        for i, p in enumerate(planned):
            real = [*p.token_ids, *p.draft_token_ids]
            span = range(p.start_pos, p.start_pos + len(real))
            table = p.block_table
            tokens.append(real + [0] * (q - len(real)))
            positions.append(list(range(p.start_pos, p.start_pos + q)))
            slots.append([table[s // block_size] * block_size + s % block_size for s in span]
                         + [-1] * (q - len(real)))
            seq_lens.append(p.start_pos + q)
            tables.append(table)
            rows.extend(range(i * q, i * q + len(real)))
        pad = bucket - len(planned)
        self._write(bucket, q, tokens + [[0] * q] * pad, positions + [list(range(q))] * pad,
                    slots + [[-1] * q] * pad, seq_lens + [q] * pad, tables + [[]] * pad)
        if self.capture:
            graph.replay()
        else:  # eager: host-planned backends (torch) need the real lengths
            batch.seq_lens_host = seq_lens + [q] * pad
            batch.attn_plans.clear()
            logits = graph()
        if len(rows) == bucket * q:
            return logits
        return logits[torch.tensor(rows, device=self.device)]

    def _write(self, bucket: int, q: int, tokens, positions, slots, seq_lens, tables) -> None:
        """Pack the step's inputs on the host and copy them over, one copy per dtype."""
        n, count = self._max_tokens, bucket * q
        long_host, int_host = self._long_host, self._int_host
        for offset, rows in ((0, tokens), (n, positions), (2 * n, slots)):
            long_host[offset:offset + count] = torch.tensor([x for row in rows for x in row])
        width = self.max_blocks_per_seq
        cu = [0]
        for _ in range(bucket):
            cu.append(cu[-1] + q)
        int_host[:bucket + 1] = torch.tensor(cu)
        int_host[bucket + 1:2 * bucket + 1] = torch.tensor(seq_lens)
        table = torch.zeros(bucket, width, dtype=torch.int32)
        for i, row in enumerate(tables):
            table[i, :len(row)] = torch.tensor(row, dtype=torch.int32)
        int_host[2 * bucket + 1:2 * bucket + 1 + bucket * width] = table.flatten()
        self._long.copy_(long_host, non_blocking=True)
        self._int.copy_(int_host, non_blocking=True)
