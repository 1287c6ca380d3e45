"""Gemma 3 with images (transformers' `Gemma3ForConditionalGeneration`) in Flax NNX, a model of the public contract
(`pagedjax.model.api`; `pagedjax.config.vision.Gemma3VisionConfig`): a SigLIP tower
(`pagedjax.model.multimodal.siglip`), its patch grid average-pooled to `mm_tokens_per_image` rows, RMS-normed and
projected (`Gemma3Projector`), in place of the `<image_soft_token>` placeholders of the Gemma 3 decoder
(`pagedjax.model.llama.Llama`, "gemma2" architecture), each image's placeholders attending to each other both ways
(`ImageSpec.bidirectional`).

Parameter names mirror transformers' (`vision_tower`, `multi_modal_projector.mm_soft_emb_norm` /
`mm_input_projection_weight`, `language_model`); `pagedjax.model.multimodal.hf_vision` reads the checkpoints.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from pagedjax.config.vision import Gemma3VisionConfig
from pagedjax.model.llama import Llama, RMSNorm
from pagedjax.model.multimodal.siglip import SiglipVisionTower
from pagedjax.model.multimodal.vlm import VisionLanguageModel


class Gemma3Projector(nnx.Module):
    """`multi_modal_projector`: the tower's `[N, side * side, vision]` rows as a side x side grid, averaged over
    `pool_kernel` x `pool_kernel` tiles (transformers' AvgPool2d, kernel = stride), RMS-normed ((1 + w), float32)
    and multiplied by `mm_input_projection_weight` `[vision, hidden]` -> `[N, mm_tokens_per_image, hidden]`."""

    def __init__(self, cfg: Gemma3VisionConfig, dtype, rngs: nnx.Rngs):
        vision, width = cfg.vision.hidden_size, cfg.text.hidden_size
        self.mm_input_projection_weight = nnx.Param(
            nnx.initializers.lecun_normal()(rngs.params(), (vision, width), dtype))
        self.mm_soft_emb_norm = RMSNorm(vision, cfg.vision.layer_norm_eps, dtype, offset=True)
        self.side, self.kernel, self.pooled = cfg.vision.grid[0], cfg.pool_kernel, cfg.pooled_side

    def __call__(self, x: jax.Array) -> jax.Array:
        n, _, d = x.shape
        k, m = self.kernel, self.pooled
        grid = x.reshape(n, self.side, self.side, d)[:, :m * k, :m * k].astype(jnp.float32)
        pooled = grid.reshape(n, m, k, m, k, d).mean(axis=(2, 4)).reshape(n, m * m, d).astype(x.dtype)
        weight = self.mm_input_projection_weight[...]
        normed = self.mm_soft_emb_norm(pooled)
        return jnp.matmul(normed, weight, preferred_element_type=jnp.float32).astype(x.dtype)


class Gemma3Vision(VisionLanguageModel):
    def __init__(self, cfg: Gemma3VisionConfig, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.text.dtype)
        self.config = cfg
        self.vision_tower = SiglipVisionTower(cfg.vision, dtype, rngs)
        self.multi_modal_projector = Gemma3Projector(cfg, dtype, rngs)
        self.language_model = Llama(cfg.text, rngs=rngs)

    def encode_images(self, pixel_values: jax.Array) -> jax.Array:
        """pixel_values float32 `[N, 3, H, W]` -> `[N, mm_tokens_per_image, hidden]` in the model's dtype
        (transformers' `get_image_features`)."""
        return self.multi_modal_projector(self.vision_tower(pixel_values))


def abstract_gemma3_vision(cfg: Gemma3VisionConfig) -> Gemma3Vision:
    """The model's structure with `jax.ShapeDtypeStruct` leaves: nothing is allocated."""
    return nnx.eval_shape(lambda: Gemma3Vision(cfg, rngs=nnx.Rngs(0)))


def gemma3_vision_from_state(cfg: Gemma3VisionConfig, state: nnx.State) -> Gemma3Vision:
    """A `Gemma3Vision` holding `state` (e.g. loaded weights) without initialising random ones first."""
    graphdef, _ = nnx.split(abstract_gemma3_vision(cfg))
    return nnx.merge(graphdef, state)
