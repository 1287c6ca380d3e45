"""Incremental detokenization: any token sequence, fed in any growing snapshots, streams as valid UTF-8 deltas
whose concatenation is the full decode (or the text cut at a stop string); for the byte tokenizer and for a small
byte-level BPE trained here with `tokenizers`."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from pagedjax.model.tokenizer import ByteTokenizer
from pagedjax.serve.detokenizer import IncrementalDetokenizer, stop_prefix_len

BYTE = ByteTokenizer()
CORPUS = ["héllo wörld, naïve café", "日本語のテキストと中文文本", "emoji 🙂🚀👩‍💻 and ✓ marks",
          "def f(x):\n    return x", "Ελληνικά και русский текст", "a\u0301 combining, \u200b zero width"] * 20


@pytest.fixture(scope="module")
def bpe():
    tokenizers = pytest.importorskip("tokenizers")
    from pagedjax.model.hf_tokenizer import HFTokenizer

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=420, special_tokens=["<s>", "</s>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return HFTokenizer(tok, eos_token_ids=(tok.token_to_id("</s>"),))


def _stream(tokenizer, ids: list[int], cuts: list[int], stop: tuple[str, ...] = ()) -> tuple[list[str], str]:
    """Feed growing prefixes of `ids` (snapshot sizes from `cuts`) as the server does; returns the deltas and
    the final text, cut as the engine cuts it at the first token whose text holds a stop string."""
    end = len(ids)
    final = tokenizer.decode(ids)
    for m in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:m])
        hits = [(text.find(s), s) for s in stop if s in text]
        if hits:
            end, final = m, text[:min(hits)[0]]
            break
    detok = IncrementalDetokenizer(tokenizer, stop=stop)
    deltas, pos = [], 0
    for cut in cuts:
        pos = min(pos + cut, end - 1)  # the snapshots the server sees before the finished one
        if pos <= 0:
            continue
        deltas.append(detok.update(ids[:pos]))
    deltas.append(detok.update(ids[:end]))  # the finished snapshot (stop string included, if one was hit)
    deltas.append(detok.finish(final))
    return deltas, final


def _check(deltas: list[str], final: str) -> None:
    sent = ""
    for d in deltas:
        assert isinstance(d, str)
        d.encode("utf-8")  # valid UTF-8: no lone surrogates
        sent += d
        assert final.startswith(sent)  # nothing sent is ever taken back
    assert sent == final


byte_ids = st.lists(st.integers(0, BYTE.vocab_size - 1), max_size=48)
utf8_heavy = st.text(max_size=16).map(lambda t: BYTE.encode(t, add_bos=False))
cuts = st.lists(st.integers(1, 5), max_size=48)


@given(ids=st.one_of(byte_ids, utf8_heavy), cuts=cuts)
@example(ids=list("é€🙂".encode()), cuts=[1] * 9)
@example(ids=[0xE2, 0x82, 0x41, 0xFF, 0xF0, 0x9F], cuts=[1] * 6)
def test_byte_tokenizer_streams_valid_utf8_that_concatenates_to_the_decode(ids, cuts):
    deltas, final = _stream(BYTE, ids, cuts)
    _check(deltas, final)


def test_split_character_is_held_back():
    detok = IncrementalDetokenizer(BYTE)
    euro = list("€".encode())  # 3 bytes, 3 tokens
    assert detok.update([0x61, euro[0]]) == "a"
    assert detok.update([0x61, *euro[:2]]) == ""
    assert detok.update([0x61, *euro]) == "€"
    assert detok.finish("a€") == ""


def test_invalid_bytes_followed_by_text_are_sent_as_replacement_characters():
    detok = IncrementalDetokenizer(BYTE)
    assert detok.update([0xFF]) == ""  # could still be an incomplete character, as far as it knows
    assert detok.update([0xFF, 0x62]) == "\ufffdb"
    assert detok.finish(BYTE.decode([0xFF, 0x62, 0xC3])) == "\ufffd"  # a truncated character at the end


@given(data=st.data(), cuts=cuts)
def test_bpe_streams_valid_utf8_that_concatenates_to_the_decode(bpe, data, cuts):
    ids = data.draw(st.one_of(st.lists(st.integers(0, bpe.vocab_size - 1), max_size=40),
                              st.sampled_from(CORPUS[:6]).map(bpe.encode)))
    deltas, final = _stream(bpe, ids, cuts)
    _check(deltas, final)


def test_bpe_splits_characters_across_tokens(bpe):
    """The property above is not vacuous: some BPE tokens hold part of a character."""
    ids = bpe.encode("🙂🚀👩‍💻")
    assert any("\ufffd" in bpe.decode(ids[:m]) for m in range(1, len(ids)))


@given(data=st.data(), cuts=cuts)
def test_stop_strings_are_never_sent(data, cuts):
    text = data.draw(st.text(alphabet="abc\n é", min_size=1, max_size=30))
    ids = BYTE.encode(text, add_bos=False)
    start = data.draw(st.integers(0, len(text) - 1))
    stop = (text[start:start + data.draw(st.integers(1, 3))], data.draw(st.sampled_from(["zz", "c\n", "é"])))
    deltas, final = _stream(BYTE, ids, cuts, stop=stop)
    _check(deltas, final)
    assert not any(s in final for s in stop)


@given(data=st.data(), cuts=cuts)
def test_bpe_stop_strings(bpe, data, cuts):
    text = data.draw(st.sampled_from(CORPUS[:6]))
    start = data.draw(st.integers(0, len(text) - 1))
    stop = (text[start:start + data.draw(st.integers(1, 4))],)
    deltas, final = _stream(bpe, bpe.encode(text), cuts, stop=stop)
    _check(deltas, final)


def test_complete_stop_string_is_held_back():
    detok = IncrementalDetokenizer(BYTE, stop=("STOP",))
    assert detok.update(BYTE.encode("abcSTO", add_bos=False)) == "abc"
    assert detok.update(BYTE.encode("abcSTOPxyz", add_bos=False)) == ""
    assert detok.finish("abc") == ""


def test_stop_prefix_len():
    assert stop_prefix_len("hello wor", ("world",)) == 3
    assert stop_prefix_len("hello", ("world",)) == 0
    assert stop_prefix_len("abab", ("abc", "bab")) == 2  # "ab" starts "abc"; "bab" is complete, not a prefix
    assert stop_prefix_len("xa", ("a",)) == 0  # a one-character stop has no proper prefix
    assert stop_prefix_len("", ("ab",)) == 0
