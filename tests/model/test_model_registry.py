"""`pagedjax.ModelRegistry`: a Hugging Face folder of a `model_type` pagedjax has no model for (GPT-2) served by
the bring-your-own-model example, which registers itself, through `from_pretrained`, `load_engine` and the CLI's
`--model DIR`; what a factory must return; entry points."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from pagedjax import CacheConfig, LLMEngine, ModelRegistry, SamplingParams, SchedulerConfig, load_engine
from pagedjax.model.hf_tokenizer import HFTokenizer
from pagedjax.model.loading.checkpoint import bundled_model_path
from tests.model import gpt2_example
from tests.model.gpt2_example import GPT2, GPT2Config

CFG = GPT2Config(vocab_size=2048, n_positions=64, n_embd=32, n_layer=2, n_head=4, eos_token_id=1)
ENGINE = dict(cache_config=CacheConfig(block_size=8, num_blocks=32),
              scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64))
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A Hugging Face GPT-2 folder as `save_pretrained` writes one (config.json, model.safetensors), written
    without transformers, with the bundled model's tokenizer.json (its vocabulary of 2048)."""
    from safetensors.numpy import save_file

    path = tmp_path_factory.mktemp("gpt2")
    model = GPT2(CFG, rngs=nnx.Rngs(3))
    hf_leaf = {"kernel": "weight", "scale": "weight", "embedding": "weight", "bias": "bias"}
    tensors = {"transformer." + ".".join(map(str, p[:-1])) + "." + hf_leaf[p[-1]]: np.asarray(v[...], np.float32)
               for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    save_file(tensors, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(dict(
        model_type="gpt2", vocab_size=CFG.vocab_size, n_positions=CFG.n_positions, n_embd=CFG.n_embd,
        n_layer=CFG.n_layer, n_head=CFG.n_head, layer_norm_epsilon=CFG.layer_norm_epsilon, eos_token_id=1)))
    shutil.copy(bundled_model_path() / "tokenizer.json", path / "tokenizer.json")
    return path, model


@pytest.fixture(autouse=True)
def example_registered(monkeypatch):
    """The example's factory for gpt2, whatever ran before (docs/models.md's copy of the example, which
    tests/test_readme.py runs, registers its own); the registry as it was after the test."""
    monkeypatch.setattr(ModelRegistry, "_factories",
                        {**ModelRegistry.model_factories(), "gpt2": gpt2_example.from_hf_folder})


def test_the_example_registers_itself_for_gpt2(monkeypatch):
    import runpy

    monkeypatch.setattr(ModelRegistry, "_factories", {})
    example = runpy.run_path(gpt2_example.__file__)  # a fresh import of the example, into an empty registry
    assert ModelRegistry.model_types() == ("gpt2",) and ModelRegistry.factory_for("gpt2") is example["from_hf_folder"]


def test_from_pretrained_serves_a_registered_model_type(folder):
    """Was: "field 'model_type' = 'gpt2' is not supported" (a user's model loaded only by hand)."""
    path, model = folder
    engine = LLMEngine.from_pretrained(str(path), **ENGINE)
    assert isinstance(engine.tokenizer, HFTokenizer)  # None from the factory: the folder's tokenizer.json
    want = LLMEngine(model=model, tokenizer=engine.tokenizer, **ENGINE).generate("def f(x):", GREEDY, use_tqdm=False)
    got = engine.generate("def f(x):", GREEDY, use_tqdm=False)
    assert got[0].output_token_ids == want[0].output_token_ids
    assert load_engine(path, **ENGINE).generate("def f(x):", GREEDY, use_tqdm=False)[0].output_token_ids == \
        want[0].output_token_ids
    with pytest.raises(ValueError, match="this GPT-2 computes in float32, not bfloat16"):
        LLMEngine.from_pretrained(path, dtype="bfloat16", **ENGINE)  # the dtype reaches the factory


def test_quantization_applies_to_a_registered_model(folder):
    from pagedjax.model.api import QuantizedLinear

    path, _ = folder
    engine = LLMEngine.from_pretrained(path, quantization="int8", **ENGINE)
    model = nnx.merge(engine.runner.graphdef, engine.runner.params)
    assert isinstance(model, GPT2) and isinstance(model.h[0].attn.c_attn, QuantizedLinear)


def test_the_cli_model_flag_consults_the_registry(folder):
    from pagedjax.cli.engine_setup import load_model_for_cli
    from pagedjax.cli.errors import CLIError
    from pagedjax.serve.cli import build_parser

    path, _ = folder
    loaded = load_model_for_cli(build_parser().parse_args(["--model", str(path)]))
    assert isinstance(loaded.model, GPT2) and loaded.model_config is None and loaded.spec.num_layers == 2
    assert isinstance(loaded.tokenizer, HFTokenizer)
    with pytest.raises(CLIError, match=f"--model {path}: its registered factory raised ValueError: this GPT-2 "
                                       "computes in float32, not bfloat16"):
        load_model_for_cli(build_parser().parse_args(["--model", str(path), "--dtype", "bfloat16"]))


def test_the_cli_model_class_takes_the_model_folders_tokenizer(folder, monkeypatch):
    """`--model-class tests.model.gpt2_example:load --model DIR`: the factory returns the model alone, so the
    folder's tokenizer.json is the tokenizer, as for a registered factory. Was: "gave no tokenizer"."""
    from pagedjax.cli.args import build_parser
    from pagedjax.cli.engine_setup import load_model_for_cli

    path, _ = folder
    monkeypatch.chdir(ROOT)  # where the README runs it: the example imports from the clone's root
    args = ["--model-class", "tests.model.gpt2_example:load", "--model", str(path)]
    loaded = load_model_for_cli(build_parser().parse_args(args))
    assert isinstance(loaded.model, GPT2) and isinstance(loaded.tokenizer, HFTokenizer)
    assert loaded.tokenizer.encode("def f(x):") == HFTokenizer.from_pretrained(path).encode("def f(x):")
    assert loaded.tokenizer.eos_token_ids == (CFG.eos_token_id,)


def test_an_unregistered_model_type_names_the_registry(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "fc_unknown_arch"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"ModelRegistry.register_model\('fc_unknown_arch', factory\)"):
        LLMEngine.from_pretrained(tmp_path, **ENGINE)


def test_the_refusal_lists_exactly_the_model_types_that_load(tmp_path):
    """An unknown model_type's refusal lists what `from_pretrained` loads. Was: the ModelConfig families only,
    while DeepSeek, LLaVA and Gemma 3 folders (and registered types) load too. Checked against the loader itself:
    of every model_type transformers knows, and those listed, a config.json of nothing but its model_type is
    refused by that field exactly when the list leaves it out (a listed one fails later, on a missing field)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    (tmp_path / "model.safetensors").write_bytes(b"")

    def error(model_type: str) -> str:
        (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
        with pytest.raises(Exception) as e:  # noqa: PT011 - any error: which field it names is the point
            LLMEngine.from_pretrained(tmp_path, **ENGINE)
        return str(e.value)

    message = error("fc_unknown_arch")
    groups = message.partition(" load ")[2].partition("; a model")[0].split("; ")  # "[label ]type, type, ..."
    listed = {item.split()[-1] for group in groups for item in group.split(", ")}
    assert {"llama", "qwen3_moe", "deepseek_v32", "llava", "gemma3", "gpt2"} <= listed, message
    refused = {t for t in listed | set(CONFIG_MAPPING_NAMES) if f"field 'model_type' = {t!r}" in error(t)}
    assert refused.isdisjoint(listed), refused & listed
    assert refused == set(CONFIG_MAPPING_NAMES) - listed


def test_a_factory_must_return_model_and_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setattr(ModelRegistry, "_factories", dict(ModelRegistry.model_factories()))  # undone after
    ModelRegistry.register_model("fc_bad", lambda path, dtype: "a model")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "fc_bad"}))
    with pytest.raises(TypeError, match=r"model_type 'fc_bad' must return \(model, tokenizer or None\), got str"):
        LLMEngine.from_pretrained(tmp_path, **ENGINE)
    with pytest.raises(TypeError, match="model_type must be a non-empty string"):
        ModelRegistry.register_model("", gpt2_example.from_hf_folder)
    with pytest.raises(TypeError, match="factory must be callable, got str"):
        ModelRegistry.register_model("fc_bad", "mypkg:load")


def test_entry_points_register_what_nothing_registered_in_process(monkeypatch):
    from importlib import metadata

    point = metadata.EntryPoint("fc_plugin_arch", "tests.model.gpt2_example:from_hf_folder", "pagedjax.models")
    monkeypatch.setattr(metadata, "entry_points", lambda group: [point] if group == "pagedjax.models" else [])
    monkeypatch.setattr(ModelRegistry, "_entry_points_loaded", False)
    monkeypatch.setattr(ModelRegistry, "_factories", dict(ModelRegistry.model_factories()))
    assert ModelRegistry.factory_for("fc_plugin_arch") is gpt2_example.from_hf_folder


def test_a_built_in_family_is_one_module_and_its_entry(folder, tmp_path, monkeypatch):
    """What adding a family to pagedjax takes: one module (its `load_config` and `load`) and its entry in
    `pagedjax.model.families.FAMILIES`; then `from_pretrained` serves its folders, `load_hf_config` sends them to
    the module, and the list of loadable types names the family. Here a toy family of GPT-2 folders."""
    from pagedjax.model import families
    from pagedjax.model.loading.hf_config import load_hf_config, loadable_model_types

    (tmp_path / "toy_family.py").write_text(
        "import json\nfrom tests.model.gpt2_example import from_hf_folder\n\n\n"
        "def load_config(path, dtype=None):\n    return json.loads((path / 'config.json').read_text())\n\n\n"
        "def load(path, dtype=None):\n    return from_hf_folder(path, dtype)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(families, "FAMILIES", (*families.FAMILIES, families.Family("toy_family", ("toy_gpt2",),
                                                                                     "toy")))
    path, model = folder
    toy = shutil.copytree(path, tmp_path / "toy")
    (toy / "config.json").write_text(json.dumps({**json.loads((path / "config.json").read_text()),
                                                 "model_type": "toy_gpt2"}))
    monkeypatch.setattr(ModelRegistry, "_factories", {})  # served as built in, not as registered
    engine = LLMEngine.from_pretrained(toy, **ENGINE)
    want = LLMEngine(model=model, tokenizer=engine.tokenizer, **ENGINE).generate("def f(x):", GREEDY, use_tqdm=False)
    assert engine.generate("def f(x):", GREEDY, use_tqdm=False)[0].output_token_ids == want[0].output_token_ids
    with pytest.raises(ValueError, match="a toy model, not a ModelConfig one.*toy_family.load_config"):
        load_hf_config(toy)
    assert "; toy toy_gpt2" in loadable_model_types()
