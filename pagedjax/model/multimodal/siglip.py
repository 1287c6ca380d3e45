"""SigLIP's vision transformer (transformers' `SiglipVisionModel`, without its attention-pooling head, which Gemma 3
does not use): the patches with a learned position each, the encoder layers, a LayerNorm (`post_layernorm`)."""

from __future__ import annotations

import jax
from flax import nnx

from pagedjax.config.vision import VisionConfig
from pagedjax.model.layers.norm import LayerNorm
from pagedjax.model.multimodal.vit import Encoder, PatchEmbedding


class SiglipEmbeddings(nnx.Module):
    def __init__(self, cfg: VisionConfig, dtype, rngs: nnx.Rngs):
        self.patch_embedding = PatchEmbedding(3, cfg.hidden_size, cfg.patch_size, dtype, rngs, bias=True)
        self.position_embedding = nnx.Embed(cfg.num_patches, cfg.hidden_size, dtype=dtype, param_dtype=dtype,
                                            rngs=rngs)

    def __call__(self, pixels: jax.Array) -> jax.Array:
        return self.patch_embedding(pixels) + self.position_embedding.embedding[...]


class SiglipVisionTower(nnx.Module):
    """pixels float32 `[N, 3, H, W]` -> `post_layernorm` of the last layer's hidden state `[N, patches, hidden]`, in
    the model's dtype."""

    def __init__(self, cfg: VisionConfig, dtype, rngs: nnx.Rngs):
        self.embeddings = SiglipEmbeddings(cfg, dtype, rngs)
        self.encoder = Encoder(cfg, dtype, rngs)
        self.post_layernorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype)

    def __call__(self, pixels: jax.Array) -> jax.Array:
        return self.post_layernorm(self.encoder(self.embeddings(pixels)))
