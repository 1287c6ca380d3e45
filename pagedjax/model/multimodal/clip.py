"""CLIP's vision transformer (transformers' `CLIPVisionModel`) as LLaVA reads it: a class token and the patches, each
with a learned position, a LayerNorm (`pre_layrnorm`, transformers' spelling), then the encoder layers; the hidden
state after the last layer built is the output (LLaVA's `vision_feature_layer` picks how many are built, and its
features are never normed after: `post_layernorm` is not part of this module)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from pagedjax.config.vision import VisionConfig
from pagedjax.model.layers.norm import LayerNorm
from pagedjax.model.multimodal.vit import Encoder, PatchEmbedding


class CLIPEmbeddings(nnx.Module):
    def __init__(self, cfg: VisionConfig, dtype, rngs: nnx.Rngs):
        self.class_embedding = nnx.Param(jax.random.normal(rngs.params(), (cfg.hidden_size,), dtype))
        self.patch_embedding = PatchEmbedding(3, cfg.hidden_size, cfg.patch_size, dtype, rngs, bias=False)
        self.position_embedding = nnx.Embed(cfg.num_patches + 1, cfg.hidden_size, dtype=dtype, param_dtype=dtype,
                                            rngs=rngs)

    def __call__(self, pixels: jax.Array) -> jax.Array:
        patches = self.patch_embedding(pixels)
        cls = jnp.broadcast_to(self.class_embedding[...].astype(patches.dtype), (patches.shape[0], 1, patches.shape[2]))
        return jnp.concatenate([cls, patches], axis=1) + self.position_embedding.embedding[...]


class CLIPVisionTower(nnx.Module):
    """pixels float32 `[N, 3, H, W]` -> the hidden state after `cfg.num_layers` encoder layers `[N, 1 + patches,
    hidden]` (row 0 the class token's), in the model's dtype."""

    def __init__(self, cfg: VisionConfig, dtype, rngs: nnx.Rngs):
        self.embeddings = CLIPEmbeddings(cfg, dtype, rngs)
        self.pre_layrnorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype)
        self.encoder = Encoder(cfg, dtype, rngs)

    def __call__(self, pixels: jax.Array) -> jax.Array:
        return self.encoder(self.pre_layrnorm(self.embeddings(pixels)))
