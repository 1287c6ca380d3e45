"""Load a Hugging Face vision-language folder (`model_type` "llava" or "gemma3") as a model of the public contract:
`pagedjax.model.multimodal.llava.Llava` or `pagedjax.model.multimodal.gemma3_vision.Gemma3Vision`. `load` is the
built-in factory `pagedjax.model.loading.loader.load_registered` calls for these (the `ModelRegistry` factory contract).

- `load_config(path)` maps `config.json` (+ `generation_config.json`'s stop tokens) to a
  `pagedjax.config.vision.LlavaConfig` / `Gemma3VisionConfig`: the `text_config` through the text loader
  (`hf_config.config_from_dict`: every family it loads, "llava" any dense one, "gemma3" its "gemma3_text"), the
  `vision_config` ("clip_vision_model" for LLaVA, "siglip_vision_model" for Gemma 3). A sub-config may leave fields
  out (hub configs do): they take the transformers config class's defaults (`_TEXT_DEFAULTS`,
  `_VISION_DEFAULTS`), as transformers does. Refused with a `ModelLoadError` naming the file and field: several
  `vision_feature_layer`s (concatenated features), another vision tower or activation, non-square image sizes
  given as lists, mixture-of-experts or quantized text models, `quantization_config`, ...
- `load_vision_params(path, cfg)` reads the safetensors with `hf_loader.fill_state` (names and shapes checked
  before any data is read). Checkpoints name the parts in several layouts, all read: transformers 5's and the
  hub's (`language_model.model.*`, `language_model.lm_head`, `vision_tower[.vision_model].*`,
  `multi_modal_projector.*`) and transformers 4.5x's (`model.language_model.*`, `lm_head`,
  `model.vision_tower.*`, `model.multi_modal_projector.*`). Tensors the model does not compute with are skipped:
  CLIP's layers after LLaVA's feature layer and its `post_layernorm`, SigLIP's pooling `head`, a tied `lm_head`.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

from flax import nnx

from pagedjax.config.fields import is_int
from pagedjax.config.vision import (
    SELECT_STRATEGIES,
    VISION_ACTIVATIONS,
    Gemma3VisionConfig,
    LlavaConfig,
    VisionConfig,
)
from pagedjax.model.families import model_types_of
from pagedjax.model.loading.hf_config import SUPPORTED_MODEL_TYPES, config_from_dict
from pagedjax.model.loading.hf_fields import load_folder_config
from pagedjax.model.loading.hf_loader import fill_state, folder_tokenizer, safetensors_files

logger = logging.getLogger(__name__)

MODEL_TYPES = model_types_of(__name__)  # "llava", "gemma3"

# transformers' config class defaults of the shape fields a multimodal checkpoint's `text_config` may leave out
# (LlamaConfig, MistralConfig, ...); everything else the text loader defaults itself.
_TEXT_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, tie_word_embeddings=False),
    "mistral": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "qwen2": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, tie_word_embeddings=False),
    "qwen3": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, tie_word_embeddings=False),
    "phi3": dict(vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, tie_word_embeddings=False),
    "olmo2": dict(vocab_size=50304, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, tie_word_embeddings=False),
    "gemma2": dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                   num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True),
    "gemma3_text": dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True),
}
# The text models a LLaVA folder may hold: the dense families of the text loader.
_LLAVA_TEXT_TYPES = tuple(t for t in SUPPORTED_MODEL_TYPES if t in _TEXT_DEFAULTS)
# CLIPVisionConfig's and SiglipVisionConfig's defaults.
_VISION_DEFAULTS: dict[str, dict[str, Any]] = {
    "clip_vision_model": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                              image_size=224, patch_size=32, hidden_act="quick_gelu", layer_norm_eps=1e-5,
                              num_channels=3),
    "siglip_vision_model": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                num_attention_heads=12, image_size=224, patch_size=16, hidden_act="gelu_pytorch_tanh",
                                layer_norm_eps=1e-6, num_channels=3),
}
_TOWERS = {"llava": ("clip_vision_model", "clip"), "gemma3": ("siglip_vision_model", "siglip")}
# Top-level fields, with transformers' defaults (LlavaConfig, Gemma3Config).
_LLAVA_DEFAULTS = dict(image_token_index=32000, vision_feature_layer=-2, vision_feature_select_strategy="default",
                       projector_hidden_act="gelu", multimodal_projector_bias=True, tie_word_embeddings=False)
_GEMMA3_DEFAULTS = dict(image_token_index=262144, mm_tokens_per_image=256, tie_word_embeddings=True)
_SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


def load_config(path: str | os.PathLike, dtype: str | None = None) -> LlavaConfig | Gemma3VisionConfig:
    """A "llava" / "gemma3" folder's `config.json` (and `generation_config.json`'s bos / eos) as a `LlavaConfig` /
    `Gemma3VisionConfig` (see the module docstring). `dtype` ("float32" | "bfloat16" | "float16") overrides the
    checkpoint's. FileNotFoundError without config.json; ModelLoadError naming the file and field otherwise."""
    def build(hf: dict, bos: int | None, eos: tuple[int, ...]) -> LlavaConfig | Gemma3VisionConfig:
        model_type = hf.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"field 'model_type' = {model_type!r} is not a vision-language one "
                             f"({', '.join(MODEL_TYPES)})")
        if hf.get("quantization_config") is not None:
            raise ValueError("field 'quantization_config': pre-quantized vision-language checkpoints are not supported")
        return (_llava if model_type == "llava" else _gemma3)(hf, dtype, bos, eos)

    return load_folder_config(path, build)


