"""The engine's incremental text (`pagedjax.engine.output_processor`): any token sequence, fed a token at a time and
read at any points, shows only valid UTF-8 text that is never taken back, ending as the full decode (or the text cut
at the first stop string, found at the token whose text completes it); for the byte tokenizer and for a small
byte-level BPE trained here with `tokenizers`."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from pagedjax.engine.output_processor import IncrementalText, SequenceText, stop_prefix_len
from pagedjax.model.tokenizer import ByteTokenizer

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
    """Feed `ids` a token at a time as the engine does, reading the shown text after the tokens at `cuts`
    (sizes of the steps between reads); returns the text's growth at each read and the final text. Checks the
    stop against the reference: the first token m whose whole decode `ids[:m]` holds a stop string."""
    end, final = len(ids), tokenizer.decode(ids)
    for m in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:m])
        hits = [(text.find(s), s) for s in stop if s in text]
        if hits:
            end, final = m, text[:min(hits)[0]]
            break
    seq = SequenceText(tokenizer, stop)
    reads, shown, hit, at = set(), [], None, 0
    for c in cuts:
        at += c
        reads.add(at)
    for m, token in enumerate(ids, 1):
        hit = seq.add(token)
        if hit is not None:
            assert m == end, (m, end)
            break
        if m in reads:
            shown.append(seq.safe_text())
    text = seq.decoded.text
    engine_final = text[:text.find(hit[1])] if hit is not None else text + seq.decoded.pending()
    assert engine_final == final
    deltas, sent = [], ""
    for t in [*shown, engine_final]:
        assert t.startswith(sent)  # nothing shown is ever taken back
        deltas.append(t[len(sent):])
        sent = t
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
    text = IncrementalText(BYTE)
    euro = list("€".encode())  # 3 bytes, 3 tokens
    assert [text.append(t) for t in [0x61, *euro]] == ["a", "", "", "€"]
    assert text.text == "a€" and text.pending() == ""


def test_invalid_bytes_followed_by_text_are_shown_as_replacement_characters():
    text = IncrementalText(BYTE)
    assert text.append(0xFF) == ""  # could still be an incomplete character, as far as it knows
    assert text.append(0x62) == "\ufffdb"
    assert text.append(0xC3) == "" and text.pending() == "\ufffd"  # a truncated character at the end


def test_decoding_cost_does_not_grow_with_the_output():
    """Each token decodes a window of a few tokens, never the whole output."""
    decoded = []

    class Counting:
        def decode(self, ids):
            decoded.append(len(ids))
            return BYTE.decode(ids)

    text = IncrementalText(Counting())
    for t in BYTE.encode("abcé" * 300, add_bos=False):
        text.append(t)
    assert text.text == "abcé" * 300
    assert max(decoded) <= 4


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


def test_a_stop_prefix_is_held_back_and_a_complete_stop_string_ends_the_text():
    seq = SequenceText(BYTE, ("STOP",))
    assert [seq.add(t) for t in BYTE.encode("abcSTO", add_bos=False)] == [None] * 6
    assert seq.safe_text() == "abc"
    assert seq.add(ord("P")) == (3, "STOP")


def test_stop_prefix_len():
    assert stop_prefix_len("hello wor", ("world",)) == 3
    assert stop_prefix_len("hello", ("world",)) == 0
    assert stop_prefix_len("abab", ("abc", "bab")) == 2  # "ab" starts "abc"; "bab" is complete, not a prefix
    assert stop_prefix_len("xa", ("a",)) == 0  # a one-character stop has no proper prefix
    assert stop_prefix_len("", ("ab",)) == 0
    assert stop_prefix_len("x" * 10_000 + "wo", ("w" + "x" * 5000,)) == 0
    assert stop_prefix_len("aXaXa", ("aXaXaY",)) == 5
