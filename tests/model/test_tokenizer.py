"""ByteTokenizer: lossless on any bytes, UTF-8 text round trips, special tokens dropped on decode."""

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from pagedjax.config import ModelConfig
from pagedjax.model.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def test_vocabulary_layout():
    assert TOK.vocab_size == ByteTokenizer.vocab_size == 259 == ModelConfig().vocab_size == len(TOK)
    assert (TOK.bos_token_id, TOK.eos_token_id, TOK.pad_token_id) == (256, 257, 258)
    assert TOK.eos_token_ids == (257,)
    assert TOK.encode("") == [256]
    assert TOK.encode("", add_bos=False) == []
    assert TOK.encode("ab", add_eos=True) == [256, 97, 98, 257]


@given(st.binary(max_size=300))
@example(b"\xff\xfe\x80")  # never valid UTF-8
@example(b"\xc3")  # a truncated two-byte sequence
@example(b"\xed\xa0\x80")  # an encoded surrogate
@example(bytes(range(256)))
def test_round_trip_arbitrary_bytes(data):
    ids = TOK.encode(data)
    assert ids[0] == TOK.bos_token_id
    assert ids[1:] == list(data) == TOK.encode(data, add_bos=False)
    assert all(0 <= i < TOK.vocab_size for i in ids)
    assert TOK.decode_bytes(ids) == data
    # decode never raises: invalid UTF-8 becomes U+FFFD exactly as Python's own decoder does it
    assert TOK.decode(ids) == data.decode("utf-8", errors="replace")
    assert TOK.encode(bytearray(data)) == ids == TOK.encode(memoryview(data))


@given(st.text(max_size=200))
@example("héllo wörld ✓ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢")
def test_round_trip_text(text):
    ids = TOK.encode(text)
    assert ids[1:] == list(text.encode("utf-8"))
    assert TOK.decode(ids) == text


@given(st.lists(st.integers(0, 258), max_size=100))
def test_special_tokens_are_dropped(ids):
    plain = bytes(i for i in ids if i < 256)
    assert TOK.decode_bytes(ids) == plain
    assert TOK.decode(ids) == plain.decode("utf-8", errors="replace")


def test_invalid_utf8_is_replaced():
    assert TOK.decode([256, 0x68, 0xFF, 0x69, 257, 258]) == "h\ufffdi"
    assert TOK.decode(TOK.encode(b"\xe2\x9c")) == "\ufffd"


def test_errors():
    with pytest.raises(ValueError, match="outside"):
        TOK.decode([259])
    with pytest.raises(ValueError, match="outside"):
        TOK.decode_bytes([-1])
    with pytest.raises(TypeError):
        TOK.encode(123)
