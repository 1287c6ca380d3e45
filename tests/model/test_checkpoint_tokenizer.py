"""Which tokenizer a pagedjax checkpoint folder loads with: its tokenizer.json, else the byte tokenizer for a
byte-vocabulary model, else none; a tokenizer.json that is broken or does not fit the model is a one-line
ModelLoadError naming it."""

import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pagedjax.cli import main as cli_main
from pagedjax.config import ModelConfig
from pagedjax.model.hf_tokenizer import HFTokenizer
from pagedjax.model.llama import init_model
from pagedjax.model.loading.checkpoint import TOKENIZER_FILE, load_checkpoint_tokenizer, save_checkpoint
from pagedjax.model.loading.loader import ModelLoadError, load_pretrained
from pagedjax.model.tokenizer import ByteTokenizer

SHAPE = dict(hidden_size=32, num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=32)


def _bpe(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def f(x):\n    return x + 1\n"] * 4, trainer)
    return tok


@pytest.fixture(scope="module")
def bpe_folder(tmp_path_factory) -> Path:
    tok = _bpe(270)
    cfg = ModelConfig(vocab_size=tok.get_vocab_size(), bos_token_id=0, eos_token_ids=(1,), **SHAPE)
    folder = save_checkpoint(tmp_path_factory.mktemp("bpe") / "model", cfg, init_model(cfg, 0))
    tok.save(str(folder / TOKENIZER_FILE))
    return folder


def test_tokenizer_json_is_loaded_with_the_models_special_ids(bpe_folder):
    cfg, _, tok = load_pretrained(bpe_folder)
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == cfg.vocab_size
    assert tok.eos_token_ids == cfg.eos_token_ids == (1,) and tok.bos_token_id == 0
    assert tok.decode(tok.encode("def f(x):")) == "def f(x):"


def test_without_tokenizer_json_only_a_byte_vocabulary_has_a_tokenizer(tmp_path):
    byte_cfg = ModelConfig(vocab_size=ByteTokenizer.vocab_size, **SHAPE)
    assert isinstance(load_checkpoint_tokenizer(tmp_path, byte_cfg), ByteTokenizer)
    assert load_checkpoint_tokenizer(tmp_path, byte_cfg.replace(vocab_size=300)) is None


def test_a_vocabulary_bigger_than_the_model_is_refused(bpe_folder, tmp_path, capsys):
    folder = Path(shutil.copytree(bpe_folder, tmp_path / "model"))
    _bpe(290).save(str(folder / TOKENIZER_FILE))
    bigger = r"vocabulary of 27[1-9] tokens does not fit the model's vocab_size 270"
    with pytest.raises(ModelLoadError, match=bigger) as e:
        load_pretrained(folder)
    assert str(folder / TOKENIZER_FILE) in str(e.value) and "\n" not in str(e.value)
    assert cli_main(["--model", str(folder), "--prompt", "x", "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "tokenizer.json" in err and "vocab_size 270" in err


def test_an_unreadable_tokenizer_json_is_named(bpe_folder, tmp_path):
    folder = Path(shutil.copytree(bpe_folder, tmp_path / "model"))
    (folder / TOKENIZER_FILE).write_text('{"model": 3}')
    with pytest.raises(ModelLoadError, match="not a valid tokenizer file") as e:
        load_pretrained(folder)
    assert str(folder / TOKENIZER_FILE) in str(e.value) and "\n" not in str(e.value)
