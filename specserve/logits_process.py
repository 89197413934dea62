"""Logits processing: a grammar's mask (structured output), bad words, min_tokens,
logit_bias and penalties, one mechanism for the target's verify rows and the draft's steps.

Each transform reads a row's *history*: the request's prompt and the output tokens before
the token the row decides. For the target's row j of a verify span that history is the
request's committed output followed by drafts d_1 … d_(j-1) of the span; for the draft's
step j it is the same, the drafts it has proposed so far. So p and q at a verify position
are processed from the very same state and speculative sampling stays exactly lossless
(``rejection_sampler``). Nothing is kept between steps: each step builds its state from the
committed tokens (the drafts' part on the device, where they are), so a rejection needs
no rollback here; within a draft pass ``advance`` adds each step's proposals.

The order is vLLM's: the grammar's mask, bad words, min_tokens and logit_bias, then the
repetition, frequency and presence penalties, all before temperature and the top-k / top-p / min-p filters
(``sampler.target_probs``).
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.sampling_params import SamplingParams
from specserve.structured import Constraint, DraftGuide, apply_masks
from specserve.transfer import to_device

_NO_TOKEN = -1  # a history shorter than a bad word's prefix: matches no token id


@dataclass
class RowHistory:
    """Where one request's processed rows start: its known tokens and how far they count."""

    params: SamplingParams
    token_ids: Sequence[int]               # prompt + output (a reference: not copied)
    num_prompt_tokens: int
    end: int                               # the first row decides token ``end``: history is token_ids[:end]
    stop_token_ids: frozenset[int] = frozenset()  # kept out while fewer than min_tokens are out
    bad_words_token_ids: Sequence[Sequence[int]] = ()
    grammar_masks: torch.Tensor | None = None  # host bitmask row per verify row (structured output)


