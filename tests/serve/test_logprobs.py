"""Log-probabilities in OpenAI's formats with a byte-level BPE tokenizer whose tokens split characters: each
token's own bytes (not U+FFFD), and text offsets in characters of the text (a split character counted once)."""

from __future__ import annotations

import pytest

from pagedjax.outputs import TokenLogprobs
from pagedjax.serve.logprobs import TextOffsets, chat_logprobs, completion_logprobs
from tests.engine.test_outputs import bpe  # noqa: F401  (the fixture: a small byte-level BPE trained here)


def _entries(ids):
    return [TokenLogprobs(i, -1.0, ((i, -1.0),)) for i in ids]


def _split_character_ids(tok, text: str) -> list[int]:
    ids = tok.encode(text, add_special_tokens=False)
    if not any("\ufffd" in tok.decode([i]) for i in ids):
        pytest.skip(f"this BPE keeps {text!r}'s characters whole")
    return ids


def test_tokens_of_a_split_character_keep_their_bytes(bpe):  # noqa: F811
    ids = _split_character_ids(bpe, "→→ ok")
    assert b"".join(bpe.decode_bytes([i]) for i in ids) == "→→ ok".encode()
    chat = chat_logprobs(bpe, _entries(ids))["content"]
    assert b"".join(bytes(c["bytes"]) for c in chat) == "→→ ok".encode()  # not the replacement's bytes
    assert all("\ufffd" not in c["token"] for c in chat)
    partial = [c["token"] for c in chat if c["token"].startswith("bytes:")]
    assert partial and all(c.startswith("bytes:\\x") for c in partial)


def test_text_offsets_count_characters_of_the_text(bpe):  # noqa: F811
    text = "a→b→→c"
    ids = _split_character_ids(bpe, text)
    whole = completion_logprobs(bpe, _entries(ids))
    offsets = whole["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] < len(text)
    for k, offset in enumerate(offsets):  # each token starts after the characters its predecessors completed
        assert offset == len(bpe.decode_bytes(ids[:k]).decode("utf-8", errors="ignore"))
    # Streamed in chunks that split characters, the offsets carry on.
    carried, streamed = TextOffsets(), []
    for start in range(0, len(ids), 2):
        streamed += completion_logprobs(bpe, _entries(ids[start:start + 2]), carried)["text_offset"]
    assert streamed == offsets


def test_an_id_past_the_tokenizers_vocabulary_is_a_token_with_no_text(bpe):  # noqa: F811
    """Models pad their vocabulary past the tokenizer's (Phi-3: 32,064 rows, 32,011 tokens), and a model may
    sample a padding id: its log-probability entry is an empty token (it was a 500), as its text is nothing."""
    past = bpe.vocab_size + 3
    ids = [*bpe.encode("ok", add_special_tokens=False), past]
    assert bpe.decode_bytes([past]) == b"" and bpe.decode(ids) == bpe.decode(ids[:-1])
    chat = chat_logprobs(bpe, _entries(ids))["content"]
    assert chat[-1]["token"] == "" and chat[-1]["bytes"] == []
    assert completion_logprobs(bpe, _entries(ids))["tokens"][-1] == ""
