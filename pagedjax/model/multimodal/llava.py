"""LLaVA (transformers' `LlavaForConditionalGeneration`) in Flax NNX, a model of the public contract
(`pagedjax.model.api`; `pagedjax.config.vision.LlavaConfig`): a CLIP tower (`pagedjax.model.multimodal.clip`) up to its
`vision_feature_layer`, its rows (without the class token's for the "default" strategy) through a two-layer MLP
projector, in place of the `<image>` placeholders of a built-in decoder (`pagedjax.model.llama.Llama`).

Parameter names mirror transformers' (`vision_tower`, `multi_modal_projector.linear_1 / linear_2`, `language_model`
holding the decoder's own, its `lm_head` included); `pagedjax.model.multimodal.hf_vision` reads the checkpoints.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from pagedjax.config.vision import LlavaConfig
from pagedjax.model.llama import Llama
from pagedjax.model.multimodal.clip import CLIPVisionTower
from pagedjax.model.multimodal.vit import activate, linear
from pagedjax.model.multimodal.vlm import VisionLanguageModel


class LlavaProjector(nnx.Module):
    """`multi_modal_projector`: linear_2(act(linear_1(x))), vision width -> the decoder's."""

    def __init__(self, cfg: LlavaConfig, dtype, rngs: nnx.Rngs):
        width = cfg.text.hidden_size
        self.linear_1 = linear(cfg.vision.hidden_size, width, dtype, rngs, bias=cfg.projector_bias)
        self.linear_2 = linear(width, width, dtype, rngs, bias=cfg.projector_bias)
        self.act = cfg.projector_act

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear_2(activate(self.act, self.linear_1(x)))


class Llava(VisionLanguageModel):
    def __init__(self, cfg: LlavaConfig, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.text.dtype)
        self.config = cfg
        self.vision_tower = CLIPVisionTower(cfg.vision, dtype, rngs)
        self.multi_modal_projector = LlavaProjector(cfg, dtype, rngs)
        self.language_model = Llama(cfg.text, rngs=rngs)

    def encode_images(self, pixel_values: jax.Array) -> jax.Array:
        """pixel_values float32 `[N, 3, H, W]` -> `[N, tokens_per_image, hidden]` in the model's dtype: the selected
        hidden state of the tower (transformers' `get_image_features`), projected."""
        hidden = self.vision_tower(pixel_values)
        if self.config.select_strategy == "default":
            hidden = hidden[:, 1:]
        return self.multi_modal_projector(hidden)


def abstract_llava(cfg: LlavaConfig) -> Llava:
    """The model's structure with `jax.ShapeDtypeStruct` leaves: nothing is allocated."""
    return nnx.eval_shape(lambda: Llava(cfg, rngs=nnx.Rngs(0)))


def llava_from_state(cfg: LlavaConfig, state: nnx.State) -> Llava:
    """A `Llava` holding `state` (e.g. loaded weights) without initialising random ones first."""
    graphdef, _ = nnx.split(abstract_llava(cfg))
    return nnx.merge(graphdef, state)
