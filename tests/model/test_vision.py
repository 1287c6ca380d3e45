"""Vision-language models from Hugging Face folders (`pagedjax.model.multimodal.hf_vision`): tiny random LLaVA (CLIP +
Llama) and Gemma 3 (SigLIP + Gemma 3 text) checkpoints made by transformers' own classes (`tests.model.vision_folders`,
every parameter random) must give transformers' image features (`encode_images` = `get_image_features`) and its
logits with images in the prompt (`forward_dense`, one and two images per prompt in one batch; Gemma 3's image
placeholders attending to each other both ways, within the local layers' window), float32 within 1e-5 of the
largest logit, bfloat16 within 1e-2; LLaVA's serving call with `images=` over the paged cache equals its dense
forward. Every refused config field is named. No hub access.
"""

from __future__ import annotations

import copy
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from pagedjax.config import ImageSpec, ModelConfig  # noqa: E402
from pagedjax.config.vision import LlavaConfig, VisionConfig  # noqa: E402
from pagedjax.device.kv_cache import init_kv_cache  # noqa: E402
from pagedjax.model.api import ImageEmbeds, PagedKVCache, check_model  # noqa: E402
from pagedjax.model.errors import ModelLoadError  # noqa: E402
from pagedjax.model.hf_tokenizer import HFTokenizer  # noqa: E402
from pagedjax.model.llama import Llama  # noqa: E402
from pagedjax.model.loading.hf_config import load_hf_config  # noqa: E402
from pagedjax.model.loading.loader import load_engine_model, load_registered  # noqa: E402
from pagedjax.model.multimodal import hf_vision  # noqa: E402
from pagedjax.model.multimodal.hf_vision import load as load_hf_vision  # noqa: E402
from pagedjax.model.multimodal.hf_vision import load_config as load_vision_config  # noqa: E402
from pagedjax.model.multimodal.llava import Llava  # noqa: E402
from pagedjax.model.multimodal.processor import load_image_processor  # noqa: E402
from pagedjax.model.multimodal.vlm import placeholder_index  # noqa: E402
from tests.model.test_model import _ragged_batch  # noqa: E402
from tests.model.vision_folders import PROMPTS, hf_model, random_images, save_folder, saved_models  # noqa: E402

pytestmark = pytest.mark.hf

TOL = 1e-5  # float32, relative to the largest magnitude
BF16_TOL = 1e-2


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """kind -> (transformers model, folder, pagedjax model)."""
    out = {}
    for kind, (reference, folder) in saved_models(tmp_path_factory).items():
        ours, tokenizer = load_hf_vision(folder)
        assert isinstance(tokenizer, HFTokenizer)
        out[kind] = (reference, folder, ours)
    return out


def _encode(model, pixels) -> np.ndarray:
    graphdef, state = nnx.split(model)
    return np.asarray(jax.jit(lambda s, x: nnx.merge(graphdef, s).encode_images(x))(state, pixels))


def _dense(model, ids, pixels) -> np.ndarray:
    graphdef, state = nnx.split(model)
    return np.asarray(jax.jit(lambda s, t, x: nnx.merge(graphdef, s).forward_dense(t, x))(state, ids, pixels))


def _batch(folder, kind):
    """(right-padded token ids [2, S], lengths, pixel values of the batch's three images) of PROMPTS[kind], through
    the folder's processor and tokenizer."""
    processor, tokenizer = load_image_processor(folder), HFTokenizer.from_pretrained(folder)
    prompts = [tokenizer.encode(processor.expand_prompt(p)) for p in PROMPTS[kind]]
    ids = np.zeros((len(prompts), max(map(len, prompts))), np.int32)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = p
    images = random_images()
    pixels = processor.pixel_values([images[0], images[5], images[8]])  # RGB, RGBA and palette images
    return ids, [len(p) for p in prompts], pixels


