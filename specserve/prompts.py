"""Prompts to token ids: plain text or ids, and chats through the tokenizer's template.

Used by the engine and, with their own tokenizer copy, by callers on other threads (the
HTTP server checks lengths before queuing anything).
"""
from __future__ import annotations

from collections.abc import Sequence


def check_text(text: str, what: str = "prompt") -> str:
    """``text``, or ValueError when it cannot be encoded as UTF-8 (a lone surrogate such as
    ``"\\ud800"``, which JSON allows and a tokenizer cannot take)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid text: {exc.reason} at character {exc.start} "
                         f"({text[exc.start]!r})") from None
    return text


def tokenize_prompt(tokenizer, prompt: str | Sequence[int], vocab_size: int) -> tuple[str | None, list[int]]:
    """``(text or None, token ids)``; ValueError for an empty, ill-typed, invalid (a lone
    surrogate) or out-of-vocabulary prompt."""
    if isinstance(prompt, str):
        token_ids = tokenizer.encode(check_text(prompt))
        text = prompt
        if token_ids and max(token_ids) >= vocab_size:
            raise ValueError(f"the tokenizer produced token id {max(token_ids)}, outside the "
                             f"model's vocabulary of {vocab_size}: tokenizer and model do not match")
    elif isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool)
                                              for t in prompt):
        token_ids, text = list(prompt), None
        if any(not 0 <= t < vocab_size for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
    else:
        raise ValueError("prompt must be a string or a list of token ids")
    if not token_ids:
        raise ValueError("prompt is empty")
    return text, token_ids


def chat_prompt_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
    """Token ids of a chat (``[{"role": ..., "content": ...}]``), ready for the assistant's
    turn unless ``add_generation_prompt`` is False, with ``tools`` (OpenAI's tool objects)
    for a template that writes them. ValueError when the tokenizer has no chat template or
    it fails on the messages."""
    if not tokenizer.chat_template:
        raise ValueError("this model's tokenizer has no chat template")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, tools=tools,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # jinja errors from a conversation the template refuses
        raise ValueError(f"the chat template failed on these messages: {exc}") from None
    # The template already wrote any special tokens it wants as text.
    return tokenizer(check_text(text, "a message"), add_special_tokens=False)["input_ids"]
