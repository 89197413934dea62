"""Structured output: decoding constrained by a JSON schema, a regular expression, a
choice of strings or a grammar (Lark, or GBNF/EBNF as llama.cpp writes it), through
llguidance (docs/structured-output.md says why llguidance rather than xgrammar).

- ``StructuredOutputs`` is what a request asks for (``SamplingParams.structured_outputs``).
- ``Grammars`` compiles it for the engine's tokenizer, cached by what was asked, safe to
  call from any thread: the server compiles in its prompt worker before the request is
  queued, so a compilation never runs inside an engine step.
- ``Constraint`` is one request's place in its grammar. At a verify step it reads the
  step's drafts in order: the mask of the target's row j is the grammar's state after
  drafts d1 … d(j-1), and the drafts from the first one the grammar refuses are cut before
  the pass, so the target never computes them. Then it rolls back to the committed tokens.
  After rejection sampling it accepts the tokens the step emitted. The matcher's rollback
  does this; nothing is ever replayed from the start.

Masked rows are -inf outside the grammar before temperature and the filters, so p is the
target's distribution restricted to the grammar, and rejection sampling stays exact for
any q. A draft outside the grammar would only be rejected; it is cut instead.
"""
from __future__ import annotations

import bisect
import copy
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.transfer import to_device

MAX_CACHED_GRAMMARS = 256


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one of: ``json`` (a JSON schema, as a dict or its text), ``json_object``
    (any JSON object), ``regex``, ``choice`` (one of these strings), ``grammar`` (Lark, or
    GBNF as llama.cpp writes it). JSON comes with ", " and ": " between items and no other
    whitespace outside strings."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object is True:
            given.append("json_object")
        elif self.json_object is not False:
            raise ValueError(f"structured_outputs.json_object must be true or false, got {self.json_object!r}")
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, json_object, regex, choice and "
                             f"grammar, got {', '.join(given) or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object), got {self.json!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a list of non-empty strings, got {self.choice!r}")

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): what the compiled grammar is cached by."""
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else json.dumps(self.json)  # property order kept
            return "json", text
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(list(self.choice))
        return "grammar", self.grammar


class Grammars:
    """Compiled grammars for one tokenizer and vocabulary, cached by ``StructuredOutputs.key``
    (the most recent ``MAX_CACHED_GRAMMARS``). Thread-safe. A compiled grammar is an
    llguidance matcher at its start, which each request's ``Constraint`` copies."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        import llguidance  # lazy: only requests with structured output need it

        self.vocab_size = vocab_size
        self.stop_token_ids = frozenset(stop_token_ids)
        self._tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenBytes(tokenizer, vocab_size)),
                                                 n_vocab=vocab_size, eos_token=list(stop_token_ids))
        _check_tokenizer(self._tokenizer, tokenizer)
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputs):
        """The compiled grammar; ValueError naming what is wrong with a bad schema, regex
        or grammar."""
        key = spec.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiled = self._compile(*key)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, kind: str, text: str):
        # lazy: llguidance only for requests with structured output (as in __init__)
        import llguidance
        from llguidance.gbnf_to_lark import any_to_lark

        what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar"}.get(kind, kind)
        try:
            if kind in ("json", "json_object"):
                schema = json.loads(text) if kind == "json" else {"type": "object"}
                if not isinstance(schema, dict):
                    raise ValueError("a JSON schema is an object")
                grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_FORMAT)
            elif kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(text)
            elif kind == "choice":
                # JSON string literals are valid Lark string literals (the same escapes)
                alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in json.loads(text))
                grammar = llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
            else:
                grammar = llguidance.LLMatcher.grammar_from_lark(any_to_lark(text))
            matcher = llguidance.LLMatcher(self._tokenizer, grammar)
        except Exception as exc:  # noqa: BLE001 - the library's error on the user's input, whatever its type
            raise ValueError(f"structured_outputs: the {what} cannot be used: {_first_line(exc)}") from None
        if matcher.is_error():
            raise ValueError(f"structured_outputs: the {what} cannot be used: {_first_line(matcher.get_error())}")
        return matcher

    def constraint(self, spec: StructuredOutputs) -> "Constraint":
        return Constraint(self.compile(spec).deep_copy(), self.vocab_size, self.stop_token_ids)


