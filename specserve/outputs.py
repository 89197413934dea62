"""From sampled token ids to what callers see: incremental detokenisation, stop strings,
RequestOutput deltas."""
from __future__ import annotations

from dataclasses import dataclass, field

from specserve.logprobs import TokenLogprob
from specserve.metrics import SpecDecodeStats
from specserve.request import FinishReason, Request


@dataclass
class RequestOutput:
    """A request's state after a step. ``text`` / ``token_ids`` are cumulative; the
    ``delta_*`` fields hold what is new since the previous output of this request."""

    req_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    spec_stats: SpecDecodeStats | None = None  # this request's drafts and acceptance so far
    # With SamplingParams.logprobs: one per output token (cumulative; ``delta_logprobs``: the
    # new ones); with prompt_logprobs: one per prompt token after the first.
    logprobs: list[TokenLogprob] | None = None
    delta_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the output tokens' log-probabilities (None without logprobs)."""
        return None if self.logprobs is None else sum(lp.logprob for lp in self.logprobs)


class IncrementalDetokenizer:
    """Decodes a growing token list without re-decoding it all each step.

    Text is committed only once the newest tokens decode to more text that ends in a
    whole character (no trailing U+FFFD from a split multi-byte sequence); a few tokens of
    left context keep SentencePiece-style leading spaces right. Waiting is bounded, as a
    held tail is decoded again every step: past ``MAX_PENDING`` pending tokens only the
    last few can still be a split character, so what precedes them is committed (a
    U+FFFD there is invalid bytes, emitted as it is); past
    ``MAX_HELD`` tokens that add no text (skipped special tokens) are let go too.
    """

    MAX_PENDING = 4   # tokens: a UTF-8 character is at most 4 bytes, so at most 4 tokens
    MAX_HELD = 64

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decode = _decoder(tokenizer, skip_special_tokens)
        context = prompt_token_ids[-6:]
        self.token_ids = list(context)
        self.prefix_offset = 0
        self.read_offset = len(context)

    def append(self, token_ids: list[int]) -> str:
        self.token_ids.extend(token_ids)
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset:])
        pending = len(self.token_ids) - self.read_offset
        if not full.endswith("\ufffd"):
            if len(full) > len(prefix) or pending > self.MAX_HELD:
                return self._commit(len(self.token_ids), full, prefix)
            return ""
        if pending <= self.MAX_PENDING:
            return ""  # perhaps a character whose last bytes are still to come
        # A step may append whole characters and then the first bytes of one more, which
        # then sit in the last MAX_PENDING - 1 tokens: commit up to the last cut that ends
        # in a whole character; if none does, those tokens' U+FFFD are invalid bytes.
        for end in range(len(self.token_ids) - 1, len(self.token_ids) - self.MAX_PENDING, -1):
            text = self._decode(self.token_ids[self.prefix_offset:end])
            if len(text) > len(prefix) and not text.endswith("\ufffd"):
                break
        return self._commit(end, text, prefix)

    def _commit(self, end: int, text: str, prefix: str) -> str:
        """Emit the text of the tokens up to ``end`` (``text``, decoded with ``prefix``)."""
        self.prefix_offset, self.read_offset = self.read_offset, end
        return text[len(prefix):]

    def flush(self) -> str:
        """Whatever is still held back (e.g. an incomplete character at the very end)."""
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return full[len(prefix):]


def _decoder(tokenizer, skip_special_tokens: bool):
    """``tokenizer.decode`` — through the Rust backend directly where that is exactly what
    it runs (a fast tokenizer, no subclass override, no clean-up: switched off, or skipped
    by transformers itself, as some versions do for BPE tokenizers): transformers checks
    every id in Python first, and a detokenising step calls it twice per request, which
    on a GPU host is a large share of a step at tens of requests."""
    try:
        # lazy: transformers takes seconds to import; whoever made the tokenizer has imported it
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:  # another transformers layout: take no chances
        PreTrainedTokenizerFast = PreTrainedTokenizerBase = None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (backend is not None and PreTrainedTokenizerFast is not None
            and getattr(type(tokenizer), "decode", None) is getattr(PreTrainedTokenizerBase, "decode", 0)
            and getattr(type(tokenizer), "_decode", None) is getattr(PreTrainedTokenizerFast, "_decode", 0)
            and (getattr(tokenizer, "clean_up_tokenization_spaces", True) is False
                 or _cleanup_skipped(tokenizer, backend))):
        return lambda token_ids: backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
    return lambda token_ids: tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


