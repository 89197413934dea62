"""LLMEngine (add_request / step / abort) and the offline ``LLM`` API on top of it."""
from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections import Counter
from collections.abc import Sequence

from tqdm.auto import tqdm

from specserve.attention import get_backend
from specserve.batch import DeviceTokenIds
from specserve.config import EngineConfig
from specserve.drafts import build_drafter
from specserve.distributed import init_tensor_parallel
from specserve.drafts.base import DRAFT_FORKS, DraftProposal
from specserve.heap import freeze_heap
from specserve.errors import RanksOutOfStepError, SpecserveError
from specserve.kv_cache import KVCacheManager
from specserve.loader import build_model, eos_token_ids, load_hf_config, load_tokenizer, resolve_model
from specserve.model_runner import ModelRunner
from specserve.prompts import chat_prompt_ids, tokenize_prompt
from specserve.outputs import OutputProcessor, RequestOutput
from specserve.request import FinishReason, Request
from specserve.metrics import SpecDecodeStats
from specserve.rejection_sampler import RejectionSampler, VerifyRequest
from specserve.sampling_params import SamplingParams
from specserve.scheduler import (RequestUpdate, ScheduledRequest, Scheduler, SchedulerOutput,
                                 StepResult)
from specserve.spec_controller import DraftLengthController

logger = logging.getLogger("specserve")