def _reference_logits(reference, ids, lengths, pixels, image_token_id) -> np.ndarray:
    mask = np.zeros_like(ids)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    extra = {}
    if isinstance(reference, transformers.Gemma3ForConditionalGeneration):  # the processor's token_type_ids
        extra["token_type_ids"] = torch.from_numpy((ids == image_token_id).astype(np.int64))
    dtype = next(reference.parameters()).dtype
    with torch.no_grad():
        out = reference(input_ids=torch.from_numpy(ids.astype(np.int64)), attention_mask=torch.from_numpy(mask),
                        pixel_values=torch.from_numpy(pixels).to(dtype), **extra)
    return out.logits.float().numpy()


def _assert_close(ours, theirs, lengths, tol, what):
    for i, n in enumerate(lengths):
        a, b = ours[i, :n], theirs[i, :n]
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * np.abs(b).max(), err_msg=f"{what}, prompt {i}")


@pytest.mark.parametrize("kind", ["llava", "gemma3"])
def test_config_maps_fields(models, kind):
    reference, folder, ours = models[kind]
    hc = reference.config
    cfg = load_vision_config(folder)
    assert ours.config == cfg
    v, vc = cfg.vision, hc.vision_config
    assert (v.hidden_size, v.intermediate_size, v.num_heads, v.patch_size, v.hidden_act, v.image_size) == (
        vc.hidden_size, vc.intermediate_size, vc.num_attention_heads, vc.patch_size, vc.hidden_act, (16, 16))
    images = ours.spec.images
    assert images.image_token_id == hc.image_token_index and images.image_size == (16, 16)
    assert cfg.text.vocab_size == hc.text_config.vocab_size and cfg.text.num_layers == hc.text_config.num_hidden_layers
    if kind == "llava":
        assert (v.kind, v.num_layers, images.tokens_per_image, images.bidirectional) == ("clip", 2, 16, False)
        assert not cfg.text.tie_word_embeddings and cfg.projector_act == "gelu" and cfg.projector_bias
    else:
        assert (v.kind, v.num_layers, images.tokens_per_image, images.bidirectional) == ("siglip", 2, 16, True)
        assert (cfg.pool_kernel, cfg.pooled_side) == (2, 4)
        assert cfg.text.architecture == "gemma2" and cfg.text.sliding_windows == (8, None, 8)
        assert cfg.text.tie_word_embeddings
    assert check_model(ours) == ours.spec


@pytest.mark.parametrize("kind", ["llava", "gemma3"])
def test_encode_images_matches_transformers(models, kind):
    reference, folder, ours = models[kind]
    _, _, pixels = _batch(folder, kind)
    with torch.no_grad():
        theirs = torch.stack(list(reference.get_image_features(torch.from_numpy(pixels)).pooler_output)).numpy()
    features = _encode(ours, pixels)
    assert features.shape == (3, ours.spec.images.tokens_per_image, ours.config.text.hidden_size)
    assert features.dtype == np.float32
    np.testing.assert_allclose(features, theirs, rtol=TOL, atol=TOL * np.abs(theirs).max())


@pytest.mark.parametrize("kind", ["llava", "gemma3"])
def test_dense_logits_with_images_match_transformers(models, kind):
    reference, folder, ours = models[kind]
    ids, lengths, pixels = _batch(folder, kind)
    token = ours.spec.images.image_token_id
    assert [int((ids[i] == token).sum()) for i in range(2)] == [16, 32]
    theirs = _reference_logits(reference, ids, lengths, pixels, token)
    _assert_close(_dense(ours, ids, pixels), theirs, lengths, TOL, kind)
    if kind == "gemma3":  # the bidirectional image blocks change the logits: the check above sees them
        causal = _reference_logits(reference, ids, lengths, pixels, -1)
        assert np.abs(causal - theirs)[0, :lengths[0]].max() > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("text", ["mistral", "qwen2"])
