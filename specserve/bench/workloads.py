"""Benchmark workloads that exist offline, plus synthetic prompts and users' own JSONL sets.

Built-in sets (every prompt a user message, sent to ``/v1/chat/completions``):

* ``code-edit`` — "add type hints / a docstring / ... and return the full code" on
  functions from Python's standard-library sources, where the answer repeats the prompt;
* ``summarize`` — summarisation of standard-library module documentation;
* ``chat`` — questions written for the project;
* ``shared-prefix`` — the chat questions behind one long system prompt (an assistant's
  instructions and reference documentation, about 1,100 tokens), the same for every
  request, as a deployed assistant sends it;
* ``multi-turn`` — chats of four turns: a chat question, then follow-ups, each turn sent
  once the previous answer has come, with the whole conversation so far (the model's own
  answers included), as chat clients resend it.

Code-edit and chat come from the *held-out* split of ``prompt_sets.py``, so
no draft model trained on that set has seen them; module documentation is not in it.

``random`` — synthetic prompts of random token ids (``--input-len`` tokens each, sent as
token ids to ``/v1/completions`` so the server sees exactly that length).

JSONL — your own set, one JSON object per line (blank lines are skipped)::

    {"prompt": "Once upon a time"}                             -> /v1/completions (raw text)
    {"messages": [{"role": "user", "content": "Hi!"}]}         -> /v1/chat/completions
    {"prompt": "def f(x):", "max_tokens": 64}                  -> its own output length

``prompt`` is a string (or a list of token ids); ``messages`` is an OpenAI chat. An
optional ``max_tokens`` (a positive integer) overrides ``--output-len`` for that line;
other keys are ignored. When a set has fewer prompts than requests, it is cycled.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import json
import random
from dataclasses import dataclass
from pathlib import Path

from specserve.bench.prompt_sets import held_out_prompts

BUILTIN_WORKLOADS = ("code-edit", "summarize", "chat", "shared-prefix", "multi-turn")
WORKLOADS = (*BUILTIN_WORKLOADS, "random")


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: a raw prompt (text or token ids) or a chat."""

    prompt: str | list[int] | None
    messages: list[dict] | None
    max_tokens: int
    # A chat's later turn: the index of the request it continues. Its ``messages`` are the
    # new turn only; it is sent after that request's answer, with that request's messages
    # and answer before its own.
    follows: int | None = None

    @property
    def is_chat(self) -> bool:
        return self.messages is not None

    def prompt_text(self) -> str | list[int]:
        """The raw prompt, or a chat's message contents joined (for /v1/completions)."""
        if self.messages is None:
            return self.prompt
        return "\n\n".join(m.get("content") or "" for m in self.messages)


def load_workload(name: str, num_prompts: int, *, output_len: int, input_len: int = 128,
                  seed: int = 0, tokenizer=None) -> list[BenchRequest]:
    """``num_prompts`` requests of a built-in workload, ``random`` (needs ``tokenizer``), or
    a JSONL file when ``name`` is a path. ValueError on a bad name, file or length."""
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    if output_len < 1:
        raise ValueError(f"--output-len must be >= 1, got {output_len}")
    if name == "random":
        if tokenizer is None:
            raise ValueError("the random workload needs a tokenizer")
        return random_requests(tokenizer, num_prompts, input_len, output_len, seed)
    if name == "shared-prefix":
        system = {"role": "system", "content": shared_system_prompt()}
        questions = chat_prompts()
        return [BenchRequest(None, [system, {"role": "user", "content": questions[i % len(questions)]}],
                             output_len) for i in range(num_prompts)]
    if name == "multi-turn":
        return multi_turn_requests(num_prompts, output_len)
    if name in BUILTIN_WORKLOADS:
        messages = {"code-edit": code_edit_prompts, "summarize": summarize_prompts,
                    "chat": chat_prompts}[name]()
        chats = [[{"role": "user", "content": m}] for m in messages]
        return [BenchRequest(None, chats[i % len(chats)], output_len) for i in range(num_prompts)]
    if name.endswith((".jsonl", ".json")) or Path(name).is_file():
        items = load_jsonl(name, output_len)
        return [items[i % len(items)] for i in range(num_prompts)]
    raise ValueError(f"unknown workload {name!r}: choose one of {', '.join(WORKLOADS)}, "
                     "or give a .jsonl file")


# ---------------------------------------------------------------------------- built-in sets
_EDIT_MARKERS = ("return the full", "Rewrite this function")


@functools.cache
def code_edit_prompts() -> tuple[str, ...]:
    """Held-out code-editing prompts on standard-library functions (the README's eight first)."""
    return tuple(p for p in held_out_prompts("code", 10**6)
                 if "```python" in p and any(m in p for m in _EDIT_MARKERS))


@functools.cache
def chat_prompts() -> tuple[str, ...]:
    """Held-out chat questions written for the project (the README's eight first)."""
    return tuple(held_out_prompts("chat", 10**6))


_SYSTEM_PREAMBLE = (
    "You are a careful assistant for Python programmers. Answer briefly and precisely, show "
    "code where it helps, and say so when you are not sure. The reference documentation "
    "below is for your answers; quote it only where it applies.\n\n")
