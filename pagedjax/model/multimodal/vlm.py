"""The base of the vision-language models (`pagedjax.model.multimodal.llava.Llava`,
`pagedjax.model.multimodal.gemma3_vision.Gemma3Vision`): a model of the public contract (`pagedjax.model.api`) whose
language model is the built-in decoder (`pagedjax.model.llama.Llama`, as `language_model`) and whose `encode_images`
(the subclass's tower + projector) makes the rows that replace an image's placeholder embeddings.

  `__call__`       the serving step: the decoder's, with `images=` (`ImageEmbeds`) put into its input embeddings
                   (`Llama.embed`).
  `forward_dense`  the ground truth: token ids `[B, S]` and every image of the batch `[N, 3, H, W]`: the features of
                   image i fill the i-th run of `tokens_per_image` placeholders in row-major order (transformers'
                   `masked_scatter`), causal attention, and with `ImageSpec.bidirectional` each run of consecutive
                   placeholders attending to itself both ways (transformers' `token_type_ids` mask, in full and
                   sliding-window layers alike).

Tensor parallelism: the tower and projector are replicated on every device; the language model's parameters split
by its own rule (`Llama.param_partition`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from pagedjax.config import ModelSpec
from pagedjax.model.api import ImageEmbeds, PagedKVCache
from pagedjax.model.llama import Llama


def placeholder_index(token_ids: jax.Array, image_token_id: int) -> jax.Array:
    """For token ids of any shape: the row of the images' features (all images' rows in order) each placeholder
    takes, counting placeholders in row-major order; -1 for every other token."""
    flat = (token_ids == image_token_id).reshape(-1)
    rank = jnp.cumsum(flat.astype(jnp.int32)) - 1
    return jnp.where(flat, rank, -1).reshape(token_ids.shape).astype(jnp.int32)


def placeholder_groups(token_ids: jax.Array, image_token_id: int) -> jax.Array:
    """token ids `[B, S]` -> int32 `[B, S]`: each run of consecutive placeholders numbered from 0 within its row (the
    blocks that attend to themselves both ways), -1 for every other token (transformers'
    `get_block_sequence_ids_for_mask`)."""
    is_image = token_ids == image_token_id
    previous = jnp.pad(is_image, ((0, 0), (1, 0)))[:, :-1]
    starts = jnp.cumsum((is_image & ~previous).astype(jnp.int32), axis=1) - 1
    return jnp.where(is_image, starts, -1).astype(jnp.int32)


class VisionLanguageModel(nnx.Module):
    """What LLaVA and Gemma 3 share around their towers: `spec` (the decoder's, with its `ImageSpec`), the serving
    call, logits, tensor-parallel partitions and the dense reference. A subclass sets `config` (with `spec`) and
    `language_model`, and defines `encode_images(pixel_values)`: float32 `[N, 3, H, W]` -> `[N, tokens_per_image,
    hidden]` in the model's dtype (the contract's, `pagedjax.model.api`)."""

    config: object
    language_model: Llama

    @property
    def spec(self) -> ModelSpec:
        return self.config.spec

    def __call__(self, token_ids: jax.Array, positions: jax.Array, cache: PagedKVCache, *,
                 images: ImageEmbeds | None = None) -> tuple[jax.Array, PagedKVCache]:
        """The serving step (`pagedjax.model.api`): token_ids, positions int32 `[T]`, `images` the features in
        place of placeholder embeddings -> (hidden `[T, hidden]`, cache)."""
        return self.language_model(token_ids, positions, cache, images=images)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        return self.language_model.compute_logits(hidden)

    def param_partition(self, names: tuple, tp: int):
        """The language model's parameters by its rule; the tower's and projector's replicated."""
        if names and names[0] == "language_model":
            return self.language_model.param_partition(tuple(names[1:]), tp)
        return P()

    def forward_dense(self, token_ids: jax.Array, pixel_values: jax.Array) -> jax.Array:
        """Ground truth (see the module docstring): token_ids int32 `[B, S]`, pixel_values float32 `[N, 3, H, W]`
        (N images for the batch's N runs of placeholders, in row-major order) -> float32 logits `[B, S, vocab]`.
        ValueError when the placeholders (concrete token ids) are not N images' worth."""
        images = self.spec.images
        token_ids = jnp.asarray(token_ids)
        if not isinstance(token_ids, jax.core.Tracer):
            found = int(np.sum(np.asarray(token_ids) == images.image_token_id))
            if found != pixel_values.shape[0] * images.tokens_per_image:
                raise ValueError(f"{type(self).__name__}.forward_dense: {found} placeholder tokens "
                                 f"({images.image_token_id}) for {pixel_values.shape[0]} images of "
                                 f"{images.tokens_per_image}")
        embeds = None
        if pixel_values.shape[0]:
            features = self.encode_images(pixel_values)
            embeds = ImageEmbeds(features.reshape(-1, features.shape[-1]),
                                 placeholder_index(token_ids, images.image_token_id))
        groups = placeholder_groups(token_ids, images.image_token_id) if images.bidirectional else None
        return self.language_model.forward_dense(token_ids, images=embeds, groups=groups)
