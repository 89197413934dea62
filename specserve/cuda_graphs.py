"""CUDA graphs for every step shape that recurs: padded decode/verify graphs and ragged
graphs for steps with prefill chunks.

**Padded graphs.** A step in which every request feeds at most ``max_query_len`` tokens
(decode, verify of one known token plus its drafts, a draft model's catch-up of one or
two tokens) is run as a replay of a graph captured for its shape: ``num_reqs`` rounded up
to a batch bucket, and every request padded to the step's longest query ``q``. Padding is
harmless by construction:

* extra draft rows of a request come *after* its real rows, so causal attention keeps
  them out of the real rows; their slot is -1, so their K/V is never stored;
* padding requests own ``q`` rows each, slot -1, position 0.., and attend only to the
  first ``q`` keys of block 0 — whatever is there, their outputs are thrown away.

Only the real rows' logits are handed back (each sampling request's last 1 + k rows), in
the same order as the eager path's, so the sampler never sees the padding.

**Ragged graphs.** A step with a prefill chunk (a new request admitted under load, most
steps at a high request rate) does not fit a padded shape; run eagerly, its hundreds of
kernel launches from Python cost several decode steps' time. It replays a graph
captured for its total token count rounded up to a token bucket instead: the requests'
tokens unpadded, one after another, then one padding request owning the rows up to the
bucket (slot -1, positions 0.., block 0 for keys), then requests with no tokens up to
``max_num_seqs + 1`` (their attention tiles exit at once). The LM head runs inside the
graph on the rows to sample only (a static index buffer, padded with row 0), as many as
the step needs rounded up to one row per request or to every request's ``max_query_len``
(a step without drafts computes no more logits than speculation off's). Steps longer
than the largest bucket (``EngineConfig.cuda_graph_max_tokens``, 2048 by default), and the
layer-skip draft (a prefix of the layers), stay eager: a long prefill chunk's launches are
a small part of its time.

**Inputs shared.** A draft model that caches the same block ids and is fed exactly the
target's step (a step without drafts: each request's pending token, or its prompt chunk,
at the same positions) can replay its own graph of that shape, padded or ragged, on the
target's inputs (``replay_inputs_of``; ``ModelDrafter.shares_target_inputs``), copied
from the target's static buffers on the device, instead of building them again on the
host: beside the target's pass, its host work is then a few launches.

A draft head that reads its target's features (``models/eagle.py``) gets them through a
static buffer too: ``run`` copies each pass's feature rows where its tokens are (request
i's at i * q when padded), and the graphs read ``batch.features`` from there.

With draft trees on (``trees``), the ragged graphs also read every row's visibility mask
(``batch.tree_rows``) from a static buffer, zeros for causal rows, and run the steps that
verify trees (never padded: a tree's rows are not a chain's).

The attention kernels plan their launch (tile sizes, KV splits) from host-side lengths;
graphs are captured with the worst case (``max_model_len`` keys for every request, and for
ragged graphs the bucket's tokens in one request), so one graph serves every step that
fits it. All inputs live in static buffers that each step fills with one asynchronous
host->device copy per dtype, built in one pass over the requests; token ids still on the
device (a model drafter's proposals) are scattered in there, so the host never waits for
them.
"""
from __future__ import annotations

import logging
import time
import weakref

import torch

from specserve.batch import DeviceTokenIds, ForwardBatch, block_table_array, host_batch
from specserve.scheduler import SchedulerOutput
from specserve.transfer import copy_into, to_device

logger = logging.getLogger("specserve")

BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
TOKEN_BUCKETS = (16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
MAX_RAGGED_TOKENS = TOKEN_BUCKETS[-1]  # past this (or EngineConfig.cuda_graph_max_tokens): eager


def batch_buckets(max_num_seqs: int) -> list[int]:
    buckets = [b for b in BATCH_BUCKETS if b < max_num_seqs]
    return buckets + [max_num_seqs]


def token_buckets(max_num_tokens: int) -> list[int]:
    """Ragged graphs' token counts: up to the step's token budget (at most
    ``MAX_RAGGED_TOKENS``); none for a budget of 0."""
    top = min(max_num_tokens, MAX_RAGGED_TOKENS)
    if top <= 0:
        return []
    return [b for b in TOKEN_BUCKETS if b < top] + [top]


def row_buckets(tokens: int, max_num_seqs: int, max_query_len: int) -> list[int]:
    """The logits rows a ragged graph of ``tokens`` may compute: one per request (a step
    without drafts) or ``max_query_len`` per request, never more than its tokens."""
    return sorted({min(tokens, max_num_seqs), min(tokens, max_num_seqs * max_query_len)})


def graph_logits_rows(max_num_seqs: int, max_query_len: int, max_num_tokens: int) -> int:
    """Rows of logits the captured graphs keep alive as their outputs, all together: every
    padded graph's ``bucket * q`` and every ragged graph's sampled rows."""
    buckets = batch_buckets(max_num_seqs)
    padded = sum(buckets) * sum(range(1, max_query_len + 1))
    ragged = sum(sum(row_buckets(t, buckets[-1], max_query_len)) for t in token_buckets(max_num_tokens))
    return padded + ragged


# torch's pool hands out its streams in turn, this many a device and priority, then the
# first again.
POOL_STREAMS = 32
_HELD: dict[int, int] = {}  # raw stream handle -> live owners ``stream_of_its_own`` gave it


def stream_of_its_own(device: torch.device, owner: object) -> torch.cuda.Stream:
    """A stream no other live owner holds, held for ``owner`` until it is collected: a
    runner's graphs are captured on one, and a draft model fed beside its target's pass
    runs on one (``ModelDrafter.feed``). cuBLAS likely keys its workspace by stream, and a
    captured GEMM keeps the workspace's address: work that runs at once on two streams
    must not share one, or each writes the other's GEMM scratch. Neither torch's default
    capture stream (one for the process) nor a fresh ``torch.cuda.Stream`` (a pool stream,
    drawn in turn) guarantees that, so streams are drawn until one is free (past a whole
    turn of the pool, any)."""
    for _ in range(POOL_STREAMS):
        stream = torch.cuda.Stream(device)
        if stream.cuda_stream not in _HELD:
            break
    _HELD[stream.cuda_stream] = _HELD.get(stream.cuda_stream, 0) + 1
    weakref.finalize(owner, _let_go, stream.cuda_stream)
    return stream


def _let_go(handle: int) -> None:
    if _HELD.get(handle, 0) > 1:
        _HELD[handle] -= 1
    else:
        _HELD.pop(handle, None)


class GraphRunner:
    """Graphs of ``forward + logits``: padded ones for (batch bucket, query length)
    shapes, ragged ones for token buckets and the logits rows they compute (keyed
    ``(0, tokens, rows)``).

    ``capture`` False runs the same static-buffer paths eagerly — what the CPU tests use
    to check the padding, since there is no CUDA there.
    """

    def __init__(self, model, kv_caches, *, max_num_seqs: int, max_query_len: int,
                 max_blocks_per_seq: int, max_model_len: int, device: torch.device,
                 capture: bool = True, max_num_tokens: int = 0, trees: bool = False) -> None:
        """``max_num_tokens``: the step's token budget, which the ragged graphs' buckets
        reach (0: no ragged graphs). ``trees``: steps verify draft trees; the ragged graphs
        then read every row's visibility mask (``batch.tree_rows``; 0 for a causal row)
        from a buffer of their own and run those steps too."""
        self.model, self.kv_caches = model, kv_caches
        self.buckets = batch_buckets(max_num_seqs)
        self.max_query_len = max_query_len
        self.max_model_len = max_model_len
        self.device = device
        self.capture = capture
        self.max_blocks_per_seq = max_blocks_per_seq
        # A padding request's positions run up to its bucket: within the model's length.
        self.token_buckets = [t for t in token_buckets(max_num_tokens) if t <= max_model_len]
        self.ragged_reqs = self.buckets[-1] + 1  # room for the padding request
        max_tokens = self.buckets[-1] * max_query_len
        ragged_tokens = self.token_buckets[-1] if self.token_buckets else 0
        # Static inputs, laid out per graph shape so that each step's are one contiguous
        # copy. int64: tokens, positions, slots, (ragged: the rows to sample, read inside
        # the graph), then outside the graph the logits rows to keep (padded) and the rows
        # of device token ids; int32: cu_query_lens, seq_lens, tables.
        self._long = torch.zeros(max(5 * max_tokens, 4 * ragged_tokens + self._row_buckets(ragged_tokens)[-1]),
                                 dtype=torch.int64, device=device)
        self._int = torch.zeros(2 * self.ragged_reqs + 1 + self.ragged_reqs * max_blocks_per_seq,
                                dtype=torch.int32, device=device)
        self.trees = trees
        self._masks = torch.zeros(ragged_tokens if trees else 0, dtype=torch.int64, device=device)
        # A draft head's feature rows (``ForwardBatch.features``), laid out as the tokens.
        width = getattr(model, "feature_input_width", 0)
        self._features = torch.zeros(max(max_tokens, ragged_tokens), width, dtype=model.fc.weight.dtype,
                                     device=device) if width else torch.zeros(0, 0, device=device)
        self._masked_rows = 0  # rows of ``_masks`` the last tree step wrote (the rest are 0)
        # key -> (graph, its outputs: (logits, every row's kept hidden state), its inputs)
        self._graphs: dict[tuple[int, ...], tuple[object, tuple[torch.Tensor, torch.Tensor], ForwardBatch]] = {}
        self._pool = None
        # Where this runner's graphs are warmed up and captured, a stream of its own.
        self._capture_stream = stream_of_its_own(device, self) if capture else None
        # With ``keep_hidden``, each replay leaves its real rows' final hidden states (or
        # feature layers': ``LlamaForCausalLM.kept_rows``) in ``last_hidden``, ragged in
        # schedule order (as ``ModelRunner.keep_hidden``).
        self.keep_hidden = False
        self.last_hidden: torch.Tensor | None = None
        # ``share_inputs``: the longest query of the padded steps whose inputs a draft model
        # replays on (``replay_inputs_of``; 0: none); every ragged step's it may. Each such
        # replay leaves them in ``last_inputs``: (key, the step's scheduled list, its query
        # and sequence lengths, the stream they were written on and an event recorded on
        # it once written, both None off a GPU); a longer padded step, None.
        self.share_inputs = 0
        self.last_inputs: tuple | None = None

    # ------------------------------------------------------------------ eligibility
    def fits(self, output: SchedulerOutput) -> bool:
        """Whether a graph runs the step: every request within the captured query length
        (padded), or the step's tokens within the largest token bucket (ragged)."""
        return self._shape(output.scheduled) is not None

    def fits_lengths(self, num_reqs: int, max_query_len: int) -> bool:
        """Whether a padded graph runs a step of ``num_reqs`` requests whose longest query
        is ``max_query_len``."""
        return num_reqs <= self.buckets[-1] and max_query_len <= self.max_query_len

    def _shape(self, planned) -> tuple[int, ...] | None:
        """The graph for a step: ``(batch bucket, q)`` padded, ``(0, token bucket, logits
        rows)`` ragged, None for an eager step (one that wants a prompt's logits, or feeds
        draft tree nodes where the graphs were made without ``trees``). With ``trees``, a
        tree's verification and a drafter's pass over tree nodes (every fed row's logits,
        explicit positions) are ragged."""
        tree = False
        for p in planned:
            if p.draft_parents is not None or p.tree_nodes is not None:
                if not self.trees:
                    return None
                tree = True
            elif p.prompt_logits:
                return None
        lengths = [len(p.token_ids) + len(p.draft_token_ids) for p in planned]
        q = max(lengths)
        if not tree and self.fits_lengths(len(planned), q):
            return next(b for b in self.buckets if b >= len(planned)), q
        tokens = sum(lengths)
        if len(planned) > self.buckets[-1] or not self.token_buckets or tokens > self.token_buckets[-1]:
            return None
        bucket = next(t for t in self.token_buckets if t >= tokens)
        num_logits = self._num_logits(planned)
        rows = next((r for r in self._row_buckets(bucket) if r >= num_logits), None)
        return None if rows is None else (0, bucket, rows)

    def _row_buckets(self, tokens: int) -> list[int]:
        """The logits rows ragged graphs of ``tokens`` compute (each sampling request's 1 + k
        fit): one per request, and ``max_query_len`` per request."""
        return row_buckets(tokens, self.buckets[-1], self.max_query_len)

    @staticmethod
    def _num_logits(planned) -> int:
        """Logits rows of a step (``host_batch``'s): a fed token's where its prompt's are
        asked for (a drafter's pass over tree nodes), then each sampling row and its drafts'."""
        return sum((len(p.token_ids) - p.sample if p.prompt_logits else 0)
                   + (1 + len(p.draft_token_ids) if p.sample else 0) for p in planned)

    # ------------------------------------------------------------------ capture
    def capture_all(self, query_lens: list[int]) -> None:
        """Capture every bucket for each query length, then every token bucket with each
        of its row counts, largest first (they share a pool)."""
        start = time.perf_counter()
        for q in sorted(query_lens, reverse=True):
            for bucket in reversed(self.buckets):
                self._get((bucket, q))
        for tokens in reversed(self.token_buckets):
            for rows in reversed(self._row_buckets(tokens)):
                self._get((0, tokens, rows))
        logger.info("captured %d CUDA graphs in %.1f s", len(self._graphs), time.perf_counter() - start)

    def _get(self, key: tuple[int, ...]):
        if key not in self._graphs:
            self._graphs[key] = self._build(key)
        return self._graphs[key]

    def _build(self, key: tuple[int, ...]):
        bucket, size = key[:2]
        if bucket:
            batch, rows = self._static_batch(bucket, size), None
        else:
            batch, rows = self._static_ragged_batch(size, key[2])
        self.prepare([], key, 1)  # an all-padding step, for warm-up and capture

        def forward() -> tuple[torch.Tensor, torch.Tensor]:
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch)
            picked = hidden if rows is None else hidden.index_select(0, rows)
            return self.model.compute_logits(picked).float(), self.model.kept_rows(hidden)

        if not self.capture:
            return forward, None, batch
        stream = self._capture_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: autotuning and lazy initialisation happen here
                forward()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=self._capture_stream):
            outputs = forward()
        self._pool = graph.pool()
        return graph, outputs, batch

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
            has_padding=True, features=self._features[:n] if self._features.shape[1] else None)

    def _static_ragged_batch(self, tokens: int, num_rows: int) -> tuple[ForwardBatch, torch.Tensor]:
        """A ragged graph's inputs, and the ``num_rows`` rows it computes logits for."""
        n, reqs, ints = tokens, self.ragged_reqs, self._int
        rows = self._long[3 * n:3 * n + num_rows]
        return ForwardBatch(
            input_ids=self._long[:n], positions=self._long[n:2 * n], slot_mapping=self._long[2 * n:3 * n],
            cu_query_lens=ints[:reqs + 1], seq_lens=ints[reqs + 1:2 * reqs + 1],
            block_tables=ints[2 * reqs + 1:2 * reqs + 1 + reqs * self.max_blocks_per_seq]
            .view(reqs, self.max_blocks_per_seq),
            logits_indices=rows,
            # Worst case: all the bucket's tokens in one request, every request at full length.
            query_lens_host=[n] + [0] * (reqs - 1), seq_lens_host=[self.max_model_len] * reqs,
            has_padding=True, tree_masks=self._masks[:n] if self.trees else None,
            features=self._features[:n] if self._features.shape[1] else None), rows

    # ------------------------------------------------------------------ replay
    @torch.inference_mode()
    def run(self, output: SchedulerOutput, block_size: int, device_ids: DeviceTokenIds | None = None,
            features: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[Σ(1 + k_i), vocab]`` of the real rows, in schedule order. ``features``:
        a draft head's feature rows ``[Σ n_i, width]``, ragged in schedule order."""
        planned = output.scheduled
        key = self._shape(planned)
        graph, outputs, batch = self._get(key)  # before writing: building overwrites inputs
        rows, query_lens, seq_lens = self.prepare(planned, key, block_size, device_ids)
        lengths = [len(p.token_ids) + len(p.draft_token_ids) for p in planned] \
            if self.keep_hidden or features is not None else None
        real = self._real_rows(key, lengths) if lengths else None
        if features is not None:
            if real is None:
                self._features[:features.shape[0]].copy_(features)
            else:
                self._features.index_copy_(0, real, features)
        if self.share_inputs:  # every ragged step (a prompt chunk's), padded ones up to the query
            shared = not key[0] or key[1] <= self.share_inputs
            self.last_inputs = (key, planned, query_lens, seq_lens, *self._written()) if shared else None
        logits, hidden = self._replay(graph, outputs, batch, query_lens, seq_lens)
        if self.keep_hidden:  # copied, as the next replay overwrites them
            self.last_hidden = hidden[:sum(lengths)].clone() if real is None else hidden.index_select(0, real)
        if key[0] == 0:  # ragged: the graph computed the sampled rows' logits, then padding
            return logits[:self._num_logits(planned)]
        return logits if rows is None else logits.index_select(0, rows)

    def _replay(self, graph, outputs, batch: ForwardBatch, query_lens: list[int], seq_lens: list[int]):
        """Replay a graph over the inputs in its buffers; its outputs (logits, hidden)."""
        if self.capture:
            graph.replay()
            return outputs
        # eager: the torch backend needs the real lengths; Triton plans as captured
        if self.model.attention_backend.exact_lengths:
            batch.query_lens_host, batch.seq_lens_host = query_lens, seq_lens
            batch.attn_plans.clear()
        return graph()

    def _written(self) -> tuple[torch.cuda.Stream | None, torch.cuda.Event | None]:
        """The current stream and an event recorded on it (None, None off a GPU: captured
        or not, a draft fed on a stream of its own reads the buffers there)."""
        if self.device.type != "cuda":
            return None, None
        stream = torch.cuda.current_stream(self.device)
        event = torch.cuda.Event()
        event.record(stream)
        return stream, event

    @torch.inference_mode()
    def replay_inputs_of(self, other: GraphRunner, planned) -> bool:
        """Replay this runner's graph for the step ``other`` last replayed, on that step's
        inputs, copied from ``other``'s static buffers on the device (on the current
        stream, once they are written; ``other``'s stream waits for the copy before it
        writes the next step's). For a draft model fed exactly the target's step
        ``planned``: the same tokens at the same positions through the same block ids,
        decoding (padded) or with prompt chunks (ragged). False, nothing run, unless
        ``other`` shares its inputs (``share_inputs``) and last replayed ``planned`` (the
        same list) in a graph whose shape this runner has, laid out alike (the same
        requests' rows for a ragged one), and this runner reads no feature rows."""
        last = other.last_inputs
        if last is None or last[1] is not planned or self._features.shape[1]:
            return False
        key, _, query_lens, seq_lens, stream, written = last
        if key[0]:  # padded: (batch bucket, q)
            bucket, q = key
            if bucket not in self.buckets or q > self.max_query_len:
                return False
            reqs, longs = bucket, 3 * bucket * q  # tokens, positions, slots
        else:  # ragged: (0, tokens, rows); the rows to sample too
            tokens, rows = key[1:]
            if (other.ragged_reqs != self.ragged_reqs or tokens not in self.token_buckets
                    or rows not in self._row_buckets(tokens)):
                return False
            reqs, longs = self.ragged_reqs, 3 * tokens + rows
        if self.capture and key not in self._graphs:  # (never captured mid-run)
            return False
        graph, outputs, batch = self._get(key)
        if written is not None:
            torch.cuda.current_stream(self.device).wait_event(written)
        self._long[:longs].copy_(other._long[:longs])
        ints = 2 * reqs + 1  # cu_query_lens, seq_lens; then the block tables
        width = min(self.max_blocks_per_seq, other.max_blocks_per_seq)
        if width == self.max_blocks_per_seq == other.max_blocks_per_seq:
            self._int[:ints + reqs * width].copy_(other._int[:ints + reqs * width])
        else:
            self._int[:ints].copy_(other._int[:ints])
            tables = self._int[ints:ints + reqs * self.max_blocks_per_seq].view(reqs, -1)
            tables[:, :width].copy_(other._int[ints:ints + reqs * other.max_blocks_per_seq]
                                    .view(reqs, -1)[:, :width])
        if self._masked_rows:  # causal rows, as ``other``'s (a tree step's rows are never shared)
            self._masks[:self._masked_rows].zero_()
            self._masked_rows = 0
        if stream is not None:
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(self.device))
            stream.wait_event(copied)
        self._replay(graph, outputs, batch, query_lens, seq_lens)
        return True

    def _real_rows(self, key: tuple[int, ...], lengths: list[int]) -> torch.Tensor | None:
        """The rows of graph ``key`` that hold the requests' tokens (``lengths`` each), on
        the device; None where they are its first ``sum(lengths)`` rows (ragged, or padded
        with every request at the step's longest query). Padded: request i's rows start
        at i * q."""
        q = key[1]
        if key[0] == 0 or all(n == q for n in lengths):
            return None
        (real,) = to_device([[i * q + r for i, n in enumerate(lengths) for r in range(n)]], torch.int64, self.device)
        return real

    def prepare(self, planned, key: tuple[int, ...], block_size: int,
                device_ids: DeviceTokenIds | None = None
                ) -> tuple[torch.Tensor | None, list[int], list[int]]:
        """Write the step's inputs into the static buffers of graph ``key``; one pass over
        the requests (``host_batch``), one asynchronous copy per dtype. Returns the padded
        logits rows to keep (None: all of them) and the query and sequence lengths of the
        requests that have tokens, padding included."""
        counts = device_ids.counts if device_ids is not None else None
        if key[0] == 0:
            return self._prepare_ragged(planned, key[1], key[2], block_size, counts, device_ids)
        bucket, q = key
        host = host_batch(planned, block_size, counts, span=q, long_offset=self.model.model.rotary.long_offset)
        host.add_padding(q, bucket - len(planned))
        count = bucket * q
        keep_all = len(host.logits_rows) == count
        copy_into(self._long, [host.input_ids, host.positions, host.slots]
                  + ([] if keep_all else [host.logits_rows]) + [host.device_rows])
        tables = block_table_array(planned, bucket, self.max_blocks_per_seq)
        copy_into(self._int, [host.cu_query_lens, host.seq_lens, tables])
        offset = 3 * count
        rows_t = None
        if not keep_all:
            rows_t, offset = self._long[offset:offset + len(host.logits_rows)], offset + len(host.logits_rows)
        self._scatter_device_ids(count, offset, len(host.device_rows), device_ids)
        return rows_t, host.query_lens, host.seq_lens

    def _prepare_ragged(self, planned, tokens: int, num_rows: int, block_size: int,
                        counts: list[int] | None, device_ids: DeviceTokenIds | None
                        ) -> tuple[None, list[int], list[int]]:
        """The ragged layout: the requests' rows, then one padding request up to
        ``tokens`` (slot -1, positions 0.., keys from block 0), then requests without
        rows; the rows to sample padded with row 0 up to ``num_rows``."""
        host = host_batch(planned, block_size, counts, long_offset=self.model.model.rotary.long_offset)
        host.add_padding(tokens - len(host.input_ids))
        copy_into(self._long, [host.input_ids, host.positions, host.slots,
                               host.logits_rows + [0] * (num_rows - len(host.logits_rows)), host.device_rows])
        empty = self.ragged_reqs - len(host.query_lens)
        tables = block_table_array(planned, self.ragged_reqs, self.max_blocks_per_seq)
        copy_into(self._int, [host.cu_query_lens + [tokens] * empty, host.seq_lens + [0] * empty, tables])
        self._scatter_device_ids(tokens, 3 * tokens + num_rows, len(host.device_rows), device_ids)
        if host.tree_masks is not None or self._masked_rows:  # (zeros clear the last tree step's)
            masks = host.tree_masks or []
            width = max(len(masks), self._masked_rows)
            copy_into(self._masks, [masks + [0] * (width - len(masks))])
            self._masked_rows = len(masks)
        return None, host.query_lens, host.seq_lens

    def _scatter_device_ids(self, num_tokens: int, offset: int, count: int,
                            device_ids: DeviceTokenIds | None) -> None:
        """Token ids still on the device into the step's token rows (listed at ``offset``)."""
        if device_ids is not None:
            self._long[:num_tokens].index_copy_(0, self._long[offset:offset + count], device_ids.ids)