def test_llava_over_other_text_models(tmp_path, text):
    """LLaVA over Mistral (a window shorter than the prompts) and Qwen2 (biases, tied embeddings)."""
    reference = hf_model("llava", 3, text=text)
    folder = save_folder("llava", tmp_path, model=reference, text=text)
    ours, _ = load_hf_vision(folder)
    assert ours.config.text.tie_word_embeddings == (text == "qwen2")
    ids, lengths, pixels = _batch(folder, "llava")
    theirs = _reference_logits(reference, ids, lengths, pixels, ours.spec.images.image_token_id)
    _assert_close(_dense(ours, ids, pixels), theirs, lengths, TOL, text)


def test_bfloat16_matches_transformers(models):
    """Gemma 3 in bfloat16 (its embedding scale rounded to bf16, features in bf16) against transformers' bf16."""
    reference, folder, _ = models["gemma3"]
    ours, _ = load_hf_vision(folder, "bfloat16")
    assert ours.spec.dtype == "bfloat16"
    ids, lengths, pixels = _batch(folder, "gemma3")
    theirs = _reference_logits(copy.deepcopy(reference).to(torch.bfloat16), ids, lengths, pixels,
                               ours.spec.images.image_token_id)
    _assert_close(_dense(ours, ids, pixels), theirs, lengths, BF16_TOL, "bfloat16")


def test_serving_call_with_images_matches_dense(models):
    """LLaVA's serving step (`__call__` over the paged cache, `images=` indexing the ragged batch's tokens) gives
    the dense forward's logits: the engine's path for causal models."""
    _, folder, ours = models["llava"]
    ids, lengths, pixels = _batch(folder, "llava")
    prompts = [ids[i, :n] for i, n in enumerate(lengths)]
    block_size, num_blocks = 8, 24
    tokens, positions, meta = _ragged_batch(prompts, block_size, num_blocks, np.random.default_rng(0))
    cache = init_kv_cache(ours.spec.kv_layers, num_blocks, block_size)
    graphdef, state = nnx.split(ours)

    @jax.jit
    def serve(state, tokens, positions, layers, meta, pixels):
        m = nnx.merge(graphdef, state)
        features = m.encode_images(pixels)
        images = ImageEmbeds(features.reshape(-1, features.shape[-1]),
                             placeholder_index(tokens, m.spec.images.image_token_id))
        hidden, _ = m(tokens, positions, PagedKVCache(layers, meta, backend="xla"), images=images)
        return m.compute_logits(hidden)

    logits = np.asarray(serve(state, jnp.asarray(tokens), jnp.asarray(positions), cache.layers, meta, pixels))
    dense = _dense(ours, ids, pixels)
    offset = 0
    for i, n in enumerate(lengths):
        np.testing.assert_allclose(logits[offset:offset + n], dense[i, :n], rtol=TOL, atol=TOL * np.abs(dense).max())
        offset += n


def test_feature_layer_and_strategy_follow_the_config(models, tmp_path):
    """vision_feature_layer -1 (every layer built) with the "full" strategy (the class token's row kept): the
    features transformers' get_image_features gives for them."""
    reference, folder, _ = models["llava"]
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(vision_feature_layer=[-1], vision_feature_select_strategy="full")
    (tmp_path / "config.json").write_text(json.dumps(config))
    ours, _ = load_hf_vision(tmp_path)
    assert ours.config.vision.num_layers == 3 and ours.spec.images.tokens_per_image == 17
    _, _, pixels = _batch(folder, "llava")
    with torch.no_grad():
        theirs = reference.get_image_features(torch.from_numpy(pixels), vision_feature_layer=-1,
                                              vision_feature_select_strategy="full").pooler_output
    theirs = torch.stack(list(theirs)).numpy()
    np.testing.assert_allclose(_encode(ours, pixels), theirs, rtol=TOL, atol=TOL * np.abs(theirs).max())


