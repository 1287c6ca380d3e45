"""Broken model folders and config values: a typed error whose message is one line naming the file and the
field (library), and `pagedjax-generate: error: ...` with exit status 2 and no traceback (CLI).

Covers pagedjax checkpoints (orbax) and Hugging Face folders (safetensors, written with numpy: no torch).
"""

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from pagedjax import cli
from pagedjax.config import CacheConfig, ModelConfig
from pagedjax.config.model import ROPE_TYPES
from pagedjax.model.llama import abstract_model, init_model
from pagedjax.model.loading import hf_loader
from pagedjax.model.loading.checkpoint import CONFIG_FILE, PARAMS_DIR, save_checkpoint
from pagedjax.model.loading.loader import ModelLoadError, load_pretrained

TINY = ModelConfig(vocab_size=259, hidden_size=32, num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=16,
                   intermediate_size=64, bos_token_id=256, eos_token_ids=(257,))
HF_CONFIG = {"model_type": "llama", "vocab_size": 40, "hidden_size": 16, "num_hidden_layers": 1,
             "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 32, "hidden_act": "silu",
             "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 64, "eos_token_id": 2,
             "bos_token_id": 1, "tie_word_embeddings": False, "torch_dtype": "float32"}


def _one_line(e: BaseException, *names: str) -> str:
    msg = str(e)
    assert "\n" not in msg and len(msg) < 800, msg
    for name in names:
        assert name in msg, f"{name!r} not named in: {msg}"
    return msg