def _field(hf: dict, key: str, defaults: dict) -> Any:
    """The top-level field, or transformers' default when absent or null."""
    value = hf.get(key)
    return defaults[key] if value is None else value


def _dtype(hf: dict, text: dict, dtype: str | None) -> str:
    """The dtype asked for, else the checkpoint's (`torch_dtype` / `dtype`, top level first), else float32."""
    if dtype is not None:
        if dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported (supported: {', '.join(_SUPPORTED_DTYPES)})")
        return dtype
    for where, config in (("", hf), ("text_config.", text)):
        for key in ("torch_dtype", "dtype"):
            if config.get(key) is not None:
                if config[key] not in _SUPPORTED_DTYPES:
                    raise ValueError(f"field '{where}{key}' = {config[key]!r} is not supported (supported: "
                                     f"{', '.join(_SUPPORTED_DTYPES)}); pass dtype= to override")
                return config[key]
    return "float32"


def _text(hf: dict, dtype: str | None, bos, eos, allowed: tuple[str, ...], tie: bool | None):
    """The `text_config` as a ModelConfig (missing shape fields from its class's defaults; tied embeddings as the
    top-level config decides, `tie`, when given)."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"field 'text_config': expected an object, got {text!r}")
    model_type = text.get("model_type")
    if model_type not in allowed:
        raise ValueError(f"field 'text_config.model_type' = {model_type!r} is not supported for "
                         f"{hf['model_type']} (supported: {', '.join(allowed)})")
    full = {**_TEXT_DEFAULTS[model_type], **text}
    if full.get("use_bidirectional_attention"):  # EmbeddingGemma's: an encoder of text, not an image-text decoder
        raise ValueError("field 'text_config.use_bidirectional_attention' = true is not supported with images")
    if tie is not None:
        full["tie_word_embeddings"] = tie
    try:
        return config_from_dict(full, _dtype(hf, text, dtype), bos_token_id=bos, eos_token_ids=eos)
    except ValueError as e:
        raise ValueError(f"text_config: {e}") from None


def _vision(hf: dict, family: str, num_layers=None) -> VisionConfig:
    """The `vision_config` as a VisionConfig of the family's tower, running `num_layers(total)` layers (all by
    default)."""
    vision = hf.get("vision_config")
    if not isinstance(vision, dict):
        raise ValueError(f"field 'vision_config': expected an object, got {vision!r}")
    model_type, kind = _TOWERS[family]
    if vision.get("model_type") != model_type:
        raise ValueError(f"field 'vision_config.model_type' = {vision.get('model_type')!r} is not supported for "
                         f"{family} (only {model_type!r})")
    v = {**_VISION_DEFAULTS[model_type], **{k: x for k, x in vision.items() if x is not None}}
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size",
                "patch_size", "num_channels"):
        if not is_int(v[key]) or v[key] < 1:
            raise ValueError(f"field 'vision_config.{key}': expected a positive int, got {v[key]!r}")
    if v["num_channels"] != 3:
        raise ValueError(f"field 'vision_config.num_channels' = {v['num_channels']}: only RGB images (3) are supported")
    if v["hidden_act"] not in VISION_ACTIVATIONS:
        raise ValueError(f"field 'vision_config.hidden_act' = {v['hidden_act']!r} is not supported (supported: "
                         f"{', '.join(VISION_ACTIVATIONS)})")
    eps = v["layer_norm_eps"]
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not eps > 0:
        raise ValueError(f"field 'vision_config.layer_norm_eps': expected a positive number, got {eps!r}")
    total = v["num_hidden_layers"]
    return VisionConfig(kind=kind, hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
                        num_layers=total if num_layers is None else num_layers(total),
                        num_heads=v["num_attention_heads"], image_size=(v["image_size"], v["image_size"]),
                        patch_size=v["patch_size"], hidden_act=v["hidden_act"], layer_norm_eps=float(eps))


def _llava(hf: dict, dtype, bos, eos) -> LlavaConfig:
    layer = _field(hf, "vision_feature_layer", _LLAVA_DEFAULTS)
    if isinstance(layer, list) and len(layer) == 1:  # one layer "concatenated": the same features
        layer = layer[0]
    if isinstance(layer, list):
        raise ValueError(f"field 'vision_feature_layer' = {layer!r}: features concatenated from several layers are "
                         "not supported (only one layer)")
    if not is_int(layer):
        raise ValueError(f"field 'vision_feature_layer': expected an int, got {layer!r}")

    def layers_run(total: int) -> int:  # hidden_states has total + 1 entries: the embeddings', then each layer's
        index = layer if layer >= 0 else total + 1 + layer
        if not 0 <= index <= total:
            raise ValueError(f"field 'vision_feature_layer' = {layer}: the tower has {total} layers (hidden states "
                             f"{-total - 1} .. {total})")
        return index

    strategy = _field(hf, "vision_feature_select_strategy", _LLAVA_DEFAULTS)
    if strategy not in SELECT_STRATEGIES:
        raise ValueError(f"field 'vision_feature_select_strategy' = {strategy!r} is not supported (supported: "
                         f"{', '.join(SELECT_STRATEGIES)})")
    act = _field(hf, "projector_hidden_act", _LLAVA_DEFAULTS)
    if act not in VISION_ACTIVATIONS:
        raise ValueError(f"field 'projector_hidden_act' = {act!r} is not supported (supported: "
                         f"{', '.join(VISION_ACTIVATIONS)})")
    bias = _field(hf, "multimodal_projector_bias", _LLAVA_DEFAULTS)
    if not isinstance(bias, bool):
        raise ValueError(f"field 'multimodal_projector_bias': expected true or false, got {bias!r}")
    tie = _field(hf, "tie_word_embeddings", _LLAVA_DEFAULTS)
    text_config = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else {}
    text_type = text_config.get("model_type")
    text_tie = text_config.get("tie_word_embeddings", _TEXT_DEFAULTS.get(text_type, {}).get("tie_word_embeddings"))
    # LlavaConfig ties the embeddings when either config says so.
    text = _text(hf, dtype, bos, eos, _LLAVA_TEXT_TYPES, bool(tie) or bool(text_tie))
    return LlavaConfig(text=text, vision=_vision(hf, "llava", layers_run),
                       image_token_id=_image_token(hf, _LLAVA_DEFAULTS), select_strategy=strategy,
                       projector_act=act, projector_bias=bias)


def _gemma3(hf: dict, dtype, bos, eos) -> Gemma3VisionConfig:
    tie = hf.get("tie_word_embeddings", _GEMMA3_DEFAULTS["tie_word_embeddings"])
    text = _text(hf, dtype, bos, eos, ("gemma3_text",), None if tie is None else bool(tie))
    tokens = _field(hf, "mm_tokens_per_image", _GEMMA3_DEFAULTS)
    if not is_int(tokens) or tokens < 1:
        raise ValueError(f"field 'mm_tokens_per_image': expected a positive int, got {tokens!r}")
    return Gemma3VisionConfig(text=text, vision=_vision(hf, "gemma3"),
                              image_token_id=_image_token(hf, _GEMMA3_DEFAULTS), mm_tokens_per_image=tokens)


def _image_token(hf: dict, defaults: dict) -> int:
    key = "image_token_index" if hf.get("image_token_index") is not None or hf.get("image_token_id") is None else \
        "image_token_id"
    value = hf.get(key)
    value = defaults["image_token_index"] if value is None else value
    if not is_int(value) or value < 0:
        raise ValueError(f"field {key!r}: expected a token id, got {value!r}")
    return value


# Where each part of the model is in a checkpoint, in the layouts transformers has saved (the first whose tensors
# are there): transformers 5's and the hub's, then transformers 4.5x's. lm_head's default follows the decoder's.
_PREFIXES = {
    "language_model": ("language_model.model.", "model.language_model."),
    "lm_head": ("language_model.lm_head.", "lm_head."),
    "vision_tower": ("vision_tower.vision_model.", "model.vision_tower.vision_model.", "model.vision_tower.",
                     "vision_tower."),
    "multi_modal_projector": ("multi_modal_projector.", "model.multi_modal_projector."),
}
# A parameter's leaf -> (its checkpoint name's last part, transposed?): linear kernels are [in, out], transformers'
# weights [out, in]; other leaves keep their name (CLIP's class_embedding, Gemma 3's mm_input_projection_weight).
_LEAVES = {"kernel": ("weight", True), "embedding": ("weight", False), "weight": ("weight", False),
           "bias": ("bias", False)}
_LAYER = re.compile(r"encoder\.layers\.(\d+)\.")


def _layout(files: list[Path]) -> dict[str, str]:
    """part -> the prefix its tensors have in these files (`_PREFIXES`)."""
    from safetensors import safe_open

    names: list[str] = []
    for file in files:
        try:
            with safe_open(str(file), framework="numpy") as f:
                names.extend(f.keys())
        except Exception:  # noqa: BLE001 - an unreadable file: fill_state names it
            logger.debug("cannot list the tensors of %s", file)
    found = {part: next((p for p in prefixes if any(n.startswith(p) for n in names)), None)
             for part, prefixes in _PREFIXES.items()}
    layout = {part: prefix or _PREFIXES[part][0] for part, prefix in found.items()}
    if found["lm_head"] is None and layout["language_model"] == "model.language_model.":
        layout["lm_head"] = "lm_head."
    return layout


def load_vision_params(path: str | os.PathLike, cfg: LlavaConfig | Gemma3VisionConfig, model) -> nnx.State:
    """The weights of the folder as the parameters of `model` (an abstract `Llava` / `Gemma3Vision` of `cfg`),
    streamed by `fill_state`. ModelLoadError naming missing, unexpected or mis-shaped tensors."""
    _, state = nnx.split(model)
    layout = _layout(safetensors_files(path))
    tied = cfg.text.tie_word_embeddings

    def names(p: tuple, shape: tuple) -> list[tuple[str, bool, None]]:
        *mods, leaf = (str(x) for x in p)
        name, transpose = _LEAVES.get(leaf, (leaf, False))
        part, rest = mods[0], mods[1:]
        if part == "language_model" and rest[:1] == ["lm_head"]:
            return [(layout["lm_head"] + name, transpose, None)]
        return [(layout[part] + ".".join(rest + [name]), transpose, None)]

    def skip(name: str) -> bool:
        if name.endswith(".rotary_emb.inv_freq"):
            return True
        if name.startswith(layout["lm_head"]):
            return tied
        if not name.startswith(layout["vision_tower"]):
            return False
        rest = name[len(layout["vision_tower"]):]
        if rest == "embeddings.position_ids":  # a buffer older checkpoints saved
            return True
        if cfg.vision.kind == "clip" and rest.startswith("post_layernorm."):  # LLaVA reads a hidden state, unnormed
            return True
        if cfg.vision.kind == "siglip" and rest.startswith("head."):  # SigLIP's pooling head: Gemma 3 reads rows
            return True
        layer = _LAYER.match(rest)
        return layer is not None and int(layer.group(1)) >= cfg.vision.num_layers  # after LLaVA's feature layer

    return fill_state(path, state, names, skip=skip)


def load(path: str | os.PathLike, dtype: str | None = None):
    """(`Llava` / `Gemma3Vision` holding the folder's weights, tokenizer or None) of a "llava" / "gemma3" Hugging
    Face folder, in the checkpoint's dtype or `dtype`: the built-in factory of these `model_type`s
    (`pagedjax.model.loading.loader.load_registered`; the `ModelRegistry` factory contract). The folder's image
    processor is `pagedjax.model.multimodal.processor.load_image_processor(path)`."""
    cfg = load_config(path, dtype)
    if isinstance(cfg, LlavaConfig):
        from pagedjax.model.multimodal.llava import abstract_llava, llava_from_state

        abstract, from_state = abstract_llava, llava_from_state
    else:
        from pagedjax.model.multimodal.gemma3_vision import abstract_gemma3_vision, gemma3_vision_from_state

        abstract, from_state = abstract_gemma3_vision, gemma3_vision_from_state
    state = load_vision_params(path, cfg, abstract(cfg))
    return from_state(cfg, state), folder_tokenizer(path, cfg.text.eos_token_ids, cfg.text.bos_token_id)
