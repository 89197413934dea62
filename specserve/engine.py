"""LLMEngine (add_request / step / abort) and the offline ``LLM`` API on top of it."""
from __future__ import annotations

import gc
import itertools
import logging
import os
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Sequence

import torch
from tqdm.auto import tqdm

from specserve.attention import get_backend
from specserve.config import EngineConfig
from specserve.cpu_threads import available_cpus, waiting
from specserve.distributed import RankWatch, init_tensor_parallel
from specserve.drafts import build_drafter
from specserve.errors import RanksOutOfStepError, SpecserveError
from specserve.heap import freeze_heap
from specserve.kv_cache import KVCacheManager
from specserve.loader import (build_model, eos_token_ids, load_hf_config, load_tokenizer, quantized_gguf,
                              resolve_model)
from specserve.metrics import SpecDecodeStats
from specserve.model_runner import ModelRunner
from specserve.models.rotary import long_rope_start, position_limit
from specserve.outputs import OutputProcessor, RequestOutput
from specserve.prompts import chat_prompt_ids, check_text, tokenize_prompt
from specserve.request import FinishReason, Request
from specserve.sampling_params import SamplingParams
from specserve.scheduler import RequestUpdate, Scheduler, SchedulerOutput, StepResult
from specserve.spec.calibration import ConfidenceCalibration
from specserve.spec.rejection_sampler import PromptRows, RejectionSampler, VerifyRequest
from specserve.transfer import to_device
from specserve.spec.speculator import Drafts, Speculator
from specserve.structured import Grammars

logger = logging.getLogger("specserve")

# What a float8 KV cache's scales are calibrated on: prose, code, numbers and a chat turn,
# so each layer's K and V reach the magnitudes text of these kinds gives them.
KV_CALIBRATION_TEXT = (
    "The quarterly report, published on 14 March 2024, shows revenue of $12.7 million, up 8.3% "
    "from the year before. Q: What is the capital of Australia? A: Canberra, not Sydney.\n"
    "def merge(a: list[int], b: list[int]) -> list[int]:\n"
    "    out, i, j = [], 0, 0\n"
    "    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n"
    "        else:\n            out.append(b[j]); j += 1\n"
    "    return out + a[i:] + b[j:]\n"
    "User: Could you explain, step by step, why the sky looks blue at noon but red at sunset?\n"
    "Assistant: Sunlight scatters off air molecules; shorter wavelengths scatter far more "
    "(Rayleigh scattering, proportional to 1/λ⁴), so blue light reaches us from every direction. "
    "At sunset the light crosses much more air, the blue is scattered away, and reds remain. "
    "SELECT name, COUNT(*) FROM orders WHERE total > 100 GROUP BY name ORDER BY 2 DESC; "
    "{\"id\": 42, \"tags\": [\"alpha\", \"beta\"], \"ok\": true} 3.14159 2.71828 1e-9 -273.15"
)

# Seconds between learning that another tensor-parallel rank's process ended and this
# process ending: time for the server to send every open stream its error.
RANK_LOST_GRACE_S = 1.0


