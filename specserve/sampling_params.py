"""Per-request sampling parameters, validated on construction."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    temperature 0 is greedy decoding. top_k <= 0 (or -1) and top_p = 1 and min_p = 0 disable
    those filters. ``max_tokens=None`` generates until a stop condition or the model's
    maximum length. ``seed`` makes a sampled request reproducible whatever else is in the
    batch.
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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(self.stop is None or isinstance(self.stop, (list, tuple)),
               f"stop must be a string or a list of strings, got {self.stop!r}")
        _check(self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple)),
               f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # rejects NaN


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