@pytest.mark.parametrize("layout", ["hub", "transformers4"])
def test_checkpoint_layouts_load_the_same_weights(models, tmp_path, layout):
    """The hub's names (`vision_tower.vision_model.*`, `language_model.model.*`) and transformers 4.5x's
    (`model.language_model.*`, `lm_head`, `model.vision_tower.vision_model.*`) read into the same parameters."""
    from safetensors.numpy import load_file, save_file

    _, folder, ours = models["llava"]
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    renames = {"hub": [("vision_tower.", "vision_tower.vision_model.")],
               "transformers4": [("language_model.model.", "model.language_model."),
                                 ("language_model.lm_head.", "lm_head."),
                                 ("vision_tower.", "model.vision_tower.vision_model."),
                                 ("multi_modal_projector.", "model.multi_modal_projector.")]}[layout]
    tensors = load_file(str(tmp_path / "model.safetensors"))
    renamed = {}
    for name, value in tensors.items():
        for old, new in renames:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        renamed[name] = value
    save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    loaded, _ = load_hf_vision(tmp_path)
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(loaded)), nnx.to_flat_state(nnx.state(ours)),
                                 strict=True):
        assert np.array_equal(np.asarray(a.get_value()), np.asarray(b.get_value())), path


def test_served_by_from_pretrained_and_quantization_refused(models):
    _, folder, _ = models["gemma3"]
    model, tokenizer = load_registered(folder, None)
    assert type(model).__name__ == "Gemma3Vision" and tokenizer is not None
    with pytest.raises(ValueError, match="quantization"):
        load_engine_model(folder, None, None, None, quantization="int8")
    with pytest.raises(ModelLoadError, match="model_type"):  # not a text-only ModelConfig
        load_hf_config(folder)


def test_check_model_names_what_a_model_with_images_lacks():
    cfg = LlavaConfig(text=ModelConfig(vocab_size=32, hidden_size=32, num_layers=1, num_q_heads=2, num_kv_heads=1,
                                       head_dim=16, intermediate_size=32),
                      vision=VisionConfig(kind="clip", hidden_size=16, intermediate_size=32, num_layers=1,
                                                    num_heads=2, image_size=(8, 8), patch_size=4,
                                                    hidden_act="quick_gelu", layer_norm_eps=1e-5),
                      image_token_id=31)

    class NoEncoder(Llama):  # declares images, cannot encode them
        @property
        def spec(self):
            return cfg.spec

    class FewRows(Llava):
        def encode_images(self, pixel_values):
            return super().encode_images(pixel_values)[:, :2]

    class NoImagesArgument(Llava):
        def __call__(self, token_ids, positions, cache):
            return self.language_model(token_ids, positions, cache)

    assert check_model(nnx.eval_shape(lambda: Llava(cfg, rngs=nnx.Rngs(0)))).images == ImageSpec(31, 4, (8, 8))
    with pytest.raises(TypeError, match="encode_images"):
        check_model(nnx.eval_shape(lambda: NoEncoder(cfg.text, rngs=nnx.Rngs(0))))
    with pytest.raises(ValueError, match=r"tokens_per_image.*\[1, 4, 32\]"):
        check_model(nnx.eval_shape(lambda: FewRows(cfg, rngs=nnx.Rngs(0))))
    with pytest.raises(TypeError, match="images="):
        check_model(nnx.eval_shape(lambda: NoImagesArgument(cfg, rngs=nnx.Rngs(0))))


def test_tensor_parallel_partitions_split_only_the_language_model(models):
    from jax.sharding import PartitionSpec as P

    from pagedjax.model.api import param_partition_fn

    _, _, ours = models["llava"]
    partition = param_partition_fn(ours, 2)
    specs = {tuple(map(str, path)): partition(tuple(path), tuple(var.get_value().shape))
             for path, var in nnx.to_flat_state(nnx.state(ours))}
    assert all(spec == P() for path, spec in specs.items() if path[0] != "language_model")
    assert specs["language_model", "layers", "0", "self_attn", "q_proj", "kernel"] == P(None, "tp")
    assert specs["language_model", "layers", "0", "self_attn", "o_proj", "kernel"] == P("tp", None)


