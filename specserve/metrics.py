"""Speculative-decoding statistics, kept per request and for the whole engine."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class SpecDecodeStats:
    """Counts over verify steps that carried at least one draft token. Accepted tokens
    are those the request kept: a stop inside an accepted run cuts them.

    ``accepted_per_position[j]`` counts drafts whose (j+1)-th token was accepted;
    mean acceptance length = tokens emitted per draft = 1 + accepted / drafts.
    ``num_path_wins``: drafts whose kept tokens came from a further draft path (a request
    verifying several paths keeps the longest accepted one; its drafts count once).
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafts_per_position: list[int] = field(default_factory=list)
    num_path_wins: int = 0

    def record(self, num_draft_tokens: int, num_accepted: int, path_won: bool = False) -> None:
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_path_wins += path_won
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for counts, upto in ((self.drafts_per_position, num_draft_tokens),
                             (self.accepted_per_position, num_accepted)):
            if len(counts) < num_draft_tokens:
                counts.extend([0] * (num_draft_tokens - len(counts)))
            for j in range(upto):
                counts[j] += 1

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def acceptance_rate_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafts_per_position)]

    def copy(self) -> "SpecDecodeStats":
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.accepted_per_position), list(self.drafts_per_position),
                               self.num_path_wins)

    @classmethod
    def total(cls, stats: "list[SpecDecodeStats]") -> "SpecDecodeStats":
        """The counts of several requests together."""
        out = cls()
        for s in stats:
            out.num_drafts += s.num_drafts
            out.num_draft_tokens += s.num_draft_tokens
            out.num_accepted_tokens += s.num_accepted_tokens
            out.num_path_wins += s.num_path_wins
            for mine, theirs in ((out.accepted_per_position, s.accepted_per_position),
                                 (out.drafts_per_position, s.drafts_per_position)):
                mine.extend([0] * (len(theirs) - len(mine)))
                for j, n in enumerate(theirs):
                    mine[j] += n
        return out

    def as_dict(self) -> dict:
        return {**asdict(self), "mean_acceptance_length": round(self.mean_acceptance_length, 4),
                "acceptance_rate": round(self.acceptance_rate, 4)}
