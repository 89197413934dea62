"""Incremental detokenisation: the same text as decoding everything at once, whole
characters only, and a bounded tail when the bytes are invalid."""
from __future__ import annotations

import random

import pytest

from specserve.outputs import IncrementalDetokenizer, _decoder


def stream(tokenizer, prompt: list[int], tokens: list[int], chunk: int = 1) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=True)
    deltas = [detok.append(tokens[i:i + chunk]) for i in range(0, len(tokens), chunk)]
    return deltas + [detok.flush()]


@pytest.mark.parametrize("chunk", [1, 3, 5, 6, 8])
def test_deltas_add_up_to_the_whole_decode(tiny_tokenizer, chunk):
    text = "def f(x):\n    return x  # naïve café 😀 done\n"
    tokens = tiny_tokenizer.encode(text)
    deltas = stream(tiny_tokenizer, tiny_tokenizer.encode("prompt:"), tokens, chunk)
    assert "".join(deltas) == tiny_tokenizer.decode(tokens)
    assert not any(d.endswith("\ufffd") for d in deltas)  # characters are never split


def test_a_split_character_is_held_until_it_is_whole(tiny_tokenizer):
    emoji = tiny_tokenizer.encode("😀")
    assert len(emoji) == 4  # one token per byte in this tokenizer
    deltas = stream(tiny_tokenizer, [], tiny_tokenizer.encode("a") + emoji)
    assert deltas[:-1] == ["a", "", "", "", "😀"]


def test_a_split_character_after_whole_ones_in_one_step_is_held(tiny_tokenizer):
    """A speculative step appends several tokens at once: whole characters followed by
    the first bytes of one more. The whole ones are emitted, the split one is held, even
    when more tokens are pending than a character can have."""
    emoji = tiny_tokenizer.encode("😀")
    tokens = tiny_tokenizer.encode("abcd") + emoji[:3]
    detok = IncrementalDetokenizer(tiny_tokenizer, [], skip_special_tokens=True)
    assert len(tokens) > IncrementalDetokenizer.MAX_PENDING
    assert detok.append(tokens) == "abcd"
    assert detok.append(emoji[3:] + tiny_tokenizer.encode(" ok")) == "😀 ok"


def test_invalid_bytes_are_committed_once_no_character_can_be_that_long(tiny_tokenizer):
    """A tail of continuation bytes is never a character: after more pending tokens than a
    character has bytes it is emitted as is (U+FFFD), so later steps decode a short tail."""
    continuation = tiny_tokenizer.encode("😀")[1]  # a lone continuation byte
    detok = IncrementalDetokenizer(tiny_tokenizer, [], skip_special_tokens=True)
    deltas = [detok.append([continuation]) for _ in range(12)]
    assert deltas[:IncrementalDetokenizer.MAX_PENDING] == [""] * IncrementalDetokenizer.MAX_PENDING
    assert any(deltas)
    assert len(detok.token_ids) - detok.prefix_offset <= 2 * (IncrementalDetokenizer.MAX_PENDING + 1)
    assert "".join(deltas) + detok.flush() == tiny_tokenizer.decode([continuation] * 12)


def test_the_fast_decoder_is_the_tokenizers_decode(tiny_tokenizer):
    rng = random.Random(0)
    for skip in (True, False):
        fast = _decoder(tiny_tokenizer, skip)
        assert fast.__code__ is not _decoder(object(), skip).__code__  # the backend path was taken
        for _ in range(300):
            ids = [rng.randrange(len(tiny_tokenizer)) for _ in range(rng.randint(0, 10))]
            assert fast(ids) == tiny_tokenizer.decode(ids, skip_special_tokens=skip)


def test_the_fast_decoder_with_clean_up_switched_on(tiny_tokenizer, monkeypatch):
    """clean_up_tokenization_spaces on: transformers versions that skip it for BPE
    tokenizers leave the backend's text as it is, and then the backend path is taken;
    where clean-up runs, the probe sees it and transformers' decode is kept. Either way
    the decoder gives exactly tokenizer.decode."""
    import copy

    from specserve.outputs import _CLEANUP_PROBE, _cleanup_skipped

    tokenizer = copy.deepcopy(tiny_tokenizer)
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True, raising=False)
    backend = tokenizer.backend_tokenizer
    ids = tokenizer.encode(_CLEANUP_PROBE)
    skipped = tokenizer.decode(ids) == backend.decode(ids)  # what this transformers does
    assert _cleanup_skipped(tokenizer, backend) == skipped
    fast = _decoder(tokenizer, True)
    assert (fast.__code__ is not _decoder(object(), True).__code__) == skipped
    rng = random.Random(1)
    for _ in range(100):
        sample = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(0, 10))] + ids
        assert fast(sample) == tokenizer.decode(sample, skip_special_tokens=True)

    class CleansUp:  # a tokenizer whose decode does clean up
        def encode(self, text, add_special_tokens=True):
            return tokenizer.encode(text, add_special_tokens=add_special_tokens)

        def decode(self, token_ids, skip_special_tokens=False):
            return tokenizer.clean_up_tokenization(backend.decode(token_ids, skip_special_tokens=skip_special_tokens))

    assert not _cleanup_skipped(CleansUp(), backend)


def test_a_run_of_skipped_special_tokens_does_not_grow_the_decoded_tail(tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    detok = IncrementalDetokenizer(tiny_tokenizer, tiny_tokenizer.encode("x = 1"), skip_special_tokens=True)
    assert detok.append(tiny_tokenizer.encode(" y")) == " y"
    for _ in range(200):
        assert detok.append([eos]) == ""
    assert len(detok.token_ids) - detok.prefix_offset <= 2 * (IncrementalDetokenizer.MAX_HELD + 1)
    assert detok.append(tiny_tokenizer.encode(" z")) == " z"