class LLMEngine:
    """One model on one device, stepping a continuous batch.

    ``step()`` is the whole engine: plan each request's draft length, schedule, propose
    drafts, verify them (and every prefill chunk) in one ragged forward pass with
    rejection sampling, update, and let the speculator observe what the step came to.

    With ``tensor_parallel_size`` N > 1 the engine is rank 0 of N processes started by
    torchrun: it holds its shard of the target model, and its runner has the other ranks
    (``tp_worker.run_worker``) run every forward pass with it. Drafting, sampling and
    scheduling happen here only. ``shutdown()`` releases the other ranks. If another
    rank's process ends first, this one logs which and how, and exits with code 1.
    """

    def __init__(self, config: EngineConfig | None = None, **kwargs) -> None:
        config = config or EngineConfig(**_engine_kwargs(kwargs))
        self.config = config
        self.tp = init_tensor_parallel(config.tensor_parallel_size, config.device)
        if not self.tp.is_driver:
            raise SpecserveError(f"rank {self.tp.rank}: the engine runs on rank 0; the other "
                                 "ranks run specserve.tp_worker.run_worker(config)")
        self.device = self.tp.device if self.tp.size > 1 else config.torch_device
        self.cpu_threads = set_cpu_threads(config.cpu_threads) if self.device.type == "cpu" else None
        self.dtype = config.torch_dtype
        with self.tp.rank_zero_first():  # a GGUF is converted into the cache once
            files = resolve_model(config.model)
        self.model_name = files.name
        self.hf_config = load_hf_config(files)
        self.tokenizer = load_tokenizer(files, config.tokenizer)
        self.eos_token_ids = eos_token_ids(files, self.hf_config, self.tokenizer)
        backend = get_backend(config.attention_backend, self.device, config.deterministic)
        if config.kv_torch_dtype(self.dtype) != self.dtype and getattr(backend, "cpu_kernels", False):
            raise SpecserveError(f"kv_cache_dtype {config.kv_cache_dtype} runs on CUDA: the C++ CPU kernels "
                                 "keep the KV cache in the model's dtype")
        self.quantized_weights = quantized_gguf(files, config.target_gguf_weights, self.device, self.tp.size)
        model = build_model(files, self.hf_config, self.dtype, self.device, backend, tp=self.tp,
                            quantized=self.quantized_weights)
        drafter = build_drafter(config, model, self.hf_config, self.tokenizer, self.device, self.dtype)
        self.max_model_len = self._max_model_len(drafter)
        extra = drafter.kv_bytes_per_block() if drafter else 0
        useful = config.max_num_seqs * -(-(self.max_model_len + config.max_draft_tokens)
                                         // config.block_size)
        self.runner = ModelRunner(model, config, self.device, self.dtype, extra_bytes_per_block=extra,
                                  max_useful_blocks=useful, tp=self.tp, kv_dtype=config.kv_torch_dtype(self.dtype))
        # Told why before this process ends because another rank's process did (the
        # server fails every request with it); see _rank_lost.
        self.rank_lost_listeners: list[Callable[[str], None]] = []
        self._release_ranks = self._rank_watch = None
        if self.tp.size > 1:
            self._rank_watch = watch = RankWatch(self.tp, self._rank_lost)
            # The other ranks wait for rank 0's word: release them even if shutdown() is
            # never called (at garbage collection or exit).
            self._release_ranks = weakref.finalize(self, _release_ranks, watch, self.runner)
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size,
                                 enable_prefix_caching=config.enable_prefix_caching,
                                 draft_cache=drafter.draft_cache if drafter else None)
        self._fit_max_model_len_to_cache()
        if self.runner.kv_dtype != self.dtype:
            self._calibrate_kv_scales()
        self.speculator = Speculator(config, drafter, self.runner, self.kv)
        if self.device.type == "cuda" and backend.name == "triton" and not config.enforce_eager:
            self.enable_graphs()
        self.speculator.profile_step_cost()  # over the passes as they will run: graphs included
        long_from = long_rope_start(self.hf_config)
        self.scheduler = Scheduler(self.kv, config.max_num_batched_tokens, config.max_num_seqs,
                                   self.max_model_len, long_from if long_from and long_from < self.max_model_len else None)
        self.sampler = RejectionSampler(self.device, config.seed, config.logprobs_mode)
        self.outputs = OutputProcessor(self.tokenizer)
        self._pending: list[RequestOutput] = []  # finished outside step() (aborts)
        self._grammars: Grammars | None = None
        self._grammars_refused: str | None = None  # why this tokenizer cannot constrain output
        self._grammars_lock = threading.Lock()
        self._ids = itertools.count()
        self._log_startup(backend.name)
        freeze_heap()

    def _rank_lost(self, why: str) -> None:
        """Another rank's process has ended: no collective can complete again (NCCL would
        wait out the group's timeout), so this process ends too, with exit code 1, after
        telling ``rank_lost_listeners`` and giving them RANK_LOST_GRACE_S to pass it on."""
        logger.error("%s: the tensor-parallel engine cannot go on; this process exits", why)
        for listener in self.rank_lost_listeners:
            try:
                listener(why)
            except Exception:
                logger.exception("a listener to the lost rank failed")
        time.sleep(RANK_LOST_GRACE_S)
        logging.shutdown()
        os._exit(1)

    def _calibrate_kv_scales(self) -> None:
        """A float8 KV cache's per-layer scales, from one prefill of a built-in text over
        scratch blocks (freed, never cached), before the CUDA graphs capture them."""
        ids = self.tokenizer.encode(KV_CALIBRATION_TEXT)
        ids = ids[:min(self.config.max_num_batched_tokens, self.max_model_len - 1)]
        if not self.kv.allocate_slots("__kv_scales", len(ids)):
            raise SpecserveError(f"the KV cache cannot hold the {len(ids)} tokens that calibrate "
                                 "its float8 scales; give it more blocks")
        try:
            scales = self.runner.calibrate_kv_scales(ids, self.kv.block_table("__kv_scales"))
        finally:
            self.kv.free("__kv_scales")
        flat = [s for pair in scales for s in pair]
        logger.info("float8 KV cache: per-layer scales %.3g to %.3g, from %d tokens", min(flat), max(flat), len(ids))

    def enable_graphs(self, capture: bool = True) -> None:
        """CUDA graphs for the target's decode/verify steps and the drafter's steps
        (``capture=False``: the same padded path run eagerly, which the CPU tests use)."""
        self.runner.enable_graphs(1 + self.speculator.max_k, self.max_model_len, capture)
        self.speculator.enable_graphs(self.max_model_len, capture)

    def _max_model_len(self, drafter) -> int:
        limit, why = position_limit(self.hf_config)
        limit = limit or 2**31
        draft_limit = getattr(drafter, "max_positions", None)
        if draft_limit and draft_limit < limit:
            limit, why = draft_limit, "the draft's limit"  # the draft must be able to run every position too
        wanted = self.config.max_model_len or limit
        if wanted > limit:
            raise SpecserveError(f"max_model_len {wanted} exceeds the maximum {limit} "
                                 f"the model{' and draft' if draft_limit else ''} support ({why})")
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
            "  model       %s (%s, %.0fM parameters%s%s)\n"
            "  device      %s, dtype %s, attention backend %s%s\n"
            "  KV cache    %d blocks x %d tokens = %d tokens (%.2f GiB%s)\n"
            "  scheduling  max_num_batched_tokens=%d max_num_seqs=%d max_model_len=%d\n"
            "  speculation %s",
            self.model_name, self.hf_config.architectures[0], params / 1e6, per_rank,
            ", GGUF weights kept quantized" if self.quantized_weights else "",
            f"{self.device} (rank 0 of {self.tp.size}, tensor parallel)" if self.tp.size > 1 else self.device,
            str(self.dtype).removeprefix("torch."), backend,
            f", {self.cpu_threads} threads ({available_cpus()} cores available), which {waiting()}"
            if self.cpu_threads else "",
            self.kv.num_blocks, c.block_size, self.kv.num_blocks * c.block_size,
            self.kv.num_blocks * self.runner.bytes_per_block / 2**30,
            per_rank + (", float8 with per-layer scales" if self.runner.kv_dtype != self.dtype else ""),
            c.max_num_batched_tokens, c.max_num_seqs, self.max_model_len, self.speculator.describe())

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    req_id: str | None = None, prompt_from: str | None = None) -> str:
        """Queue a request; returns its id. Raises ValueError on bad input, queuing nothing.
        ``prompt_from``: a request with the same prompt (another choice of the same prompt);
        while it is queued or running, this one waits for it to compute the prompt and
        shares its blocks (one that has ended left them in the prefix cache)."""
        if self.runner.closed:
            raise SpecserveError("this engine was shut down")
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
        if prompt_from is not None:
            first = self.scheduler.requests.get(prompt_from)
            if first is not None and first.prompt_token_ids != token_ids:
                raise ValueError(f"prompt_from {prompt_from!r} must name a request with the same prompt")
            if first is None:  # it has ended already: its prompt's blocks are in the prefix cache
                prompt_from = None
        req = Request(req_id, token_ids, params, self.eos_token_ids, prompt=text, prompt_from=prompt_from)
        req.bad_words_token_ids = self._bad_words(params)
        if params.structured_outputs is not None:  # compiled before, off the step (see .grammars)
            req.grammar = self.grammars.constraint(params.structured_outputs)
        self.scheduler.add_request(req)
        self.outputs.add_request(req)
        return req_id

    def _bad_words(self, params: SamplingParams) -> list[list[int]]:
        """Each bad word as token ids, as it would start the text and after a space (vLLM's
        rule: the spaced form only where it is a different token run of the same length).
        ValueError for a logit_bias token outside the vocabulary."""
        vocab = self.hf_config.vocab_size
        bad = [t for t in (params.logit_bias or {}) if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias names token {bad[0]}, outside the vocabulary of {vocab}")
        words: list[list[int]] = []
        for word in params.bad_words:
            check_text(word, "a bad word")
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if not plain or any(t >= vocab for t in plain + spaced):
                raise ValueError(f"bad word {word!r} does not tokenise within the model's vocabulary of {vocab}")
            words.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                words.append(spaced)
        return words

    @property
    def grammars(self) -> Grammars:
        """Structured output's compiled grammars for this model's tokenizer, cached. The
        server compiles a request's grammar here from its prompt worker before it queues
        the request, so that ``add_request`` on the engine thread finds it compiled."""
        with self._grammars_lock:
            if self._grammars is None:
                if self._grammars_refused is not None:  # checked once: the tokenizer does not change
                    raise ValueError(self._grammars_refused)
                try:
                    self._grammars = Grammars(self.tokenizer, self.hf_config.vocab_size, self.eos_token_ids)
                except ValueError as exc:
                    self._grammars_refused = str(exc)
                    raise
            return self._grammars

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
        self.speculator.free(req_id)
        self._pending.append(self._finish_output(req))
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._pending)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Plan -> schedule -> propose -> verify -> update -> observe. Returns an output
        for every request that produced tokens or finished in this step; the speculator
        observes the whole step, outputs included, and its controller learns from it while
        the next step's verify pass runs (``Speculator.learn``)."""
        started = time.perf_counter()
        outputs, self._pending = self._pending, []
        draft_lengths = self.speculator.plan(self.scheduler)
        scheduled = self.scheduler.schedule(draft_lengths)
        if scheduled.is_empty:
            self.speculator.learn()
            return outputs
        try:
            drafts = self.speculator.propose(scheduled, self.scheduler)
            self._constrain(drafts)
            result = self._verify(drafts)
        except RanksOutOfStepError as exc:  # the ranks cannot go on together: end the engine
            why = self._rank_watch.wait(RANK_LOST_GRACE_S / 2) if self._rank_watch else None
            if why is not None:  # say which rank, not just which collective failed
                raise RanksOutOfStepError(why) from exc
            raise
        except Exception as exc:  # never a wedged engine: the step's requests end with an error
            logger.exception("engine step failed; ending its %d requests", len(scheduled.scheduled))
            self.speculator.learn()  # the steps before it taught what they taught
            return outputs + self._fail(scheduled, exc)
        updates = self.scheduler.update(*self.speculator.keep_best_paths(drafts, result))
        left: dict[str, Exception] = {}
        for update in updates:
            self._apply_stop_strings(update)
            if update.req.grammar is not None:
                try:
                    update.req.grammar.accept(update.new_token_ids)
                except RuntimeError as exc:  # a token its mask allowed, refused: end it, not the engine
                    logger.error("request %s left its grammar: %s", update.req.req_id, exc)
                    left[update.req.req_id] = exc
        self.speculator.record(drafts, updates)  # before the outputs: each carries its counts
        outputs += [self._output(update.req) for update in updates if update.req.req_id not in left]
        for req_id, exc in left.items():
            outputs += self._fail_requests([req_id], exc)
        self.speculator.observe(drafts, updates, time.perf_counter() - started)
        if not self.scheduler.has_unfinished_requests():
            self.speculator.learn()  # no next step to learn during
        return outputs

    def _constrain(self, drafts: Drafts) -> None:
        """Structured output: a request whose grammar forces its next tokens drafts those;
        each constrained request's drafts are cut at the first one its grammar refuses;
        and the grammar's masks of its verify rows go to ``drafts.masks`` (``Constraint``).
        Drafts still on the device come to the host first (one copy, only then)."""
        if not self.scheduler.num_constrained:
            return
        requests = self.scheduler.requests
        constrained = [p for p in drafts.scheduled.scheduled if p.sample and requests[p.req_id].grammar]
        if not constrained:
            return
        forced = {id(p): requests[p.req_id].forced_drafts[:p.num_lookahead] for p in constrained
                  if p.num_lookahead and requests[p.req_id].forced_drafts}
        if drafts.device_ids is not None and (forced or any(p.draft_token_ids for p in constrained)):
            drafts.to_host()
        if forced:  # the grammar's own drafts take the drafter's place (speculator.plan)
            drafts.replace(forced)
        cuts = {}
        for p in constrained:
            n, drafts.masks[p.req_id] = requests[p.req_id].grammar.check_drafts(p.draft_token_ids)
            if n < len(p.draft_token_ids):
                cuts[id(p)] = n
        if cuts:
            drafts.cut(cuts)

    def _verify(self, drafts: Drafts) -> StepResult:
        """The one ragged target pass over every request's tokens and drafts (prefill
        chunks included), then rejection sampling: one device-to-host copy."""
        logits = self.runner.execute(drafts.scheduled, device_ids=drafts.device_ids)
        self.speculator.catch_up(drafts)  # a step without drafts feeds the drafter while the pass runs
        # The pass runs on the device (a GPU's) until the sampler reads its result: the
        # controller learns from the last step, and chooses the next one's k, meanwhile.
        self.speculator.learn(self.scheduler)
        logits = self.speculator.settle_trees(drafts, logits)
        settled = (drafts.settled or drafts.scheduled).scheduled
        decided = drafts.decided  # sampling requests' trees, verified in settling
        planned = [p for p in settled if id(p) not in decided] if decided else settled
        requests = self.scheduler.requests
        logits, prompt, owners = self._prompt_rows(planned, logits)
        verify = [VerifyRequest(p.req_id, p.params, p.draft_token_ids, first_position=end,
                                history=requests[p.req_id].history(end, drafts.masks.get(p.req_id)))
                  for p in planned if p.sample for end in (p.start_pos + len(p.token_ids),)]
        # Drafts still on the device come back in the sampler's copy, filling draft_token_ids.
        sampled = self.sampler.sample(logits, verify, drafts.probs, drafts.draft_ids, prompt)
        self._add_prompt_logprobs(owners, sampled.prompt_logprobs)
        if not decided:
            return StepResult(sampled.new_token_ids, sampled.logprobs)
        tokens, logprobs = iter(sampled.new_token_ids), iter(sampled.logprobs or ())
        merged = [(decided[id(p)], None) if id(p) in decided else (next(tokens), next(logprobs, None))
                  for p in settled if p.sample]
        return StepResult([t for t, _ in merged],
                          None if sampled.logprobs is None else [lp for _, lp in merged])

    def _prompt_rows(self, planned, logits):
        """Split off the rows of prompt positions (a chunk with ``prompt_logits``, whose
        rows come before its sampling rows) from the sampling rows. Returns the sampling
        rows, the prompt rows (None: none this step) and each row's (request, position)."""
        if not any(p.prompt_logits for p in planned):
            return logits, None, []
        sample_rows, prompt_rows, owners, next_ids, tops = [], [], [], [], []
        row = 0
        for p in planned:
            if p.prompt_logits:
                req = self.scheduler.requests[p.req_id]
                n = len(p.token_ids) - p.sample
                prompt_rows += range(row, row + n)
                owners += [(req, p.start_pos + i) for i in range(n)]
                next_ids += req.all_token_ids[p.start_pos + 1:p.start_pos + n + 1]
                tops += [req.params.prompt_logprobs] * n
                row += n
            if p.sample:
                sample_rows += range(row, row + 1 + len(p.draft_token_ids))
                row += 1 + len(p.draft_token_ids)
        sample_t, prompt_t = to_device([sample_rows, prompt_rows], torch.int64, logits.device)
        return logits.index_select(0, sample_t), PromptRows(logits.index_select(0, prompt_t), next_ids, tops), owners

    @staticmethod
    def _add_prompt_logprobs(owners, logprobs) -> None:
        """Each prompt row's log-probability to its request, in order: a row at position i
        scores prompt token i + 1 (a recomputation after preemption adds nothing twice)."""
        for (req, position), logprob in zip(owners, logprobs):
            if req.prompt_logprobs is not None and position == len(req.prompt_logprobs):
                req.prompt_logprobs.append(logprob)

    def _apply_stop_strings(self, update: RequestUpdate) -> None:
        """Detokenise the update's tokens; a stop string ends the request, and the tokens
        after it never happened: they leave the request and the update."""
        req = update.req
        kept = self.outputs.process(req, update.new_token_ids)
        if kept is None:
            return
        req.drop_last(len(update.new_token_ids) - kept)
        del update.new_token_ids[kept:]
        if req.is_finished:
            req.finish_reason = FinishReason.STOP
        else:
            self.scheduler.finish_request(req.req_id, FinishReason.STOP)

    def _output(self, req: Request) -> RequestOutput:
        return self._finish_output(req) if req.is_finished else self.outputs.make_output(req)

    def _fail(self, scheduled: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        return self._fail_requests([planned.req_id for planned in scheduled.scheduled], exc)

    def _fail_requests(self, req_ids: list[str], exc: Exception) -> list[RequestOutput]:
        """End these requests with an error (those not already ended); their outputs."""
        message = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
        failed = []
        for req_id in req_ids:
            req = self.scheduler.finish_request(req_id, FinishReason.ERROR)
            if req is not None:
                self.speculator.free(req.req_id)
                failed.append(self._finish_output(req, error=message))
        return failed

    def _finish_output(self, req: Request, error: str | None = None) -> RequestOutput:
        self.sampler.free(req.req_id)
        return self.outputs.make_output(req, error=error)

    def shutdown(self) -> None:
        """Release the other ranks of a tensor-parallel engine (they return from
        ``run_worker``), free the CUDA graphs, and let go of the KV caches and the models
        (the target's and the drafter's), so their memory is freed; the engine cannot step
        afterwards. Idempotent."""
        if self._release_ranks is not None:
            self._release_ranks()  # runs _release_ranks once and lets go of the runner
        else:
            self.runner.close()
        if self.speculator.drafter is not None:
            self.speculator.drafter.close()
        if self.device.type == "cuda":
            gc.collect()  # cycles the closed objects were part of (a module and its hooks)
            torch.cuda.empty_cache()  # what torch's allocator kept back goes to the driver

    close = shutdown

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ introspection
    @property
    def num_free_blocks(self) -> int:
        return self.kv.num_free_blocks

    @property
    def spec_stats(self) -> SpecDecodeStats:
        """Speculation's counts over the engine's lifetime (the drafter's)."""
        return self.speculator.stats

    @property
    def forced_draft_stats(self) -> SpecDecodeStats:
        """Structured output's grammar-forced drafts, counted as a drafter of their own."""
        return self.speculator.forced_stats

    @property
    def draft_length_counts(self) -> Counter[int]:
        """How many request-steps verified each draft length k."""
        return self.speculator.draft_length_counts

    @property
    def tree_size_counts(self) -> Counter[int]:
        """How many request-steps verified each number of further draft tree nodes."""
        return self.speculator.tree_size_counts

    @property
    def draft_calibration(self) -> ConfidenceCalibration | None:
        """The adaptive controller's map from draft confidence to acceptance (None without
        one: speculation off, a fixed k, a drafter without confidence, draft paths)."""
        controller = self.speculator.controller
        return controller.calibration if controller is not None else None


class LLM:
    """Offline batch generation: ``LLM().generate(prompts, SamplingParams(...))``."""

    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **_engine_kwargs(kwargs)))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        """Free the engine's memory (KV cache, models, CUDA graphs); see ``LLMEngine.shutdown``."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt as one continuous batch; outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if isinstance(sampling_params, (list, tuple)):
            params = list(sampling_params)
        elif sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            raise ValueError(f"sampling_params must be SamplingParams or a list of them, "
                             f"got {type(sampling_params).__name__}")
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.engine.add_request(prompt, p))
        except ValueError:
            if ids:  # all or nothing: a bad prompt queues none of the batch
                for req_id in ids:
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


def _release_ranks(watch: RankWatch, runner: ModelRunner) -> None:
    """Tell the other ranks to stop; their clean exit then ends the watch over them. With
    a rank already gone (torchrun stops the job when one dies) there is nobody to tell:
    the message would fail, or wait for the group's timeout."""
    watch.releasing()
    why = watch.check()
    if why is not None:
        logger.error("%s: the other ranks are not told to stop", why)
    runner.close(tell_ranks=why is None)
    watch.stop()


def set_cpu_threads(wanted: int | None) -> int:
    """Set torch's intra-op threads: ``wanted``, else ``OMP_NUM_THREADS`` when set, else
    the cores this process may use (``cpu_threads.available_cpus``). Returns the count."""
    if wanted is None and not os.environ.get("OMP_NUM_THREADS"):
        wanted = available_cpus()
    if wanted is not None and wanted != torch.get_num_threads():
        torch.set_num_threads(wanted)
    return torch.get_num_threads()


def _engine_kwargs(kwargs: dict) -> dict:
    unknown = set(kwargs) - EngineConfig.field_names()
    if unknown:
        raise ValueError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
    return kwargs