class _TokenBytes:
    """A tokenizer as llguidance's ``TokenizerWrapper`` takes it: each token's bytes, read
    from the vocabulary itself, and the tokenizer to tokenise text.

    Not ``llguidance.hf.from_tokenizer``: that reads the tokenizer's serialised form, and
    transformers 5.17's GGUF conversion (the GPU hosts') serialises the default model's
    byte-level tokens so that llguidance reads most of them wrongly. A token's text is
    written in one of three ways (GPT-2's byte alphabet, SentencePiece's "▁" and
    ``<0xAB>``, or plain text); the one that agrees with the tokenizer's own decoding of
    the vocabulary is used, and ``_check_tokenizer`` checks the result."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self._tokenizer = copy.deepcopy(tokenizer)  # called from llguidance, on any thread
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items() if i < vocab_size}
        self.special_token_ids = sorted(i for i, t in tokenizer.added_tokens_decoder.items()
                                        if t.special and i < vocab_size)
        pieces = tokenizer.convert_ids_to_tokens(list(range(min(vocab_size, len(tokenizer)))))
        self.tokens = _read_pieces(tokenizer, pieces, added) + [b""] * (vocab_size - len(pieces))

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character each byte is written as."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _read_pieces(tokenizer, pieces: list[str | None], added: dict[int, str]) -> list[bytes]:
    """Each token's bytes, by whichever way of writing them agrees with the tokenizer."""
    alphabet = _byte_level_alphabet()
    hex_byte = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")

    def byte_level(piece: str) -> bytes | None:
        return bytes(alphabet[c] for c in piece) if all(c in alphabet for c in piece) else None

    def sentencepiece(piece: str) -> bytes:
        found = hex_byte.match(piece)
        return bytes([int(found.group(1), 16)]) if found else piece.replace("\u2581", " ").encode("utf-8")

    def plain(piece: str) -> bytes:
        return piece.encode("utf-8")

    step = max(1, len(pieces) // 2048)
    sample = [i for i in range(0, len(pieces), step) if i not in added and pieces[i] is not None]
    text = _token_text(tokenizer)
    decoded = {i: text(i) for i in sample}
    sample = [i for i in sample if "\ufffd" not in decoded[i]]
    for read in (byte_level, sentencepiece, plain):
        if all(read(pieces[i]) == decoded[i].encode("utf-8") for i in sample):
            return [added[i].encode("utf-8") if i in added else (read(p) or b"") if p is not None else b""
                    for i, p in enumerate(pieces)]
    raise ValueError("structured output is not available with this tokenizer: its tokens are written in a "
                     "way specserve cannot read (neither byte-level, SentencePiece nor plain text)")


def _token_text(tokenizer):
    """``text(token)``: one token's text as it reads inside a text, after another token,
    since a decoder may drop the leading space of a text's first token (SentencePiece's does)."""
    anchor = tokenizer.encode("a", add_special_tokens=False)[-1:]
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False,  # noqa: E731
                                          clean_up_tokenization_spaces=False)
    skip = len(decode(anchor))
    return lambda token: decode(anchor + [token])[skip:]