class LogitsProcess:
    """The transforms of a set of rows, each row a request's history plus some drafts.

    Build with ``for_spans`` (verify: row j of span i has the first j of its drafts) or
    ``for_drafting`` (one row per request, no drafts yet, then ``advance``). ``apply``
    turns the rows' logits ``[num_rows, vocab]`` into processed float32 logits.
    """

    def __init__(self, rows: list[RowHistory], row_drafts: list[int], vocab_size: int,
                 device: torch.device, draft_ids: torch.Tensor | None = None,
                 draft_index: list[list[int]] | None = None) -> None:
        """``rows[r]``: row r's request; ``row_drafts[r]``: how many drafts it has had
        (``draft_index[r]``: their places in ``draft_ids`` ``[num_drafts]`` on the device)."""
        self.rows, self.row_drafts = rows, list(row_drafts)
        self.vocab_size, self.device = vocab_size, device
        params = [r.params for r in rows]
        self.any_penalty = any(p.presence_penalty or p.frequency_penalty for p in params)
        self.any_repetition = any(p.repetition_penalty != 1.0 for p in params)
        self.counts = self.seen = None          # [num_rows, vocab] output counts / prompt-or-output seen
        self._words = _BadWords(rows)
        self.tail = None                        # [num_rows, W] each row's last W history tokens
        draft_index = draft_index or [[] for _ in rows]
        # What does not change as the rows' drafts grow, sent to the device once: the
        # penalty factors per row and every (row, token, bias), in row order.
        self._factors = None
        if self.any_penalty or self.any_repetition:
            self._factors = to_device([[p.repetition_penalty for p in params], [p.frequency_penalty for p in params],
                                       [p.presence_penalty for p in params]], torch.float32, device)
            self._build_counts(draft_ids, draft_index)
        bias = [(r, t, float(b)) for r, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
        self._bias_rows = [r for r, _, _ in bias]
        self._bias = None
        if bias:  # flat places (row * vocab + token) and values; a row's tokens are distinct
            (places_t,) = to_device([[r * vocab_size + t for r, t, _ in bias]], torch.int64, device)
            (values_t,) = to_device([[b for _, _, b in bias]], torch.float32, device)
            self._bias = (places_t, values_t)
        if self._words.width:
            self.tail = self._build_tail(draft_ids, draft_index)
        # Structured output: the grammar's bitmask of each row that has one (row j of a span
        # is its mask j), gathered on the host; it reaches the device with the logits' use.
        # A draft pass's rows take theirs from its DraftGuide (for_drafting), step by step.
        masked = [(r, row.grammar_masks[j]) for r, (row, j) in enumerate(zip(rows, self.row_drafts))
                  if row.grammar_masks is not None and j < len(row.grammar_masks)]
        self._grammar = ([r for r, _ in masked], torch.stack([m for _, m in masked])) if masked else None
        self._guide: DraftGuide | None = None

    @classmethod
    def for_spans(cls, spans: list[RowHistory], num_drafts: list[int], draft_starts: list[int],
                  vocab_size: int, device: torch.device, draft_ids: torch.Tensor | None) -> "LogitsProcess":
        """Verify rows: span i has ``num_drafts[i]`` drafts, at ``draft_starts[i]`` in
        ``draft_ids`` (device), and 1 + that many rows; row j has the first j drafts."""
        rows, row_drafts, index = [], [], []
        for span, k, start in zip(spans, num_drafts, draft_starts):
            for j in range(k + 1):
                rows.append(span)
                row_drafts.append(j)
                index.append(list(range(start, start + j)))
        return cls(rows, row_drafts, vocab_size, device, draft_ids, index)

    @classmethod
    def for_drafting(cls, histories: list[RowHistory | None], params: list[SamplingParams],
                     vocab_size: int, device: torch.device,
                     grammars: list[Constraint | None] | None = None) -> "LogitsProcess | None":
        """A draft pass: one row per drafting request, no drafts yet (``advance`` adds
        them); None when no request asks for processing (``histories`` all None: a request
        with a grammar has one). A row with a grammar (``grammars``: the requests'
        structured-output constraints) is masked by it along the row's own proposals
        (``DraftGuide``)."""
        if not any(histories):
            return None
        rows = [h if h is not None else RowHistory(p, (), 0, 0) for h, p in zip(histories, params)]
        process = cls(rows, [0] * len(rows), vocab_size, device)
        if grammars is not None and any(g is not None for g in grammars):
            process._guide = DraftGuide(grammars)
            process._grammar = process._guide.view(len(rows))
        return process

    def head(self, n: int) -> "LogitsProcess":
        """The first ``n`` rows (a draft pass's requests still drafting are a prefix)."""
        if n == len(self.rows):
            return self
        out = object.__new__(LogitsProcess)
        out.__dict__.update(self.__dict__)
        out.rows, out.row_drafts = self.rows[:n], self.row_drafts[:n]
        out.counts = None if self.counts is None else self.counts[:n]
        out.seen = None if self.seen is None else self.seen[:n]
        out.tail = None if self.tail is None else self.tail[:n]
        out._words = self._words.head(n)
        if self._guide is not None:
            out._grammar = self._guide.view(n)
        if self._factors is not None:
            out._factors = [f[:n] for f in self._factors]
        if self._bias is not None:
            cut = bisect.bisect_left(self._bias_rows, n)
            out._bias_rows = self._bias_rows[:cut]
            out._bias = tuple(t[:cut] for t in self._bias)  # rows below n: the flat places stay right
        return out

    def advance(self, token_ids: torch.Tensor) -> None:
        """Each row's history grows by one token (``[num_rows]`` on the device): a draft step."""
        self.row_drafts = [d + 1 for d in self.row_drafts]
        if self._guide is not None:
            self._guide.advance(token_ids)
            self._grammar = self._guide.view(len(self.rows))
        column = token_ids.view(-1, 1)
        if self.counts is not None:
            self.counts.scatter_add_(1, column, torch.ones_like(column, dtype=self.counts.dtype))
        if self.seen is not None:
            self.seen.scatter_(1, column, True)
        if self.tail is not None:
            self.tail = torch.cat([self.tail[:, 1:], column], dim=1)

    # ------------------------------------------------------------------ building
    def _build_counts(self, draft_ids, draft_index) -> None:
        """Output-token counts and the seen mask per row: the request's committed output
        (once per request, then gathered per row) plus the row's drafts, on the device."""
        spans, span_of_row = _unique(self.rows)
        vocab = self.vocab_size
        # Flat places (row * vocab + token): one scatter each, not an indexed put (which
        # costs many small ops on a GPU host).
        out_places, seen_places = [], []
        for i, span in enumerate(spans):
            out_places += [i * vocab + t for t in span.token_ids[span.num_prompt_tokens:span.end]]
            if span.params.repetition_penalty != 1.0:
                seen_places += [i * vocab + t for t in span.token_ids[:span.num_prompt_tokens]]
        d_rows = [r * vocab for r, index in enumerate(draft_index) for _ in index]
        d_places = [place for index in draft_index for place in index]
        out_t, seen_t, row_span, d_rows_t, d_places_t = to_device(
            [out_places, seen_places, span_of_row, d_rows, d_places], torch.int64, self.device)
        counts = torch.zeros(len(spans), vocab, dtype=torch.int32, device=self.device)
        counts.view(-1).scatter_add_(0, out_t, torch.ones_like(out_t, dtype=torch.int32))
        counts = counts.index_select(0, row_span)
        if d_places:
            drafts = draft_ids.index_select(0, d_places_t) + d_rows_t
            counts.view(-1).scatter_add_(0, drafts, torch.ones_like(drafts, dtype=torch.int32))
        self.counts = counts
        if self.any_repetition:
            prompt_seen = torch.zeros(len(spans), vocab, dtype=torch.bool, device=self.device)
            prompt_seen.view(-1).index_fill_(0, seen_t, True)
            self.seen = prompt_seen.index_select(0, row_span) | (counts > 0)

    def _build_tail(self, draft_ids, draft_index) -> torch.Tensor:
        """Each row's last ``W`` history tokens ``[num_rows, W]`` (``_NO_TOKEN`` before the
        first), its drafts' part gathered from the device."""
        width = self._words.width
        host, places, is_draft = [], [], []
        for row, index in zip(self.rows, draft_index):
            from_host = max(0, width - len(index))
            history = list(row.token_ids[max(0, row.end - from_host):row.end])
            places += range(len(host), len(host) + from_host)
            host += [_NO_TOKEN] * (from_host - len(history)) + history
            drafts = index[len(index) - (width - from_host):] if width > from_host else []
            places += drafts
            is_draft += [False] * from_host + [True] * len(drafts)
        places = [p + len(host) if d else p for p, d in zip(places, is_draft)]
        # One flat tensor: the host tokens, then every draft; ``places`` picks each row's window.
        host_t, places_t = to_device([host, places], torch.int64, self.device)
        flat = host_t if draft_ids is None else torch.cat([host_t, draft_ids])
        return flat.index_select(0, places_t).view(len(self.rows), width)

    # ------------------------------------------------------------------ applying
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The rows' logits ``[num_rows, vocab]`` processed: a new float32 tensor."""
        logits = logits.float().clone()
        vocab = logits.shape[1]
        if self._grammar is not None:
            apply_masks(logits, self._grammar[1], self._grammar[0], keep_empty=self._guide is not None)
        if self._words.width or self._words.single:
            self._words.ban(logits, self.tail, self.device)
        flat = logits.view(-1)
        if self._bias is not None:
            flat.scatter_add_(0, *self._bias)
        # min_tokens: the stop tokens of each row with fewer output tokens than that.
        held = [r * vocab + t for r, (row, drafts) in enumerate(zip(self.rows, self.row_drafts))
                if row.params.min_tokens and row.end - row.num_prompt_tokens + drafts < row.params.min_tokens
                for t in row.stop_token_ids if t < vocab]
        if held:
            (held_t,) = to_device([held], torch.int64, self.device)
            flat.index_fill_(0, held_t, float("-inf"))
        if self.any_repetition or self.any_penalty:
            self._penalise(logits)
        return logits

    def _penalise(self, logits: torch.Tensor) -> None:
        rep, freq, pres = self._factors
        if self.any_repetition:
            penalised = torch.where(logits > 0, logits / rep[:, None], logits * rep[:, None])
            logits.copy_(torch.where(self.seen, penalised, logits))
        if self.any_penalty:
            counts = self.counts.float()
            logits -= freq[:, None] * counts + pres[:, None] * (counts > 0)


class _BadWords:
    """Bad words as token sequences: a one-token word is banned everywhere; a longer one's
    last token is banned where the history ends with the rest of it."""

    def __init__(self, rows: list[RowHistory]) -> None:
        self.single: list[tuple[int, int]] = []          # (row, token)
        self.multi: list[tuple[int, list[int], int]] = []  # (row, prefix, last token)
        for r, row in enumerate(rows):
            for word in row.bad_words_token_ids:
                if len(word) == 1:
                    self.single.append((r, word[0]))
                elif word:
                    self.multi.append((r, list(word[:-1]), word[-1]))
        self.width = max((len(prefix) for _, prefix, _ in self.multi), default=0)

    def head(self, n: int) -> "_BadWords":
        out = object.__new__(_BadWords)
        out.single = [(r, t) for r, t in self.single if r < n]
        out.multi = [m for m in self.multi if m[0] < n]
        out.width = self.width  # the tail keeps its width
        return out

    def ban(self, logits: torch.Tensor, tail: torch.Tensor | None, device: torch.device) -> None:
        rows = [r for r, _ in self.single]
        tokens = [t for _, t in self.single]
        if self.multi:
            width = self.width
            m_rows = [r for r, _, _ in self.multi]
            # Prefixes right-aligned to the tail's width, padded with -2, which matches anything.
            prefixes = [t for _, prefix, _ in self.multi for t in [-2] * (width - len(prefix)) + prefix]
            m_rows_t, prefixes_t, last_t = to_device([m_rows, prefixes, [t for _, _, t in self.multi]],
                                                     torch.int64, device)
            prefixes_t = prefixes_t.view(len(m_rows), width)
            windows = tail.index_select(0, m_rows_t)
            match = ((windows == prefixes_t) | (prefixes_t == -2)).all(dim=1)
            # Where a word's prefix matches, its last token goes to -inf (else it gains 0).
            penalty = torch.zeros_like(match, dtype=logits.dtype).masked_fill_(match, float("-inf"))
            logits.view(-1).scatter_add_(0, m_rows_t * logits.shape[1] + last_t, penalty)
        if rows:
            (places_t,) = to_device([[r * logits.shape[1] + t for r, t in zip(rows, tokens)]], torch.int64, device)
            logits.view(-1).index_fill_(0, places_t, float("-inf"))


def _unique(rows: list[RowHistory]) -> tuple[list[RowHistory], list[int]]:
    """The distinct requests among ``rows`` (by identity, in order) and each row's index there."""
    index: dict[int, int] = {}
    spans: list[RowHistory] = []
    of_row = []
    for row in rows:
        i = index.get(id(row))
        if i is None:
            i = index[id(row)] = len(spans)
            spans.append(row)
        of_row.append(i)
    return spans, of_row


def process_rows(logits: torch.Tensor, histories: list[RowHistory | None], num_drafts: list[int],
                 draft_ids: torch.Tensor | None) -> torch.Tensor:
    """Verify logits ``[Σ(1 + k_i), vocab]`` with every processed request's rows processed
    (``histories[i]`` None, or asking for nothing: its rows are left as they are).
    ``draft_ids`` ``[Σ k_i]`` on the device: the spans' drafts, in order."""
    spans, counts, starts, rows = [], [], [], []
    row = draft = 0
    for history, k in zip(histories, num_drafts):
        if history is not None and history.params.processes_logits:
            spans.append(history)
            counts.append(k)
            starts.append(draft)
            rows += range(row, row + k + 1)
        row += k + 1
        draft += k
    if not spans:
        return logits
    process = LogitsProcess.for_spans(spans, counts, starts, logits.shape[1], logits.device, draft_ids)
    if len(rows) == logits.shape[0]:
        return process.apply(logits)
    (rows_t,) = to_device([rows], torch.int64, logits.device)
    return logits.float().index_copy(0, rows_t, process.apply(logits.index_select(0, rows_t)))