def _cli_error(capsys, folder: Path, *names: str) -> str:
    assert cli.main(["--model", str(folder), "--num-blocks", "8", "--max-tokens", "2"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pagedjax-generate: error: "), captured.err
    assert "usage:" not in captured.err and "Traceback" not in captured.err and captured.out == ""
    for name in names:
        assert name in lines[0], lines[0]
    return lines[0]


# ------------------------------------------------------------------------------------------------ ModelConfig
@pytest.mark.parametrize("field, value, error", [
    ("hidden_size", "256", TypeError),
    ("hidden_size", None, TypeError),
    ("hidden_size", 2.0, TypeError),
    ("hidden_size", True, TypeError),
    ("num_layers", 0, ValueError),
    ("rope_theta", "1e4", TypeError),
    ("rope_theta", True, TypeError),
    ("rope_theta", float("nan"), ValueError),
    ("rms_norm_eps", None, TypeError),
    ("tie_word_embeddings", 1, TypeError),
    ("qkv_bias", "false", TypeError),
    ("dtype", 32, TypeError),
    ("dtype", "int8", ValueError),
    ("bos_token_id", "1", TypeError),
    ("eos_token_ids", "2", TypeError),
    ("eos_token_ids", (2, 3.0), TypeError),
    ("eos_token_ids", 2, TypeError),
    ("rope_scaling", "llama3", TypeError),
    ("rope_scaling", {"rope_type": "yarn", "factor": 2.0}, ValueError),
    ("rope_scaling", {"rope_type": "linear"}, ValueError),
    ("rope_scaling", {"rope_type": "linear", "factor": "2"}, TypeError),
])
def test_model_config_checks_types_naming_the_field(field, value, error):
    with pytest.raises(error) as e:
        ModelConfig(**{field: value})
    _one_line(e.value, f"ModelConfig.{field}")
    with pytest.raises(error, match=field):
        ModelConfig.from_dict({**TINY.to_dict(), field: value})


def test_model_config_normalises_what_it_accepts():
    cfg = ModelConfig(rope_theta=500000, rms_norm_eps=0, eos_token_ids=[3, 4], hidden_size=np.int64(256),
                      rope_scaling={"rope_type": "linear", "factor": 2})
    assert isinstance(cfg.rope_theta, float) and isinstance(cfg.rms_norm_eps, float)
    assert cfg.eos_token_ids == (3, 4) and type(cfg.hidden_size) is int
    assert cfg.rope_scaling == (("factor", 2), ("rope_type", "linear"))
    hash(cfg)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(TypeError, match="mapping"):
        ModelConfig.from_dict([1, 2])
    with pytest.raises(ValueError, match=", ".join(ROPE_TYPES)):
        ModelConfig(rope_scaling={"type": "dynamic", "factor": 2.0})


@pytest.mark.parametrize("kwargs, field, error", [
    ({"block_size": "16"}, "block_size", TypeError),
    ({"num_blocks": 8.0}, "num_blocks", TypeError),
    ({"kv_memory_bytes": True}, "kv_memory_bytes", TypeError),
    ({"enable_prefix_caching": 1}, "enable_prefix_caching", TypeError),
    ({"kv_dtype": "int4"}, "kv_dtype", ValueError),
])
def test_cache_config_checks_types(kwargs, field, error):
    with pytest.raises(error, match=f"CacheConfig.{field}"):
        CacheConfig(**kwargs)


def test_cache_config_pool_bytes():
    cache = CacheConfig(block_size=16, num_blocks=10)
    assert cache.block_bytes(TINY) == 2 * 1 * 16 * 1 * 16 * 4
    assert cache.pool_bytes(TINY) == 10 * cache.block_bytes(TINY)


# ---------------------------------------------------------------------------------------- pagedjax checkpoint
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", TINY, init_model(TINY, 0))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_model_config(folder: Path, **changes) -> None:
    meta = json.loads((folder / CONFIG_FILE).read_text())
    meta["model_config"].update(changes)
    (folder / CONFIG_FILE).write_text(json.dumps(meta))


def test_checkpoint_loads(checkpoint):
    cfg, _, tokenizer = load_pretrained(checkpoint)
    assert cfg == TINY and tokenizer is not None


@pytest.mark.parametrize("value", ["256", None, 2.0, True])
def test_checkpoint_config_value_of_the_wrong_type(checkpoint, tmp_path, capsys, value):
    folder = _copy(checkpoint, tmp_path / "bad")
    _edit_model_config(folder, hidden_size=value)
    with pytest.raises(ModelLoadError) as e:
        load_pretrained(folder)
    _one_line(e.value, str(folder / CONFIG_FILE), "hidden_size")
    _cli_error(capsys, folder, CONFIG_FILE, "hidden_size")


def test_checkpoint_config_invalid_json(checkpoint, tmp_path, capsys):
    folder = _copy(checkpoint, tmp_path / "bad")
    text = (folder / CONFIG_FILE).read_text()
    (folder / CONFIG_FILE).write_text(text[: len(text) // 2])
    with pytest.raises(ModelLoadError) as e:
        load_pretrained(folder)
    msg = _one_line(e.value, str(folder / CONFIG_FILE), "invalid JSON")
    assert "neither" not in msg
    _cli_error(capsys, folder, CONFIG_FILE, "invalid JSON")


# orbax abandons the other reads of a failed restore; collected later, they used to print tracebacks.
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", ["truncate", "empty", "garble", "delete"])
def test_checkpoint_params_truncated_or_corrupted(checkpoint, tmp_path, capsys, damage):
    folder = _copy(checkpoint, tmp_path / "bad")
    # The biggest data file of the orbax (OCDBT) folder holds arrays.
    data_file = max((f for f in (folder / PARAMS_DIR).rglob("*") if f.is_file() and f.parent.name == "d"),
                    key=lambda f: f.stat().st_size)
    data = data_file.read_bytes()
    if damage == "truncate":
        data_file.write_bytes(data[: len(data) // 2])
    elif damage == "empty":
        data_file.write_bytes(b"")
    elif damage == "garble":
        data_file.write_bytes(bytes(b ^ 0x5A for b in data))
    else:
        data_file.unlink()
    with pytest.raises(ModelLoadError) as e:
        load_pretrained(folder)
    _one_line(e.value, str(folder / PARAMS_DIR), "truncated or corrupted")
    _cli_error(capsys, folder, PARAMS_DIR, "cannot read the parameters")


def test_not_a_model_folder(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ModelLoadError, match="neither a pagedjax checkpoint"):
        load_pretrained(tmp_path)
    _cli_error(capsys, tmp_path, str(tmp_path), "neither")


# ------------------------------------------------------------------------------------------ Hugging Face folder
def _write_hf(folder: Path, config: dict) -> Path:
    """A Llama folder transformers could load: config.json + model.safetensors with random weights."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    cfg = hf_loader.load_hf_config(folder)
    rng = np.random.default_rng(0)
    tensors = {}
    for path, var in nnx.to_flat_state(nnx.state(abstract_model(cfg), nnx.Param)):
        name, transpose = hf_loader._hf_name(path)
        shape = tuple(var.get_value().shape)
        tensors[name] = rng.standard_normal(shape[::-1] if transpose else shape).astype(np.float32)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    return _write_hf(tmp_path_factory.mktemp("hf") / "llama", HF_CONFIG)


def test_hf_folder_loads_without_printing(hf_folder, capfd, caplog):
    with caplog.at_level(logging.INFO, logger="pagedjax.model.loading.hf_loader"):
        cfg, _, tokenizer = load_pretrained(hf_folder)
    assert cfg.hidden_size == 16 and tokenizer is None
    captured = capfd.readouterr()
    assert captured.out == "" and "loaded" not in captured.err  # it used to print to stderr
    assert any("loaded" in r.getMessage() and "safetensors" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("field, value", [
    ("hidden_size", "256"),
    ("hidden_size", None),
    ("hidden_size", 2.0),
    ("hidden_size", True),
    ("rms_norm_eps", "1e-5"),
    ("rope_theta", [10000]),
    ("tie_word_embeddings", "false"),
    ("mlp_bias", "no"),
    ("rope_scaling", "linear"),
    ("rope_scaling", {"rope_type": ["linear"], "factor": 2.0}),
    ("rope_scaling", {"rope_type": "linear", "factor": "2"}),
    ("eos_token_id", "2"),
    ("bos_token_id", 1.5),
    ("max_position_embeddings", 64.0),
])
def test_hf_config_value_of_the_wrong_type(hf_folder, tmp_path, capsys, field, value):
    folder = _copy(hf_folder, tmp_path / "bad")
    (folder / "config.json").write_text(json.dumps({**HF_CONFIG, field: value}))
    with pytest.raises(ModelLoadError) as e:
        load_pretrained(folder)
    _one_line(e.value, str(folder / "config.json"), field)
    _cli_error(capsys, folder, "config.json", field)


@pytest.mark.parametrize("file", ["config.json", "generation_config.json"])
def test_hf_config_invalid_json(hf_folder, tmp_path, capsys, file):
    folder = _copy(hf_folder, tmp_path / "bad")
    (folder / file).write_text('{"model_type": "llama", ')
    with pytest.raises(ModelLoadError) as e:
        load_pretrained(folder)
    assert "neither" not in _one_line(e.value, str(folder / file), "invalid JSON")
    _cli_error(capsys, folder, file, "invalid JSON")


@pytest.mark.parametrize("damage", ["truncate", "empty", "header"])
def test_hf_safetensors_truncated_or_corrupted(hf_folder, tmp_path, capsys, damage):
    folder = _copy(hf_folder, tmp_path / "bad")
    file = folder / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes({"truncate": data[:-100], "empty": b"", "header": data[:8] + b"}" + data[9:]}[damage])
    with pytest.raises(ModelLoadError) as e:
        load_pretrained(folder)
    _one_line(e.value, str(file), "safetensors")
    _cli_error(capsys, folder, "model.safetensors")


def test_hf_tokenizer_json_invalid(hf_folder, tmp_path, capsys):
    pytest.importorskip("tokenizers")
    folder = _copy(hf_folder, tmp_path / "bad")
    (folder / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError) as e:
        load_pretrained(folder)
    _one_line(e.value, str(folder / "tokenizer.json"))
    _cli_error(capsys, folder, "tokenizer.json")


def test_unsupported_rope_type_lists_the_supported_ones(hf_folder, tmp_path):
    folder = _copy(hf_folder, tmp_path / "bad")
    (folder / "config.json").write_text(json.dumps({**HF_CONFIG, "rope_scaling": {"rope_type": "dynamic",
                                                                                  "factor": 2.0}}))
    with pytest.raises(ModelLoadError, match=f"supported: {', '.join(ROPE_TYPES)}"):
        load_pretrained(folder)
    # YaRN is one of them for gpt-oss only (its family module reads YaRN's optional parameters).
    (folder / "config.json").write_text(json.dumps({**HF_CONFIG, "rope_scaling": {"rope_type": "yarn",
                                                                                  "factor": 2.0}}))
    with pytest.raises(ModelLoadError, match="rope type 'yarn' is supported for gpt_oss only"):
        load_pretrained(folder)
