"""Prompt sets that exist offline: code editing built from Python's standard-library
sources, and chat questions written for this project. Each prompt is a user message; the
benchmarks apply the model's chat template."""
from __future__ import annotations

import colorsys
import fnmatch
import heapq
import inspect
import calendar
import shlex
import string
import textwrap

# Code editing: the answer repeats most of the input, as real editing requests do.
_CODE_TASKS = [
    ("Add type hints to this function and return the full edited code:", textwrap.dedent),
    ("Rename the variables of this function to clearer names and return the full code:", heapq.nsmallest),
    ("Add a docstring to this function and return the full edited code:", colorsys.rgb_to_hls),
    ("Rewrite this function without changing its behaviour, adding comments:", shlex.quote),
    ("Add type hints to this function and return the full edited code:", string.capwords),
    ("Add input validation to this function and return the full edited code:", textwrap.indent),
    ("Add a docstring to this function and return the full edited code:", fnmatch.filter),
    ("Rewrite this function using early returns and return the full code:", calendar.monthrange),
]

CODE_EDITING = [f"{task}\n\n```python\n{inspect.getsource(fn)}```" for task, fn in _CODE_TASKS]

CHAT = [
    "What is the capital of France, and what is it famous for?",
    "Give me three tips for writing clear technical documentation.",
    "Explain the difference between a process and a thread.",
    "How does a hash table handle collisions?",
    "What are the benefits of regular exercise?",
    "Summarise the plot of Romeo and Juliet in three sentences.",
    "Why is the sky blue?",
    "Write a short poem about the sea.",
]

WORKLOADS = {"code-edit": CODE_EDITING, "chat": CHAT}


def chat_prompts(tokenizer, messages: list[str]) -> list[str]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": m}], tokenize=False,
                                          add_generation_prompt=True) for m in messages]