# Every pattern transformers' clean_up_tokenization rewrites (" ." -> ".", " 's" -> "'s", ...).
_CLEANUP_PROBE = "a . b , c ! d ? e ' f n't g 'm h 's i 've j 're k"


def _cleanup_skipped(tokenizer, backend) -> bool:
    """Whether ``tokenizer.decode`` leaves its backend's text as it is, clean-up switched
    on notwithstanding: checked on text that clean-up would change, with and without
    special tokens skipped."""
    try:
        ids = tokenizer.encode(_CLEANUP_PROBE, add_special_tokens=True)
        return all(tokenizer.decode(ids, skip_special_tokens=skip) == backend.decode(ids, skip_special_tokens=skip)
                   for skip in (True, False))
    except Exception:  # an odd tokenizer: the slow path is always right
        return False


@dataclass
class _RequestText:
    detokenizer: IncrementalDetokenizer
    stop: list[str]
    text: str = ""
    num_emitted_chars: int = 0
    num_emitted_tokens: int = 0
    stopped_by_string: bool = False
    hold_back: int = field(init=False)

    def __post_init__(self) -> None:
        # Text that may be the start of a stop string is held back until it is not.
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1


class OutputProcessor:
    """Turns per-step token updates into RequestOutputs; finds stop strings."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestText] = {}

    def add_request(self, req: Request) -> None:
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids,
                                       req.params.skip_special_tokens)
        self._states[req.req_id] = _RequestText(detok, req.params.stop)

    def process(self, req: Request, new_token_ids: list[int]) -> int | None:
        """Detokenise ``new_token_ids``. When a stop string completes, returns how many of
        them to keep (up to and including the token that completed it); else None."""
        state = self._states[req.req_id]
        if not state.stop:
            state.text += state.detokenizer.append(new_token_ids)
            return None
        # Token by token, so a stop string inside a run of accepted drafts cuts the run there.
        # Not before min_tokens are out (vLLM's rule): a stop string ends no shorter output.
        before = req.num_output_tokens - len(new_token_ids)
        for count, token_id in enumerate(new_token_ids, start=1):
            start = max(0, len(state.text) - state.hold_back)
            state.text += state.detokenizer.append([token_id])
            if before + count < req.params.min_tokens:
                continue
            found = [i for i in (state.text.find(stop, start) for stop in state.stop) if i != -1]
            if found:
                state.text = state.text[:min(found)]  # the earliest match wins
                state.stopped_by_string = True
                return count
        return None

    def make_output(self, req: Request, error: str | None = None) -> RequestOutput:
        state = self._states[req.req_id]
        finished = req.is_finished
        if finished and not state.stopped_by_string:
            state.text += state.detokenizer.flush()
        visible = len(state.text) if finished else max(state.num_emitted_chars,
                                                       len(state.text) - state.hold_back)
        token_ids = req.output_token_ids
        output = RequestOutput(
            req_id=req.req_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            text=state.text[:visible], token_ids=token_ids,
            delta_text=state.text[state.num_emitted_chars:visible],
            delta_token_ids=token_ids[state.num_emitted_tokens:],
            finished=finished,
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            error=error, num_preemptions=req.num_preemptions, num_cached_tokens=req.num_cached_tokens,
            spec_stats=req.spec_stats.copy(),
            logprobs=None if req.logprobs is None else list(req.logprobs),
            delta_logprobs=None if req.logprobs is None else req.logprobs[state.num_emitted_tokens:],
            # Complete before the first output and never changed after: shared, not copied.
            prompt_logprobs=req.prompt_logprobs)
        state.num_emitted_chars, state.num_emitted_tokens = visible, len(token_ids)
        if finished:
            del self._states[req.req_id]
        return output

    def has(self, req_id: str) -> bool:
        return req_id in self._states


__all__ = ["FinishReason", "IncrementalDetokenizer", "OutputProcessor", "RequestOutput"]