FOLLOW_UPS = ("Can you give a short example?", "Summarise your answer in one sentence.",
              "What is a common mistake here?", "How would you explain that to a beginner?",
              "What should I read next about this?")
TURNS_PER_CHAT = 4


@functools.cache
def shared_system_prompt() -> str:
    """The shared-prefix workload's system prompt: a preamble and three modules' documentation."""
    docs = [p.split("\n\n", 1)[1] for p in summarize_prompts()[:3]]
    return _SYSTEM_PREAMBLE + "\n\n".join(docs)


def multi_turn_requests(num_prompts: int, output_len: int) -> list[BenchRequest]:
    """Chats of ``TURNS_PER_CHAT`` turns, turn by turn (every chat's first turn, then every
    second turn, ...), ``num_prompts`` requests in all: a held-out chat question, then
    follow-ups, each a request that ``follows`` the chat's previous turn."""
    questions = chat_prompts()
    num_chats = -(-num_prompts // TURNS_PER_CHAT)
    out: list[BenchRequest] = []
    previous: dict[int, int] = {}
    for turn in range(TURNS_PER_CHAT):
        for chat in range(num_chats):
            if len(out) == num_prompts:
                return out
            text = questions[chat % len(questions)] if turn == 0 else FOLLOW_UPS[(chat + turn) % len(FOLLOW_UPS)]
            out.append(BenchRequest(None, [{"role": "user", "content": text}], output_len,
                                    follows=previous.get(chat)))
            previous[chat] = len(out) - 1
    return out


# Modules whose docstrings are long prose, present in Python 3.11 through 3.13.
_DOC_MODULES = ("argparse", "cmd", "configparser", "copy", "csv", "fileinput", "hashlib", "heapq",
                "inspect", "io", "itertools", "json", "plistlib", "pyclbr", "random", "re", "sched",
                "shelve", "site", "socketserver", "statistics", "subprocess", "sys", "timeit",
                "unittest", "uuid", "wave", "doctest", "gc", "struct")
_SUMMARY_TASKS = ("Summarise this documentation in plain English:",
                  "Summarise the following text in three sentences:",
                  "Write a short summary of this documentation for a beginner programmer:",
                  "Summarise the key points of this documentation as a bulleted list:")
_MAX_DOC_CHARS = 1600


@functools.cache
def summarize_prompts() -> tuple[str, ...]:
    """Summarisation of standard-library module documentation, cut at a paragraph near
    ``_MAX_DOC_CHARS`` characters."""
    out = []
    for i, name in enumerate(_DOC_MODULES):
        try:
            doc = inspect.getdoc(importlib.import_module(name)) or ""
        except ImportError:
            continue
        if len(doc) < 400:
            continue
        if len(doc) > _MAX_DOC_CHARS:
            cut = doc.rfind("\n\n", 0, _MAX_DOC_CHARS)
            doc = doc[:cut if cut > 400 else _MAX_DOC_CHARS]
        out.append(f"{_SUMMARY_TASKS[i % len(_SUMMARY_TASKS)]}\n\n{doc}")
    return tuple(out)


# ---------------------------------------------------------------------------- synthetic
def random_requests(tokenizer, num_prompts: int, input_len: int, output_len: int,
                    seed: int = 0) -> list[BenchRequest]:
    """Prompts of exactly ``input_len`` random token ids, never a special token."""
    if input_len < 1:
        raise ValueError(f"--input-len must be >= 1, got {input_len}")
    special = set(tokenizer.all_special_ids)
    vocab = [t for t in range(len(tokenizer)) if t not in special]
    rng = random.Random(seed)
    return [BenchRequest([rng.choice(vocab) for _ in range(input_len)], None, output_len)
            for _ in range(num_prompts)]


# ---------------------------------------------------------------------------- JSONL
def load_jsonl(path: str | Path, output_len: int) -> list[BenchRequest]:
    """Read the JSONL format in this module's docstring; ValueError names the bad line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror or exc}") from None
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(_parse_line(json.loads(line), output_len))
        except (json.JSONDecodeError, ValueError) as exc:
            raise ValueError(f"{path}:{number}: {exc}") from None
    if not out:
        raise ValueError(f"{path}: no prompts in the file")
    return out


def _parse_line(item, output_len: int) -> BenchRequest:
    if not isinstance(item, dict):
        raise ValueError("each line must be a JSON object")
    max_tokens = item.get("max_tokens", output_len)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    prompt, messages = item.get("prompt"), item.get("messages")
    if (prompt is None) == (messages is None):
        raise ValueError('give exactly one of "prompt" and "messages"')
    if messages is not None:
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise ValueError('"messages" must be a non-empty list of {"role": ..., "content": ...}')
        return BenchRequest(None, messages, max_tokens)
    if isinstance(prompt, str) and prompt:
        return BenchRequest(prompt, None, max_tokens)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                   for t in prompt):
        return BenchRequest(list(prompt), None, max_tokens)
    raise ValueError('"prompt" must be a non-empty string or list of token ids')