def _check_tokenizer(lltok, tokenizer, samples: int = 4096) -> None:
    """Masks are only as right as llguidance's idea of each token's bytes. Compare the
    bytes of a spread of tokens (and every one-character token) with what the tokenizer
    decodes; refuse on any difference rather than constrain approximately."""
    vocab = tokenizer.get_vocab()
    special = set(tokenizer.all_special_ids)
    step = max(1, len(vocab) // samples)
    ids = sorted({i for i in range(0, len(vocab), step)} | {i for t, i in vocab.items() if len(t) == 1})
    wrong, token_text = [], _token_text(tokenizer)
    for token in ids:
        if token in special or token >= lltok.vocab_size:
            continue
        text = token_text(token)
        if "\ufffd" in text:  # a piece of a character: its bytes are not in the text
            continue
        if lltok.decode_bytes([token]) != text.encode("utf-8"):
            wrong.append(token)
    if wrong:
        raise ValueError(f"structured output is not available with this tokenizer: llguidance reads "
                         f"{len(wrong)} of {len(ids)} tokens checked differently from it "
                         f"(token {wrong[0]}: {tokenizer.convert_ids_to_tokens(wrong[0])!r})")


# JSON as the model writes it most often: ", " and ": " between items, no other whitespace
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _first_line(error) -> str:
    """An error's first line, with the "error: ..." lines of a multi-line report."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    reasons = [line.removeprefix("error:").strip() for line in lines[1:] if line.startswith("error:")]
    return "; ".join([lines[0].rstrip(":"), *reasons])


class Constraint:
    """One request's place in its grammar (see the module's docstring)."""

    def __init__(self, matcher, vocab_size: int, stop_token_ids: frozenset[int] = frozenset()) -> None:
        self.matcher = matcher
        self.words = (vocab_size + 31) // 32
        self.stop_token_ids = stop_token_ids

    def check_drafts(self, drafts: Sequence[int]) -> tuple[int, torch.Tensor]:
        """(n, masks): how many of ``drafts`` lie inside the grammar's masks in a row, and
        the bitmask ``[n + 1, ceil(vocab / 32)]`` int32 of the target's rows 0 … n (row j:
        after the first j drafts; bit t allows token t). The matcher ends where it began."""
        from llguidance.torch import fill_next_token_bitmask  # lazy: as in Grammars

        masks = torch.zeros((len(drafts) + 1, self.words), dtype=torch.int32)
        n = kept = 0
        while True:
            fill_next_token_bitmask(self.matcher, masks, n)
            if n == len(drafts) or not allows(masks[n], drafts[n]):
                kept = n
                break
            if drafts[n] in self.stop_token_ids:
                # The output would end here, and the drafts after it are cut. Its row (a
                # bonus token's, discarded) keeps the last mask. Not consumed: rolling a
                # finished matcher back does not reopen it.
                masks[n + 1] = masks[n]
                kept = n + 1
                break
            if not self.matcher.consume_token(drafts[n]):
                raise RuntimeError(f"token {drafts[n]} is in the grammar's mask but refused: "
                                   f"{self.matcher.get_error()}")
            n += 1
        if n:
            self.matcher.rollback(n)
        return kept, masks[:kept + 1]

    def forced(self, limit: int) -> list[int]:
        """The next tokens the grammar forces (one continuation only: JSON punctuation, a
        key the schema fixes, the rest of an enum value), at most ``limit``, tokenised as
        the tokenizer would; they are drafts whose every position the mask allows."""
        return self.matcher.compute_ff_tokens()[:limit] if limit > 0 else []

    def accept(self, tokens: Sequence[int]) -> None:
        """The tokens a step emitted (each was inside the mask of its row)."""
        for token in tokens:
            if not self.matcher.consume_token(token):
                raise RuntimeError(f"token {token} is outside the request's grammar: {self.matcher.get_error()}")


class DraftGuide:
    """A grammar along a draft model's own proposals, so that its q is masked as the
    target's p is: each drafting row whose request has a grammar gets the grammar's mask
    after that row's proposals so far. On copies of the requests' matchers: the requests'
    own stay at their committed tokens for the step's constrain stage.

    Following the proposals means reading them on the host at each draft step: free on a
    CPU, a sync per draft step on a GPU, where only the first proposal (whose mask needs
    no proposal) is guided. A row stops being guided at a stop token or a proposal its
    mask refuses (possible only where the draft's vocabulary and the grammar share no
    token, and the row was left unmasked): the drafts from there are cut before
    verification anyway."""

    def __init__(self, constraints: Sequence["Constraint | None"]) -> None:
        from llguidance.torch import fill_next_token_bitmask  # lazy: as in Grammars

        self._fill = fill_next_token_bitmask
        self.rows = [r for r, c in enumerate(constraints) if c is not None]
        self._matchers = [constraints[r].matcher.deep_copy() for r in self.rows]
        self._stops = [constraints[r].stop_token_ids for r in self.rows]
        self._live = [True] * len(self.rows)
        self.masks = torch.zeros((len(self.rows), constraints[self.rows[0]].words), dtype=torch.int32)
        for k, matcher in enumerate(self._matchers):
            self._fill(matcher, self.masks, k)

    def view(self, num_rows: int) -> tuple[list[int], torch.Tensor] | None:
        """(rows, masks) of the rows still guided among the first ``num_rows`` (None: none)."""
        live = [k for k in range(bisect.bisect_left(self.rows, num_rows)) if self._live[k]]
        if not live:
            return None
        return [self.rows[k] for k in live], self.masks[live] if len(live) < len(self.rows) else self.masks

    def advance(self, tokens: torch.Tensor) -> None:
        """The draft step's proposals (``[rows still drafting]``, on the device). On a
        GPU, reading them would add a sync to every draft step, which costs more than the
        drafts it saves (docs/lab-notes.md): there only the first proposal is guided."""
        if tokens.device.type != "cpu":
            self._live = [False] * len(self.rows)
        live = [k for k, r in enumerate(self.rows) if r < len(tokens) and self._live[k]]
        if not live:
            return
        (index,) = to_device([[self.rows[k] for k in live]], torch.int64, tokens.device)
        for k, token in zip(live, tokens.index_select(0, index).tolist()):
            matcher = self._matchers[k]
            if token in self._stops[k] or not allows(self.masks[k], token) or not matcher.consume_token(token):
                self._live[k] = False  # its mask stays: the drafts after this one are cut
            else:
                self._fill(matcher, self.masks, k)


def allows(mask: torch.Tensor, token: int) -> bool:
    """Whether one bitmask row allows ``token``."""
    return 0 <= token < 32 * mask.shape[0] and bool((int(mask[token // 32]) >> (token % 32)) & 1)


def apply_masks(logits: torch.Tensor, masks: torch.Tensor, rows: Sequence[int], keep_empty: bool = False) -> None:
    """Set ``logits`` [num_rows, vocab] to -inf outside the bitmasks (``masks`` [len(rows),
    ceil(vocab / 32)] int32 on the host, bit t of a row allowing token t) of ``rows``, in
    place. ``keep_empty``: a row the mask would leave with no finite logit stays as it was
    (a draft whose vocabulary the grammar does not meet: its proposal is cut later)."""
    device, vocab = logits.device, logits.shape[1]
    # Through a pinned buffer: a copy from pageable memory would wait for the device.
    (masks,) = to_device([masks.numpy()], torch.int32, device)
    shifts = torch.arange(32, device=device, dtype=torch.int32)
    allowed = ((masks.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)[:, :vocab].bool()
    (rows_t,) = to_device([list(rows)], torch.int64, device)
    before = logits.index_select(0, rows_t)
    masked = before.masked_fill(~allowed, float("-inf"))
    if keep_empty:
        masked = torch.where((masked > float("-inf")).any(dim=-1, keepdim=True), masked, before)
    logits.index_copy_(0, rows_t, masked)
