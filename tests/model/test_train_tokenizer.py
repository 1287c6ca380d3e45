"""scripts/train_tiny.py's tokens: the byte-level BPE it trains (exact round trips, byte counts, BOS first) and
bits per byte, checked against a numpy computation from the dense logits."""

from functools import cache
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pagedjax.config import ModelConfig
from pagedjax.model.hf_tokenizer import HFTokenizer
from pagedjax.model.llama import init_model
from pagedjax.model.loading.checkpoint import save_checkpoint
from tests.scripts_module import load_script

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [
    b'"""A module."""\n\nimport os\n\n\ndef join(a, b):\n    return os.path.join(a, b)\n',
    b"class Box:\n    def __init__(self, value):\n        self.value = value\n\n    def get(self):\n"
    b"        return self.value\n",
    "# caf\u00e9, na\u00efve, \u2603\nNAMES = ['\u043a\u043b\u044e\u0447', 'x']\n".encode(),
] * 3


train_tiny = load_script("train_tiny")


@cache
def bpe():
    """A small vocabulary trained on SOURCES (cached: hypothesis calls the tests many times)."""
    return train_tiny.bpe_corpus_tokenizer(train_tiny.train_bpe(SOURCES, 320))


def test_bpe_layout_and_bos():
    tok = bpe()
    assert (tok.bos_token_id, tok.eos_token_id, tok.hf.token_to_id(train_tiny.PAD)) == (0, 1, 2)
    assert 259 < tok.vocab_size <= 320
    assert list(tok.token_bytes[:3]) == [0, 0, 0] and (tok.token_bytes[3:] >= 1).all()
    wrapped = HFTokenizer(tok.hf, eos_token_ids=(tok.eos_token_id,), bos_token_id=tok.bos_token_id)
    text = "def join(a, b):\n"
    ids = wrapped.encode(text)
    assert ids[0] == tok.bos_token_id and len(ids) < len(text)  # BOS, then merged tokens
    # Newlines are tokens of their own: a prompt ending in "\n" ends where training text has a token boundary.
    assert ids[-1] == tok.hf.token_to_id("\u010a")  # "\n" in the byte-level alphabet
    assert wrapped.encode(b"def") == wrapped.encode("def")
    with pytest.raises(ValueError, match="not UTF-8"):
        wrapped.encode(b"caf\xe9")
    with pytest.raises(TypeError, match="str or bytes"):
        wrapped.encode(3)


@settings(max_examples=60)
@given(st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=80))
@example("    return self.value\n\n\n")
@example("\r\n\t \u00a0\u2028x")
@example("\x00\ufffd\U0001f600")
def test_bpe_round_trips_any_text_and_counts_its_bytes(text):
    tok = bpe()
    ids = tok.hf.encode(text, add_special_tokens=False).ids
    assert tok.hf.decode(ids) == text
    assert tok.num_bytes(np.asarray(ids)) == len(text.encode("utf-8"))
    # A file: BOS + text + EOS, and the specials count no bytes.
    file_ids = tok.encode_files([text.encode("utf-8")])
    assert list(file_ids) == [tok.bos_token_id, *ids, tok.eos_token_id]
    assert tok.num_bytes(file_ids) == len(text.encode("utf-8"))


def test_byte_tokenizer_counts_one_byte_per_token():
    tok = train_tiny.byte_corpus_tokenizer()
    ids = tok.encode_files([b"ab\xff", b"c"])
    assert list(ids) == [256, 97, 98, 255, 257, 256, 99, 257]
    assert tok.num_bytes(ids) == 4 and tok.vocab_size == 259


@pytest.mark.parametrize("num_tokens, seq_len", [(50, 16), (49, 16), (17, 16), (5, 16)])
def test_tiling_windows_target_every_token_once(num_tokens, seq_len):
    tokens = np.arange(num_tokens, dtype=np.uint16) + 3
    windows = train_tiny.tiling_windows(tokens, seq_len)
    mask = train_tiny.tiling_target_mask(num_tokens, seq_len)
    assert windows.shape == (len(mask), seq_len + 1) and mask.shape == (len(windows), seq_len)
    np.testing.assert_array_equal(windows[:, 1:][mask], tokens[1:])
    np.testing.assert_array_equal(windows[1:, 0], windows[:-1, -1])  # each window continues the last one


def test_bits_per_byte_matches_numpy():
    """Total bits over text targets / their bytes, from the dense logits of each window in float64."""
    tok = bpe()
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, num_layers=1, num_q_heads=2, num_kv_heads=1,
                      head_dim=16, intermediate_size=64)
    model = init_model(cfg, 3)
    tokens = tok.encode_files(SOURCES[:3])
    seq_len = 24
    windows = train_tiny.tiling_windows(tokens, seq_len)
    mask = train_tiny.tiling_target_mask(len(tokens), seq_len)
    got = train_tiny.evaluate_bpb(model, windows, tok.token_bytes, batch_size=4, mask=mask)

    graphdef, weights = nnx.split(model)
    dense = jax.jit(lambda w, ids: nnx.merge(graphdef, w).forward_dense(ids))
    bits = nbytes = 0.0
    for window, m in zip(windows, mask, strict=True):
        logits = np.asarray(dense(weights, jnp.asarray(window[None, :-1])), np.float64)[0]
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        for pos, target in enumerate(window[1:]):
            if m[pos] and tok.token_bytes[target] > 0:
                bits -= logp[pos, target] / np.log(2)
                nbytes += tok.token_bytes[target]
    assert nbytes == sum(len(s) for s in SOURCES[:3])
    np.testing.assert_allclose(got, bits / nbytes, rtol=1e-5)
    assert got == pytest.approx(train_tiny.heldout_bpb_of_split(model, tokens, tok.token_bytes, seq_len,
                                                                batch_size=4), rel=1e-6)


def test_bad_vocab_size_and_a_model_without_tokenizer_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train_tiny.parse_args(["--vocab-size", "100"])
    assert "--vocab-size must be in [259, 65535]" in capsys.readouterr().err
    assert train_tiny.parse_args(["--tokenizer", "byte", "--vocab-size", "100"]).tokenizer == "byte"  # ignored
    cfg = ModelConfig(vocab_size=300, hidden_size=32, num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=16,
                      intermediate_size=32)
    folder = save_checkpoint(tmp_path / "model", cfg, init_model(cfg, 0))  # no tokenizer.json, not 259 tokens
    with pytest.raises(SystemExit, match="has no tokenizer"):
        train_tiny.main(["--evaluate", str(folder)])
