"""Shared fixtures: tiny seeded random Llama-family checkpoints with a real tokenizer,
written to disk the way users' checkpoints are, so the whole loading path is exercised."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tiny_models import TINY_COMMON, make_hf_model, make_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():
    # Triton kernels run under the interpreter on CPU (test_triton_kernels.py). Triton
    # reads this when it and each kernel are first imported, so it is set before anything
    # imports triton; nothing else in the suite uses triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return make_tokenizer(TINY_COMMON["vocab_size"])


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer):
    """Save a tiny checkpoint of ``variant`` to disk once per session; returns its path."""
    cache: dict[str, Path] = {}

    def build(variant: str = "llama") -> Path:
        if variant not in cache:
            path = tmp_path_factory.mktemp(f"tiny-{variant}")
            make_hf_model(variant).save_pretrained(path)
            tiny_tokenizer.save_pretrained(path)
            cache[variant] = path
        return cache[variant]

    return build


CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")


@pytest.fixture(scope="session")
def chat_model_dir(tiny_model_dir, tmp_path_factory, tiny_tokenizer):
    """The tiny llama with a chat template, so chat endpoints and chat workloads can run."""
    import shutil

    path = tmp_path_factory.mktemp("tiny-chat")
    shutil.copytree(tiny_model_dir("llama"), path, dirs_exist_ok=True)
    tok = tiny_tokenizer.__class__.from_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def default_model_path():
    """The embedded default model, converted once into the specserve cache."""
    from specserve.loader import resolve_model

    return resolve_model(None).path