@pytest.mark.parametrize("fields,error,field", [
    (dict(image_token_id=-1, tokens_per_image=4, image_size=(8, 8)), ValueError, "image_token_id"),
    (dict(image_token_id=1, tokens_per_image=0, image_size=(8, 8)), ValueError, "tokens_per_image"),
    (dict(image_token_id=1, tokens_per_image=4, image_size=8), TypeError, "image_size"),
    (dict(image_token_id=1, tokens_per_image=4, image_size=(8, "8")), TypeError, r"image_size\[1\]"),
    (dict(image_token_id=1, tokens_per_image=4, image_size=(8, 8), bidirectional=1), TypeError, "bidirectional"),
])
def test_image_spec_checks_its_fields(fields, error, field):
    with pytest.raises(error, match=field):
        ImageSpec(**fields)


def test_model_spec_images_within_the_vocabulary():
    from pagedjax.config import ModelSpec

    spec = ModelSpec(vocab_size=8, num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=4,
                     images=ImageSpec(7, 4, [8, 8]))
    assert spec.images.image_size == (8, 8) and spec.replace(dtype="bfloat16").images == spec.images
    with pytest.raises(ValueError, match="images.image_token_id"):
        spec.replace(images=ImageSpec(8, 4, (8, 8)))
    with pytest.raises(TypeError, match="images"):
        spec.replace(images={"image_token_id": 1})


def test_sub_config_defaults_are_transformers():
    """A hub config may leave a sub-config's fields out: the defaults filled in are the config classes'."""
    classes = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
               "phi3": "Phi3Config", "olmo2": "Olmo2Config", "gemma2": "Gemma2Config",
               "gemma3_text": "Gemma3TextConfig", "clip_vision_model": "CLIPVisionConfig",
               "siglip_vision_model": "SiglipVisionConfig"}
    for model_type, defaults in {**hf_vision._TEXT_DEFAULTS, **hf_vision._VISION_DEFAULTS}.items():
        config = getattr(transformers, classes[model_type])()
        assert {k: getattr(config, k) for k in defaults} == defaults, model_type


def _write(tmp_path, base: dict, changes: dict, sub: str | None = None):
    config = copy.deepcopy(base)
    (config[sub] if sub else config).update(changes)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("kind,sub,changes,field", [
    ("llava", None, {"vision_feature_layer": [-2, -1]}, "vision_feature_layer"),
    ("llava", None, {"vision_feature_layer": -5}, "vision_feature_layer"),
    ("llava", None, {"vision_feature_select_strategy": "cls"}, "vision_feature_select_strategy"),
    ("llava", None, {"projector_hidden_act": "relu"}, "projector_hidden_act"),
    ("llava", None, {"multimodal_projector_bias": "yes"}, "multimodal_projector_bias"),
    ("llava", None, {"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
    ("llava", None, {"text_config": None}, "text_config"),
    ("llava", "vision_config", {"model_type": "siglip_vision_model"}, "vision_config.model_type"),
    ("llava", "vision_config", {"hidden_act": "relu"}, "vision_config.hidden_act"),
    ("llava", "vision_config", {"image_size": [16, 16]}, "vision_config.image_size"),
    ("llava", "vision_config", {"num_channels": 1}, "vision_config.num_channels"),
    ("llava", "text_config", {"model_type": "mixtral"}, "text_config.model_type"),
    ("llava", "text_config", {"hidden_act": "gelu"}, "hidden_act"),
    ("gemma3", None, {"mm_tokens_per_image": 8}, "mm_tokens_per_image"),
    ("gemma3", "text_config", {"model_type": "gemma2"}, "text_config.model_type"),
    ("gemma3", "text_config", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma3", "vision_config", {"model_type": "clip_vision_model"}, "vision_config.model_type"),
])
def test_unsupported_fields_are_named(models, tmp_path, kind, sub, changes, field):
    base = json.loads((models[kind][1] / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=field):
        load_vision_config(_write(tmp_path, base, changes, sub))