class LLMEngine:
    """One model on one device, stepping a continuous batch.

    ``step()`` is the whole engine: schedule, propose drafts, verify them (and every
    prefill chunk) in one ragged forward pass, rejection-sample, update.

    With ``tensor_parallel_size`` N > 1 the engine is rank 0 of N processes started by
    torchrun: it holds its shard of the target model, and its runner has the other ranks
    (``tp_worker.run_worker``) run every forward pass with it. Drafting, sampling and
    scheduling happen here only. ``shutdown()`` releases the other ranks.
    """

    def __init__(self, config: EngineConfig | None = None, **kwargs) -> None:
        config = config or EngineConfig(**_engine_kwargs(kwargs))
        self.config = config
        self.tp = init_tensor_parallel(config.tensor_parallel_size, config.device)
        if not self.tp.is_driver:
            raise SpecserveError(f"rank {self.tp.rank}: the engine runs on rank 0; the other "
                                 "ranks run specserve.tp_worker.run_worker(config)")
        self.device = self.tp.device if self.tp.size > 1 else config.torch_device
        self.dtype = config.torch_dtype
        with self.tp.rank_zero_first():  # a GGUF is converted into the cache once
            files = resolve_model(config.model)
        self.model_name = files.name
        self.hf_config = load_hf_config(files)
        self.tokenizer = load_tokenizer(files, config.tokenizer)
        self.eos_token_ids = eos_token_ids(files, self.hf_config, self.tokenizer)
        backend = get_backend(config.attention_backend, self.device)
        model = build_model(files, self.hf_config, self.dtype, self.device, backend, tp=self.tp)
        self.drafter = build_drafter(config, model, self.hf_config, self.tokenizer,
                                     self.device, self.dtype)
        self.max_model_len = self._max_model_len()
        extra = self.drafter.kv_bytes_per_block() if self.drafter else 0
        useful = config.max_num_seqs * -(-(self.max_model_len + config.num_speculative_tokens)
                                         // config.block_size)
        self.runner = ModelRunner(model, config, self.device, self.dtype, extra_bytes_per_block=extra,
                                  max_useful_blocks=useful, tp=self.tp)
        # The other ranks wait for rank 0's word: release them even if shutdown() is
        # never called (at garbage collection or exit).
        self._release_ranks = weakref.finalize(self, self.runner.close) if self.tp.size > 1 else None
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size)
        self._fit_max_model_len_to_cache()
        if self.drafter:
            self.drafter.bind(self.runner)
        if self.device.type == "cuda" and backend.name == "triton" and not config.enforce_eager:
            self.enable_graphs()
        self.scheduler = Scheduler(self.kv, config.max_num_batched_tokens, config.max_num_seqs,
                                   self.max_model_len, self._draft_forks())
        self.sampler = RejectionSampler(self.device, config.seed)
        self.controller = None
        if self.drafter and config.speculative_adaptive:
            self.controller = DraftLengthController(config.num_speculative_tokens,
                                                    forks=self.scheduler.draft_forks,
                                                    first_draft_in_catch_up=self.drafter.needs_every_step)
            self._profile_step_cost()
            # The profile times passes alone, live steps the host work around them too: it
            # stays to tell costs apart that a steady state cannot, but weighs little.
            self.controller.target_cost.anchor(weight=0.1)
        self.outputs = OutputProcessor(self.tokenizer)
        self._pending: list[RequestOutput] = []  # finished outside step() (aborts)
        self.spec_stats = SpecDecodeStats()        # over the engine's lifetime
        self.draft_length_counts: Counter[int] = Counter()  # k verified per request-step
        self._draft_s = 0.0  # the last step's drafting time (the controller's cost model)
        self._drafted = False  # whether the last step planned any drafts
        # The running requests sorted for the controller, kept up to date step by step.
        self._sorted = _SortedRunning(config.num_speculative_tokens)
        self._ids = itertools.count()
        self._log_startup(backend.name)
        freeze_heap()

    def enable_graphs(self, capture: bool = True) -> None:
        """CUDA graphs for the target's decode/verify steps and the drafter's steps
        (``capture=False``: the same padded path run eagerly, which the CPU tests use)."""
        max_k = self.config.num_speculative_tokens if self.drafter else 0
        self.runner.enable_graphs(1 + max_k, self.max_model_len, capture)
        if self.drafter:
            self.drafter.enable_graphs(self.max_model_len, capture)

    def _draft_forks(self) -> list[tuple[int, int]]:
        """Where further draft paths fork from a request's own (``num_draft_paths`` - 1 of
        ``DRAFT_FORKS``); refused for a drafter that proposes one path only."""
        paths = self.config.num_draft_paths
        if self.drafter is None:  # speculation off (k = 0): nothing to fork
            return []
        if paths > 1 and self.drafter.max_paths < paths:
            raise SpecserveError(f"num_draft_paths {paths}: this drafter ({self.drafter.describe()}) "
                                 f"proposes {self.drafter.max_paths} path(s) at most")
        return list(DRAFT_FORKS[:paths - 1])

    def _max_model_len(self) -> int:
        limit = getattr(self.hf_config, "max_position_embeddings", None) or 2**31
        draft_limit = getattr(self.drafter, "max_positions", None)
        if draft_limit and draft_limit < limit:
            limit = draft_limit  # the draft must be able to run every position too
        wanted = self.config.max_model_len or limit
        if wanted > limit:
            raise SpecserveError(f"max_model_len {wanted} exceeds the maximum {limit} "
                                 f"the model{' and draft' if draft_limit else ''} support")
        return wanted

    def _fit_max_model_len_to_cache(self) -> None:
        """One request must always be able to finish alone, or preemption could loop forever."""
        capacity = self.kv.num_blocks * self.kv.block_size
        if self.max_model_len <= capacity:
            return
        if self.config.max_model_len is not None:
            raise SpecserveError(f"the KV cache holds {capacity} tokens, less than max_model_len "
                                 f"{self.max_model_len}; give it more memory or lower max_model_len")
        logger.info("max_model_len lowered from %d to the KV cache's %d tokens",
                    self.max_model_len, capacity)
        self.max_model_len = capacity

    def _log_startup(self, backend: str) -> None:
        c = self.config
        params = self.runner.model.num_parameters
        per_rank = " per rank" if self.tp.size > 1 else ""
        logger.info(
            "specserve engine ready\n"
            "  model       %s (%s, %.0fM parameters%s)\n"
            "  device      %s, dtype %s, attention backend %s\n"
            "  KV cache    %d blocks x %d tokens = %d tokens (%.2f GiB%s)\n"
            "  scheduling  max_num_batched_tokens=%d max_num_seqs=%d max_model_len=%d\n"
            "  speculation %s",
            self.model_name, self.hf_config.architectures[0], params / 1e6, per_rank,
            f"{self.device} (rank 0 of {self.tp.size}, tensor parallel)" if self.tp.size > 1 else self.device,
            str(self.dtype).removeprefix("torch."), backend,
            self.kv.num_blocks, c.block_size, self.kv.num_blocks * c.block_size,
            self.kv.num_blocks * self.runner.bytes_per_block / 2**30, per_rank,
            c.max_num_batched_tokens, c.max_num_seqs, self.max_model_len,
            f"{self.drafter.describe()}, k {'adaptive, at most ' if self.controller else '= '}"
            f"{c.num_speculative_tokens}" if self.drafter else "off")

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    req_id: str | None = None) -> str:
        """Queue a request; returns its id. Raises ValueError on bad input, queuing nothing."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        text, token_ids = self._tokenize(prompt)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; the maximum is "
                             f"{self.max_model_len - 1} (max_model_len {self.max_model_len})")
        if self.kv.num_blocks_for(len(token_ids) + 1) > self.kv.num_blocks:
            raise ValueError(f"prompt has {len(token_ids)} tokens; the KV cache holds only "
                             f"{self.kv.num_blocks * self.kv.block_size}")
        if req_id is None:
            req_id = next(i for i in map(str, self._ids) if i not in self.scheduler.requests)
        req_id = str(req_id)
        req = Request(req_id, token_ids, params, self.eos_token_ids, prompt=text)
        self.scheduler.add_request(req)
        self.outputs.add_request(req)
        return req_id

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of a chat, ready for the assistant's turn (see ``prompts.chat_prompt_ids``)."""
        return chat_prompt_ids(self.tokenizer, messages)

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        return tokenize_prompt(self.tokenizer, prompt, self.hf_config.vocab_size)

    def abort(self, req_id: str) -> bool:
        """Cancel a request; its final output (finish_reason 'abort') comes from the next
        ``step()``. Returns False when it is unknown or already finished."""
        req = self.scheduler.finish_request(req_id, FinishReason.ABORT)
        if req is None:
            return False
        self._pending.append(self._finish_output(req))
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._pending)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Schedule -> propose -> verify -> update. Returns an output for every request
        that produced tokens or finished in this step."""
        start = time.perf_counter()
        outputs, self._pending = self._pending, []
        drafts = self._draft_lengths()
        scheduled = self.scheduler.schedule(drafts, self.controller.unforked if self.controller else ())
        if scheduled.is_empty:
            return outputs
        try:
            result = self._verify(scheduled)
        except RanksOutOfStepError:
            raise  # the ranks cannot go on together: end the engine, not just the step
        except Exception as exc:  # never a wedged engine: the step's requests end with an error
            logger.exception("engine step failed; ending its %d requests", len(scheduled.scheduled))
            return outputs + self._fail(scheduled, exc)
        updates = self.scheduler.update(scheduled, result)
        outputs += [self._postprocess(u) for u in updates]
        if self.controller:
            # The whole step: the host work around the pass (verify lists, rollback,
            # detokenising more tokens) is part of what drafts cost, most of it on a GPU.
            elapsed = time.perf_counter() - start
            # Without drafts each update is one token (the usual step where drafting does not pay).
            emitted = sum([len(u.new_token_ids) for u in updates]) if self._drafted else len(updates)
            self.controller.observe_goodput(emitted, elapsed)
            if self.controller.wants_step_cost:
                self._observe_cost(scheduled, self._draft_s, elapsed - self._draft_s)
        return outputs

    def _postprocess(self, update: RequestUpdate) -> RequestOutput:
        """Detokenise, apply stop strings, count speculation, make the caller's output."""
        req = update.req
        kept = self.outputs.process(req, update.new_token_ids)
        if kept is not None:  # a stop string: tokens after it never happened
            req.drop_last(len(update.new_token_ids) - kept)
            if req.is_finished:
                req.finish_reason = FinishReason.STOP
            else:
                self.scheduler.finish_request(req.req_id, FinishReason.STOP)
        self._record_speculation(update, kept)
        return self._finish_output(req) if req.is_finished else self.outputs.make_output(req)

    def _record_speculation(self, update: RequestUpdate, kept: int | None) -> None:
        """Count drafts and the accepted tokens the request kept (a stop cuts them)."""
        kept = len(update.new_token_ids) if kept is None else kept
        accepted = min(update.num_accepted, kept)
        if self.controller and update.num_planned:
            self.controller.observe_acceptance(update.req.req_id, update.num_planned, update.num_draft_tokens,
                                               update.num_accepted_own, update.num_paths,
                                               update.num_accepted - update.num_accepted_own)
        path_won = update.path > 0
        update.req.spec_stats.record(update.num_draft_tokens, accepted, path_won)
        self.spec_stats.record(update.num_draft_tokens, accepted, path_won)

    def _verify(self, scheduled: SchedulerOutput) -> StepResult:
        """Propose drafts, run the one ragged target pass, rejection-sample."""
        start = time.perf_counter()
        # k per sampling request (only those draft): the histogram, and whether anyone drafts.
        lookahead = [p.num_lookahead for p in scheduled.scheduled if p.sample and not p.path] \
            if self.drafter else []
        self._drafted = any(lookahead)
        if scheduled.block_copies:  # draft paths' first blocks, in every cache
            self.runner.copy_blocks(scheduled.block_copies)
            self.drafter.copy_blocks(scheduled.block_copies)
        proposal = self._propose(scheduled, self._drafted)
        drafted = time.perf_counter()
        draft_ids = proposal.draft_ids if proposal else None  # proposals still on the device
        device_ids = draft_ids if draft_ids is None else DeviceTokenIds(
            draft_ids, [len(p.draft_token_ids) for p in scheduled.scheduled])
        logits = self.runner.execute(scheduled, device_ids=device_ids)
        verify = [VerifyRequest(p.req_id, p.params, p.draft_token_ids,
                                first_position=p.start_pos + len(p.token_ids))
                  for p in scheduled.scheduled if p.sample]
        draft_probs = proposal.draft_probs if proposal else None
        # The step's one sync; device drafts come back in it, filling draft_token_ids.
        result = StepResult(self.sampler(logits, verify, draft_probs, draft_ids))
        if self.drafter:
            if self._drafted:
                self.draft_length_counts.update(lookahead)
            else:  # most steps under load when drafting does not pay: one count
                self.draft_length_counts[0] += len(lookahead)
        # What drafting cost: the drafter's time less its catch-up, which runs whatever k is.
        self._draft_s = drafted - start - (self.drafter.last_catch_up_s if proposal else 0.0)
        return result

    def _observe_cost(self, scheduled: SchedulerOutput, draft_s: float, target_s: float) -> None:
        planned = scheduled.scheduled
        fed = [len(p.token_ids) for p in planned]
        drafted = [len(p.draft_token_ids) for p in planned]
        lengths = [n + d for n, d in zip(fed, drafted)]
        lookahead = [p.num_lookahead for p in planned]
        tokens = sum(lengths)
        prefill = tokens - sum(drafted) - fed.count(1)  # the chunks' tokens (fed > 1)
        context = sum([p.start_pos for p in planned]) + tokens
        self.controller.observe_step(tokens - prefill, len(drafted) - drafted.count(0), target_s,
                                     max(lookahead), len(lookahead) - lookahead.count(0), draft_s,
                                     self.runner.padded_tokens(scheduled, lengths), len(planned), context,
                                     prefill)

    def _profile_step_cost(self) -> None:
        """Seed the controller's cost model: time a few verify passes of dummy requests
        (batch sizes x how many of them draft k tokens: none, one, all; two context
        lengths) over scratch KV blocks, freed afterwards. One drafter in a batch
        separates what padding costs (every request padded to 1 + k on a CUDA graph) from
        what real tokens cost."""
        c = self.config
        k = c.num_speculative_tokens
        greedy = SamplingParams(temperature=0)
        batches = sorted({1, min(8, c.max_num_seqs), min(32, c.max_num_seqs)})
        # A longer context for the undrafted batches, so the fit can tell what a request
        # costs from what the tokens of its context cost, and one draft each besides k,
        # so it can tell a verify span's cost from its tokens'.
        plans = [(batch, num_drafting, 4 * c.block_size, k)
                 for batch in batches for num_drafting in sorted({0, 1, batch})]
        plans += [(batch, 0, 16 * c.block_size, k) for batch in batches[1:]]
        plans += [(batch, batch, 4 * c.block_size, 1) for batch in batches[1:] if k > 1]
        for batch, num_drafting, context, each in plans:
            drafts = [each if i < num_drafting else 0 for i in range(batch)]
            if batch + sum(drafts) > c.max_num_batched_tokens:
                continue
            ids = [f"__profile_{i}" for i in range(batch)]
            if not all(self.kv.allocate_slots(i, context + 1 + d) for i, d in zip(ids, drafts)):
                for i in ids:
                    if self.kv.holds(i):
                        self.kv.free(i)
                continue
            step = SchedulerOutput([ScheduledRequest(i, [0], context, list(self.kv.block_table(i)),
                                                     greedy, num_lookahead=d, draft_token_ids=[0] * d)
                                    for i, d in zip(ids, drafts)], [])
            for _ in range(2):  # the first run warms up
                start = time.perf_counter()
                self.runner.execute(step).argmax(-1).tolist()
                elapsed = time.perf_counter() - start
            padded = self.runner.padded_tokens(step)
            self.controller.observe_step(batch + sum(drafts), num_drafting if k else 0, elapsed,
                                         0, 0, 0.0, padded, batch, batch * (context + 1) + sum(drafts))
            for i in ids:
                self.kv.free(i)

    def _fail(self, scheduled: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        message = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
        failed = []
        for planned in scheduled.scheduled:
            req = self.scheduler.finish_request(planned.req_id, FinishReason.ERROR)
            if req is not None:
                failed.append(self._finish_output(req, error=message))
        return failed

    def _draft_lengths(self) -> dict[str, int] | None:
        """k_i for the running requests: the engine's k, lowered by the request's own cap;
        with adaptive speculation the controller chooses below that for every decoding
        request that did not set its own k (the API's override wins) or a seed: a seeded
        request's sampled tokens depend on where drafts were verified, and the controller's
        choice on measured step times, so it keeps the fixed k to stay reproducible. Only
        decoding requests draft: the scheduler gives a request in prefill none."""
        if self.drafter is None:
            return None
        k = self.config.num_speculative_tokens
        if self.controller is None:
            return {r.req_id: k if (own := r.params.num_speculative_tokens) is None else min(k, own)
                    for r in self.scheduler.running}
        sched = self.scheduler
        other_tokens, other_spans = self._sorted.refresh(sched)
        num_running = len(sched.running)
        room = max(self.config.max_num_batched_tokens - num_running, 0)
        seats = self.config.max_num_seqs - num_running
        admitted = 0
        for r in sched.waiting:  # only those that can be admitted: the queue may be long
            if other_tokens >= room or admitted >= seats:
                break
            other_tokens += r.num_tokens - r.num_computed_tokens
            admitted += 1
        other_tokens = min(other_tokens, room)
        other_spans += admitted
        padded = self.runner.pads_short_spans(with_prefill=other_tokens > 0)
        running = sched.running
        chosen = self.controller.choose(self._sorted.free, other_tokens, other_spans, padded,
                                        lambda: sum([len(r.all_token_ids) for r in running]),
                                        self._sorted.greedy)
        if self._sorted.pinned:
            chosen.update(self._sorted.pinned)
        return chosen

    def _propose(self, scheduled: SchedulerOutput, drafting: bool) -> DraftProposal | None:
        """Fill each planned request's draft tokens (placeholders when the proposals are
        still on the device); None without a drafter, or when no request drafts and the
        drafter need not see the step."""
        if self.drafter is None:
            return None
        if not drafting and not self.drafter.needs_every_step:
            return None  # nobody drafts: the step is speculation off's
        proposal = self.drafter.propose(scheduled.scheduled, self.scheduler.requests)
        for planned, draft in zip(scheduled.scheduled, proposal.draft_token_ids):
            planned.draft_token_ids = draft
        return proposal

    def _finish_output(self, req: Request, error: str | None = None) -> RequestOutput:
        self.sampler.free(req.req_id)
        if self.drafter:
            self.drafter.free(req.req_id)
        if self.controller:
            self.controller.free(req.req_id)
        return self.outputs.make_output(req, error=error)



    def shutdown(self) -> None:
        """Release the other ranks of a tensor-parallel engine (they return from
        ``run_worker``) and free CUDA graphs; the engine cannot step afterwards."""
        if self._release_ranks is not None:
            self._release_ranks()  # runs runner.close() once and lets go of the runner
        else:
            self.runner.close()

    # ------------------------------------------------------------------ introspection
    @property
    def num_free_blocks(self) -> int:
        return self.kv.num_free_blocks


class _SortedRunning:
    """The running requests as adaptive speculation needs them: decoding with k for the
    controller to choose (``free``, each with its cap), decoding with a k of their own
    (``pinned``: the API's per-request k, or a seeded sampling request's fixed k), and
    still in prefill. Kept up to date from step to step: only requests that joined or
    left ``running`` since the last look (the scheduler logs them, ``running_changes``),
    and those still in prefill, are looked at. A decoding request only returns to prefill
    by leaving ``running`` (preemption), so the rest keep their place; a pass over all of
    them cost 40-80 µs of a ~2.4 ms step at 64 requests on an H200 host."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.version = -1
        self.free: dict[str, int] = {}
        self.greedy: set[str] = set()  # of ``free``: greedy requests (they may verify draft paths)
        self.pinned: dict[str, int] = {}
        self.prefilling: dict[str, Request] = {}

    def refresh(self, scheduler: Scheduler) -> tuple[int, int]:
        """Bring the sorting up to date; returns the prefilling requests' tokens still to
        compute and their number."""
        if self.version != scheduler.running_version:
            changes = scheduler.running_changes(self.version)
            if changes is None:  # the first look, or too far behind the log: sort them all
                self.free.clear()
                self.greedy.clear()
                self.pinned.clear()
                self.prefilling = {r.req_id: r for r in scheduler.running}
            else:  # the joins and leaves since the last look, in order: an id is reused
                for req, joined in changes:  # only after its request left
                    if joined:  # sorted below
                        self.prefilling[req.req_id] = req
                    else:
                        self.free.pop(req.req_id, None)
                        self.greedy.discard(req.req_id)
                        self.pinned.pop(req.req_id, None)
                        self.prefilling.pop(req.req_id, None)
            self.version = scheduler.running_version
        tokens = spans = 0
        for req_id, req in list(self.prefilling.items()):
            remaining = len(req.all_token_ids) - req.num_computed_tokens
            if remaining > 1:
                tokens, spans = tokens + remaining, spans + 1
                continue
            del self.prefilling[req_id]
            params = req.params
            if params.num_speculative_tokens is not None:
                self.pinned[req_id] = min(self.k, params.num_speculative_tokens)
            elif params.seed is not None and params.temperature > 0:
                self.pinned[req_id] = self.k
            else:
                self.free[req_id] = self.k
                if params.greedy:
                    self.greedy.add(req_id)
        return tokens, spans


class LLM:
    """Offline batch generation: ``LLM().generate(prompts, SamplingParams(...))``."""

    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **_engine_kwargs(kwargs)))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt as one continuous batch; outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, Sequence) else [
            sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.engine.add_request(prompt, p))
        except ValueError:
            for req_id in ids:  # all or nothing: a bad prompt queues none of the batch
                self.engine.abort(req_id)
            self.engine.step()
            raise
        final: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        final[output.req_id] = output
                        bar.update(1)
        return [final[req_id] for req_id in ids]


def _engine_kwargs(kwargs: dict) -> dict:
    unknown = set(kwargs) - EngineConfig.field_names()
    if unknown:
        raise ValueError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
    return kwargs
