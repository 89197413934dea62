"""Log-probabilities of sampled tokens, as the API reports them."""
from __future__ import annotations

from dataclasses import dataclass

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token's log-probability under the target, and the likeliest tokens' at its place.

    With speculation every token reports the target's distribution at its position (never
    the draft's), whether it was an accepted draft, a recovered or a bonus token: what a
    plain pass reports for the same token. ``raw_logprobs`` (the default) is the model's
    own distribution; ``processed_logprobs`` the one sampled from (penalties, bias,
    temperature, top-k, top-p and min-p applied; a greedy request at temperature 1).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability), likeliest first
    rank: int | None = None  # 1 + how many tokens are likelier (prompt tokens' only)
