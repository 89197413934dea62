"""A request's state as the scheduler sees it: tokens known, tokens computed, status."""
from __future__ import annotations

import enum
import time

from specserve.logits_process import RowHistory
from specserve.logprobs import TokenLogprob
from specserve.metrics import SpecDecodeStats
from specserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"        # EOS, a stop token id or a stop string
    LENGTH = "length"    # max_tokens or the model's maximum length
    ABORT = "abort"      # cancelled by the caller
    ERROR = "error"      # the engine failed while running it


class Request:
    """One generation request.

    The token model (DESIGN.md): a request has ``all_token_ids`` (prompt + generated) and
    ``num_computed_tokens`` whose KV is cached. Each step it is scheduled for some of the
    tokens it still needs — a prefill chunk, one decode token, or 1 + k verify tokens;
    there are no phases.
    """

    def __init__(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: frozenset[int], prompt: str | None = None,
                 prompt_from: str | None = None) -> None:
        self.req_id = req_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.stop_token_ids = frozenset(params.stop_token_ids) | self.eos_token_ids
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at admission
        # Another request with the same prompt (a sibling choice of n > 1): this one waits
        # until that one has computed the prompt, then takes it from the prefix cache.
        self.prompt_from = prompt_from
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_preemptions = 0
        # LongRoPE: its cache is rotated with the long factors (set at admission, Scheduler).
        self.long_rope = False
        self.arrival_time = time.monotonic()
        self.spec_stats = SpecDecodeStats()
        self.bad_words_token_ids: list[list[int]] = []  # params.bad_words tokenised (by the engine)
        self.grammar = None  # structured output: its structured.Constraint (set by the engine)
        self.forced_drafts: list[int] = []  # this step's tokens its grammar forces (the speculator's plan)
        # Per output token when params.logprobs is set; per prompt token after the first
        # with params.prompt_logprobs (filled as its prefill chunks run).
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprob] | None = [] if params.prompt_logprobs is not None else None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    def drop_last(self, num_tokens: int) -> None:
        """Forget the newest output tokens (those past a stop string)."""
        if num_tokens > 0:
            del self.all_token_ids[len(self.all_token_ids) - num_tokens:]
            if self.logprobs is not None:
                del self.logprobs[self.num_output_tokens:]

    @property
    def needs_prompt_logits(self) -> bool:
        """Whether prompt log-probabilities are wanted and not all computed yet."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    def history(self, end: int, grammar_masks=None) -> RowHistory | None:
        """What logits processing reads for a row deciding token ``end`` (None: the request
        asks for none); ``grammar_masks``: the grammar's bitmask of each row of a verify span."""
        if not self.params.processes_logits:
            return None
        return RowHistory(self.params, self.all_token_ids, self.num_prompt_tokens, end,
                          self.stop_token_ids, self.bad_words_token_ids, grammar_masks)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Request({self.req_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, {self.status.value})")
