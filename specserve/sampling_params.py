"""Per-request sampling parameters, validated on construction."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from specserve.structured import StructuredOutputs

MAX_LOGPROBS = 20  # top log-probabilities per token (OpenAI's top_logprobs allows 20)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    temperature 0 is greedy decoding. top_k <= 0 (or -1) and top_p = 1 and min_p = 0 disable
    those filters. ``max_tokens=None`` generates until a stop condition or the model's
    maximum length. ``seed`` keys a sampled request's random numbers, so they do not depend on the
    batch: in float32 its tokens are the same whatever else is in the batch; in bfloat16
    the batch changes the logits' rounding, so it repeats exactly only beside the same
    requests.

    Logits processing, applied alike to the target's rows and the draft's (see
    ``logits_process``), with vLLM's meanings: ``presence_penalty`` and
    ``frequency_penalty`` (in [-2, 2]) lower a token by a constant once it appears in the
    output / by how often it does; ``repetition_penalty`` (> 0, 1 = off) divides a
    positive logit or multiplies a negative one of a token seen in the prompt or the
    output; ``logit_bias`` adds a bias in [-100, 100] to token ids; ``min_tokens`` keeps
    the stop tokens out (and stop strings unchecked) until that many tokens are out;
    ``bad_words`` never completes one of these words (each tokenised as it would start
    the text and after a space).

    Frozen: a field cannot be reassigned after validation (make a new one, or
    ``dataclasses.replace``, which validates again).

    ``logprobs``: report each output token's log-probability and the ``logprobs`` likeliest
    tokens' (0: the chosen token's alone); ``prompt_logprobs`` the same for each prompt
    token after the first. At most ``MAX_LOGPROBS``.

    ``structured_outputs``: constrain the output to a JSON schema, any JSON object, a regex,
    a choice of strings or an EBNF grammar (``StructuredOutputs``, or a dict of its fields).
    The grammar ends the output with an end-of-sequence token, so it cannot be combined
    with ``ignore_eos`` or ``min_tokens``.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    num_speculative_tokens: int | None = None  # per-request cap on k; None: engine default, 0: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    bad_words: list[str] = field(default_factory=list)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", [self.stop])
        _check(self.stop is None or isinstance(self.stop, (list, tuple)),
               f"stop must be a string or a list of strings, got {self.stop!r}")
        _check(self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple)),
               f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop", list(self.stop or []))
        if isinstance(self.bad_words, str):
            object.__setattr__(self, "bad_words", [self.bad_words])
        _check(isinstance(self.bad_words, (list, tuple)) and all(isinstance(w, str) and w.strip() for w in self.bad_words),
               f"bad_words must be a list of non-blank strings, got {self.bad_words!r}")
        object.__setattr__(self, "bad_words", list(self.bad_words))
        _check(self.logit_bias is None or isinstance(self.logit_bias, dict),
               f"logit_bias must map token ids to biases, got {self.logit_bias!r}")
        object.__setattr__(self, "logit_bias", dict(self.logit_bias) if self.logit_bias else None)
        object.__setattr__(self, "stop_token_ids", list(self.stop_token_ids or []))
        if isinstance(self.structured_outputs, dict):
            try:
                object.__setattr__(self, "structured_outputs", StructuredOutputs(**self.structured_outputs))
            except TypeError as exc:
                raise ValueError(f"structured_outputs: {exc}") from None
        self._validate()

    def _validate(self) -> None:
        _check(_is_number(self.temperature) and self.temperature >= 0,
               f"temperature must be a number >= 0, got {self.temperature!r}")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1,
               f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and (1 <= self.top_k < 2**31 or self.top_k in (0, -1)),
               f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k!r}")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1,
               f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**63),
               f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        _check(isinstance(self.ignore_eos, bool), f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        _check(isinstance(self.skip_special_tokens, bool),
               f"skip_special_tokens must be true or false, got {self.skip_special_tokens!r}")
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
               f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check(all(isinstance(s, str) and s for s in self.stop),
               f"stop must be a list of non-empty strings, got {self.stop!r}")
        _check(self.num_speculative_tokens is None or (
            _is_int(self.num_speculative_tokens) and 0 <= self.num_speculative_tokens <= 32),
            f"num_speculative_tokens must be in [0, 32], got {self.num_speculative_tokens!r}")
        _check(self.max_tokens is None or self.max_tokens < 2**31,
               f"max_tokens is too large: {self.max_tokens!r}")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")

        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, f"{name} must be in [-2, 2], got {value!r}")
        _check(_is_number(self.repetition_penalty) and 0 < self.repetition_penalty <= 10,
               f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}")
        for token_id, bias in (self.logit_bias or {}).items():
            _check(_is_int(token_id) and token_id >= 0, f"logit_bias keys must be token ids >= 0, got {token_id!r}")
            _check(_is_number(bias) and -100 <= bias <= 100,
                   f"logit_bias values must be in [-100, 100], got {bias!r} for token {token_id}")
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0,
               f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
               f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS),
                   f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        if self.structured_outputs is not None:
            _check(isinstance(self.structured_outputs, StructuredOutputs),
                   f"structured_outputs must be StructuredOutputs or a dict, got {self.structured_outputs!r}")
            _check(not self.ignore_eos, "ignore_eos cannot be combined with structured output: the grammar "
                                        "ends the output with an end-of-sequence token")
            _check(not self.min_tokens, "min_tokens cannot be combined with structured output: the grammar "
                                        "decides where the output ends")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Whether any logits processing (penalties, bias, min_tokens, bad words, a grammar) is on."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.bad_words or self.structured_outputs)


def _is_number(x: object) -> bool:
    """A finite int or float (not a bool, NaN or an infinity)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
