"""Turns a SchedulerOutput into tensors, runs the target model over the paged KV cache,
and returns the logits the sampler needs. No scheduling policy lives here."""
from __future__ import annotations

import logging
import time

import torch

from specserve.batch import DeviceTokenIds, ForwardBatch, block_table_array, host_batch
from specserve.config import EngineConfig
from specserve.cuda_graphs import GraphRunner, graph_logits_rows
from specserve.distributed import SINGLE, TPGroup
from specserve.errors import RanksOutOfStepError, SpecserveError
from specserve.sampling_params import SamplingParams
from specserve.scheduler import ScheduledRequest, SchedulerOutput
from specserve.step_channel import StepChannel
from specserve.transfer import to_device

logger = logging.getLogger("specserve")

# A float8 KV cache's calibration (calibrate_kv_scales): the pass stores over this scale, so
# that values up to 448 times it are measured unsaturated; the scales then leave room for
# values this many times the largest the calibration text produced.
CALIBRATION_SCALE = 64.0
KV_HEADROOM = 4.0


def kv_bytes_per_block(model, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer of ``model`` for one block of ``block_size`` tokens (the
    KV heads this rank holds, under tensor parallelism)."""
    attn = model.model.layers[0].self_attn
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * model.config.num_hidden_layers * block_size * attn.num_kv_heads * attn.head_dim * element


class ModelRunner:
    """Owns the model's weights and its KV cache tensors on one device.

    Under tensor parallelism (``tp`` of several ranks) every rank has a runner over its
    shard, and the runners must run the same passes in the same order: rank 0's runner
    announces each pass (``execute``) and each CUDA-graph set-up (``enable_graphs``) on
    its ``channel`` before running it, and the other ranks' runners replay what it
    announces (``tp_worker.follow``). Blocks are ids shared by all ranks, so every rank's
    cache gets the smallest number of blocks any rank can hold.
    """

    def __init__(self, model, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                 num_blocks: int | None = None, extra_bytes_per_block: int = 0,
                 max_useful_blocks: int | None = None, tp: TPGroup = SINGLE,
                 kv_dtype: torch.dtype | None = None) -> None:
        """``num_blocks`` fixes the cache size (a draft model matching its target's);
        otherwise it comes from the memory budget, which also pays for
        ``extra_bytes_per_block`` held elsewhere per block (the draft model's cache), capped
        at ``max_useful_blocks`` (what max_num_seqs full-length requests could use).
        ``kv_dtype``: the cache's, if not the model's (float8: ``calibrate_kv_scales``)."""
        self.tp = tp
        self.channel = None
        if tp.size > 1 and tp.is_driver:
            self.channel = StepChannel(tp)
        self.max_useful_blocks = max_useful_blocks
        self.model = model
        self.config = config
        self.device = device
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype
        self.block_size = config.block_size
        self.extra_bytes_per_block = extra_bytes_per_block
        self.graphs = None  # a GraphRunner once enable_graphs() ran
        self.closed = False
        # With ``keep_hidden`` set (by a drafter that reads them), each pass keeps its final
        # hidden states ``[num_tokens, hidden]`` (ragged, schedule order; an EAGLE-3 head's
        # target keeps its feature layers instead: ``kept_rows``) in ``last_hidden``
        # and the scheduled list it ran in ``last_pass``, until the next pass.
        self.keep_hidden = False
        self.last_hidden: torch.Tensor | None = None
        self.last_pass: list | None = None
        self.num_blocks = num_blocks or tp.min(self._num_kv_blocks())
        shape = (self.num_blocks, self.block_size, self._num_kv_heads, self._head_dim)
        try:
            # One tensor [layers, K/V, blocks, block_size, kv_heads, head_dim]; each layer's
            # K and V caches are views of it, so a block is copied in all of them at once.
            self.kv_storage = torch.zeros((self._num_layers, 2, *shape), dtype=self.kv_dtype, device=device)
            self.kv_caches = [(layer[0], layer[1]) for layer in self.kv_storage]
        except (RuntimeError, MemoryError) as exc:  # out of memory: say what to change

            raise SpecserveError(
                f"cannot allocate a KV cache of {self.num_blocks} blocks "
                f"({self.num_blocks * self.bytes_per_block / 2**30:.1f} GiB): "
                f"{str(exc).splitlines()[0][:120]}; lower num_kv_blocks or the memory budget") from None

    # ---------------------------------------------------------------- sizing
    @property
    def _num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def _num_kv_heads(self) -> int:
        return self.model.model.layers[0].self_attn.num_kv_heads  # this rank's

    @property
    def _head_dim(self) -> int:
        return self.model.model.layers[0].self_attn.head_dim

    @property
    def bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.model, self.block_size, self.kv_dtype)

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.device.type == "cuda":
            # Our share of the card, less what we already hold (weights), and never more
            # than is actually free (other processes may share the GPU).
            free, total = torch.cuda.mem_get_info(self.device)
            ours = total * self.config.gpu_memory_utilization - torch.cuda.memory_reserved(self.device)
            budget = min(ours, free - 2**30) - self._activation_reserve()
            where = (f"GPU has {free / 2**30:.1f} of {total / 2**30:.1f} GiB free, "
                     f"gpu_memory_utilization {self.config.gpu_memory_utilization}")
        else:
            budget = self.config.kv_cache_memory_gib * 2**30
            where = f"kv_cache_memory_gib {self.config.kv_cache_memory_gib}"
        num_blocks = int(budget // (self.bytes_per_block + self.extra_bytes_per_block))
        if self.max_useful_blocks is not None and num_blocks > 0:
            num_blocks = min(num_blocks, self.max_useful_blocks)
        if num_blocks < 1:
            raise SpecserveError(f"no memory left for the KV cache ({where}); free memory or "
                                 "raise the budget")
        return num_blocks

    def _activation_reserve(self) -> int:
        """A generous bound on one step's transient memory (activations and logits), and
        the logits the CUDA graphs keep as their outputs (the engine captures them after
        the cache is allocated, so the budget must leave room for them)."""
        cfg = self.model.config
        c = self.config
        tokens = c.max_num_batched_tokens
        per_token = 4 * (3 * cfg.hidden_size + 3 * cfg.intermediate_size)
        logits = c.max_num_seqs * cfg.vocab_size * 4 * 4
        reserve = tokens * per_token * 4 + logits + 256 * 2**20
        backend = getattr(getattr(self.model, "attention_backend", None), "name", None)
        if self.device.type == "cuda" and not c.enforce_eager and backend == "triton":
            max_query_len = 1 + (c.max_draft_tokens if c.speculative_method != "none" else 0)
            rows = graph_logits_rows(c.max_num_seqs, max_query_len, min(tokens, c.cuda_graph_max_tokens))
            reserve += rows * cfg.vocab_size * (4 + torch.empty((), dtype=self.dtype).element_size())
        return reserve

    # ---------------------------------------------------------------- CUDA graphs
    def enable_graphs(self, max_query_len: int, max_model_len: int, capture: bool = True) -> None:
        """Run decode/verify steps of up to ``max_query_len`` tokens per request as padded
        CUDA graph replays, and steps with prefill chunks within the token budget as ragged
        ones (``capture=False``: the same static-buffer paths, eagerly — for tests)."""
        if self.channel is not None:
            self.channel.send_graphs(max_query_len, max_model_len, capture)
        self.graphs = GraphRunner(
            self.model, self.kv_caches, max_num_seqs=self.config.max_num_seqs,
            max_query_len=max_query_len,
            max_blocks_per_seq=-(-(max_model_len + max_query_len) // self.block_size),
            max_model_len=max_model_len, device=self.device, capture=capture,
            max_num_tokens=min(self.config.max_num_batched_tokens, self.config.cuda_graph_max_tokens),
            trees=self.config.draft_tree_nodes > 0)
        self.graphs.keep_hidden = self.keep_hidden  # set by a drafter's bind, before graphs
        if capture:
            with torch.inference_mode():
                self.compile_kernels(max_model_len)
                self.graphs.capture_all(list(range(1, max_query_len + 1)))

    @torch.inference_mode()
    def compile_kernels(self, max_model_len: int) -> int:
        """Run one eager pass per pair of the attention backend's ``warmup_lengths`` (one
        request, nothing stored in the cache: its slots are -1), so that every kernel
        variant a step can pick is compiled before the first request, not in a step that
        first meets it (a draft's backlog, a long prompt chunk: hundreds of milliseconds
        each). With draft trees, each pair once more as a tree's rows. Returns the passes run."""
        backend = self.model.attention_backend
        pairs = backend.warmup_lengths(max_model_len)
        trees = (False, True) if self.config.draft_tree_nodes > 0 else (False,)
        width = getattr(self.model, "feature_input_width", 0)
        start = time.perf_counter()
        for span, seq in pairs:
            for tree in trees:
                batch = self._warmup_batch(span, seq, tree, width)
                self.model(batch.input_ids, batch.positions, self.kv_caches, batch)
        if pairs:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            logger.info("compiled the %s kernels for %d step shapes in %.1f s", backend.name,
                        len(pairs) * len(trees), time.perf_counter() - start)
        return len(pairs) * len(trees)

    def _warmup_batch(self, span: int, seq: int, tree: bool, width: int) -> ForwardBatch:
        """One request's last ``span`` of ``seq`` tokens, all keys in block 0 (whatever it
        holds: the outputs are thrown away), no slot written."""
        dev, long = self.device, torch.int64
        return ForwardBatch(
            input_ids=torch.zeros(span, dtype=long, device=dev),
            positions=torch.arange(seq - span, seq, dtype=long, device=dev),
            slot_mapping=torch.full((span,), -1, dtype=long, device=dev),
            block_tables=torch.zeros(1, -(-seq // self.block_size), dtype=torch.int32, device=dev),
            cu_query_lens=torch.tensor([0, span], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([seq], dtype=torch.int32, device=dev),
            logits_indices=torch.zeros(0, dtype=long, device=dev),
            query_lens_host=[span], seq_lens_host=[seq], has_padding=True,
            features=torch.zeros(span, width, dtype=self.model.fc.weight.dtype, device=dev) if width else None,
            tree_masks=torch.zeros(span, dtype=long, device=dev) if tree else None)

    @torch.inference_mode()
    def calibrate_kv_scales(self, token_ids: list[int], block_table: list[int]) -> list[tuple[float, float]]:
        """A float8 cache's scales per layer, from one prefill of ``token_ids`` into the
        slots ``block_table`` gives them: each layer's K and V are stored over
        ``CALIBRATION_SCALE`` (no value saturates), their largest magnitudes read back,
        and the layer's scales set so that ``KV_HEADROOM`` times them stores as 448.
        Before any CUDA graph captures the scales; under tensor parallelism, not yet."""
        layers = [layer.self_attn for layer in self.model.model.layers]
        for attn in layers:
            attn.kv_scales = (CALIBRATION_SCALE, CALIBRATION_SCALE)
        step = SchedulerOutput([ScheduledRequest("__kv_scales", list(token_ids), 0, list(block_table),
                                                 SamplingParams(temperature=0))], [])
        self._forward(step, None, None)
        positions = torch.arange(len(token_ids))
        slots = (torch.tensor(block_table)[positions // self.block_size] * self.block_size
                 + positions % self.block_size).to(self.device)
        scales = []
        for attn, caches in zip(layers, self.kv_caches):
            amax = [cache.view(-1, *cache.shape[2:]).index_select(0, slots).float().abs().max().item()
                    * CALIBRATION_SCALE for cache in caches]
            # (below the calibration's resolution, its smallest float8 step, a magnitude reads as 0)
            attn.kv_scales = tuple(KV_HEADROOM * max(m, CALIBRATION_SCALE * 2.0 ** -9) / 448.0 for m in amax)
            scales.append(attn.kv_scales)
        return scales

    # ---------------------------------------------------------------- the step
    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, num_layers: int | None = None,
                device_ids: DeviceTokenIds | None = None, features: torch.Tensor | None = None) -> torch.Tensor:
        """Run one ragged forward pass; returns logits ``[num_logits, vocab]`` float32 for
        each sampling request's last 1 + k positions, in schedule order. ``num_layers``
        runs only the first layers (layer-skip drafting). ``device_ids``: tokens whose
        values are still on the device (their lists hold placeholders). ``features``: a
        draft head's feature rows, one per token (``ForwardBatch.features``)."""
        if self.closed:
            raise RuntimeError("this model runner was closed")
        if self.channel is None:
            return self._forward(output, num_layers, device_ids, features)
        if features is not None:
            raise ValueError("a draft head's passes run on one rank: its runner has no tensor-parallel channel")
        try:
            self.channel.send_step(output, num_layers, device_ids)
            return self._forward(output, num_layers, device_ids)
        except Exception as exc:
            # The others may be waiting inside this pass: no further message (not even
            # the stop) could be matched right, so none is sent; torchrun ends them.
            self.channel = None
            self.closed = True
            raise RanksOutOfStepError(f"a tensor-parallel forward pass failed on rank 0 "
                                      f"({type(exc).__name__}: {exc})") from exc

    def _forward(self, output: SchedulerOutput, num_layers: int | None,
                 device_ids: DeviceTokenIds | None, features: torch.Tensor | None = None) -> torch.Tensor:
        if self.keep_hidden:
            self.last_pass = output.scheduled
        if self.graphs is not None and num_layers is None and self.graphs.fits(output):
            logits = self.graphs.run(output, self.block_size, device_ids, features)
            if self.keep_hidden:
                self.last_hidden = self.graphs.last_hidden
            return logits
        batch = self.prepare(output, device_ids)
        batch.features = features
        return self.forward(batch, num_layers)

    @torch.inference_mode()
    def copy_blocks(self, block_copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (source, destination) of every layer's K and V cache; under
        tensor parallelism every rank copies its own. A few pairs are one strided copy
        each: on a GPU host every op costs host time, and an index gather and scatter
        costs several."""
        if self.channel is not None:
            self.channel.send_copies(block_copies)
        raw = self.kv_storage.view(torch.uint8)  # bytes: a CPU has no float8 index_copy_
        blocks = raw.view(-1, self.num_blocks, raw[0, 0, 0].numel())
        if len(block_copies) <= 4:
            for src, dst in block_copies:
                blocks[:, dst].copy_(blocks[:, src])
            return
        src, dst = to_device([[s for s, _ in block_copies], [d for _, d in block_copies]],
                             torch.int64, self.device)
        blocks.index_copy_(1, dst, blocks.index_select(1, src))

    @torch.inference_mode()
    def copy_slots(self, slot_copies: list[tuple[int, int]]) -> None:
        """Copy single token slots (source, destination) of every layer's K and V cache, all
        sources read before any is written (a draft tree's path moving to its chain's
        slots, ``spec.tree``)."""
        raw = self.kv_storage.view(torch.uint8)  # bytes: a CPU has no float8 index_copy_
        slots = raw.view(*raw.shape[:2], self.num_blocks * self.block_size, -1)
        src, dst = to_device([[s for s, _ in slot_copies], [d for _, d in slot_copies]], torch.int64, self.device)
        slots.index_copy_(2, dst, slots.index_select(2, src))

    def padded_tokens(self, output: SchedulerOutput, lengths: list[int] | None = None) -> int:
        """The query rows a pass over ``output`` computes where it pads: a CUDA-graph
        replay pads every request to the longest query, and an attention backend that
        batches short spans (the torch one) pads those to the longest of them (in its
        attention only). 0 where nothing is padded. ``lengths``: each request's query
        length, if the caller has them."""
        if lengths is None:
            lengths = [len(p.token_ids) + len(p.draft_token_ids) for p in output.scheduled]
        if self.graphs is not None and self.graphs.fits_lengths(len(lengths), max(lengths)):
            return len(lengths) * max(lengths)
        short = [n for n in lengths if n <= self.model.attention_backend.padded_span]
        return len(short) * max(short) if short else 0

    def pads_short_spans(self, with_prefill: bool) -> bool:
        """Whether a step's decode and verify spans are padded to the longest of them (see
        ``padded_tokens``); a step with a prefill chunk runs unpadded (a ragged graph, or
        eagerly)."""
        return (self.graphs is not None and not with_prefill) or self.model.attention_backend.padded_span > 0

    def forward(self, batch: ForwardBatch, num_layers: int | None = None) -> torch.Tensor:
        """The model over a prepared batch: logits ``[num_logits, vocab]`` float32."""
        if num_layers is None and not self.keep_hidden and batch.features is None:
            fused = getattr(self.model, "fused_logits", None)
            logits = fused(self.kv_caches, batch) if fused is not None else None
            if logits is not None:
                return logits
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch, num_layers)
        if self.keep_hidden:
            self.last_hidden = self.model.kept_rows(hidden)
        return self.model.compute_logits(hidden[batch.logits_indices]).float()

    def close(self, tell_ranks: bool = True) -> None:
        """Tell the other ranks to stop (rank 0; not when one is known to be gone), free the
        CUDA graphs (they hold on to the NCCL communicator until they go), and let go of the
        KV cache and the model, so their memory is freed once nothing else holds them.
        Idempotent."""
        if self.channel is not None and tell_ranks:
            self.channel.send_shutdown()
            self.channel = None
        self.graphs = None
        self.kv_storage = self.kv_caches = self.last_hidden = self.last_pass = None
        self.model = None
        self.closed = True

    def prepare(self, output: SchedulerOutput, device_ids: DeviceTokenIds | None = None) -> ForwardBatch:
        """The step's tensors: built on the host in one pass over the requests (runs of
        tokens at a time) and sent in one asynchronous copy per dtype, no sync."""
        planned = output.scheduled
        host = host_batch(planned, self.block_size, device_ids.counts if device_ids is not None else None,
                          long_offset=self.model.model.rotary.long_offset)
        input_ids_t, positions_t, slots_t, logits_t, device_rows_t = to_device(
            [host.input_ids, host.positions, host.slots, host.logits_rows, host.device_rows],
            torch.int64, self.device)
        tables = block_table_array(planned, len(planned), max(len(p.block_table) for p in planned))
        tables_t, cu_t, seq_lens_t = to_device([tables, host.cu_query_lens, host.seq_lens], torch.int32,
                                               self.device)
        tree_masks_t = None
        if host.tree_masks is not None:
            (tree_masks_t,) = to_device([host.tree_masks], torch.int64, self.device)
        if device_ids is not None:
            input_ids_t.index_copy_(0, device_rows_t, device_ids.ids)
        return ForwardBatch(
            input_ids=input_ids_t, positions=positions_t, slot_mapping=slots_t, block_tables=tables_t,
            cu_query_lens=cu_t, seq_lens=seq_lens_t, logits_indices=logits_t,
            query_lens_host=host.query_lens, seq_lens_host=host.seq_lens, tree_masks=tree_masks_t)
