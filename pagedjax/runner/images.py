"""The encoder cache's device side (`pagedjax.core.encoder_cache` keeps the host's accounting): one array of image
features, `num_slots` images of `tokens_per_image` rows each, and the program that encodes a step's new images into
their slots before the step runs (`StepPlan.encode_images`).

A step of image placeholders takes the whole array and, per token, the row it reads (`StepInputs.image_index`), so
its program's shape does not depend on which or how many images it reads; the model puts the rows in place of the
placeholders' embeddings (`pagedjax.model.api.ImageEmbeds`). Encoding runs the model's `encode_images` on the new
images' pixels, their count padded to a power of two (padding rows are written nowhere), on a program of that count
held in a `ProgramCache` of its own: its compiles are counted and timed as the steps' are (the engine's
`compilations`, `compile_s`), so that `seconds` (`EngineStats.encoder_s`) is the encoding alone and tokens/s,
compiles excluded, excludes the encoder's first compile too.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pagedjax.config import ModelSpec
from pagedjax.core.images import ImageInput
from pagedjax.runner.inputs import bucket
from pagedjax.runner.programs import ProgramCache, abstract_value

logger = logging.getLogger(__name__)


class ImageFeatures:
    """`array`: `[num_slots * tokens_per_image, hidden]` in the model's dtype (replicated over a tensor-parallel
    mesh): slot s's image in rows `[s * tokens_per_image, (s + 1) * tokens_per_image)`."""

    def __init__(self, graphdef: nnx.GraphDef, params: nnx.State, spec: ModelSpec, num_slots: int,
                 mesh: Mesh | None = None):
        images = spec.images
        self.tokens_per_image, self.image_size, self.num_slots = images.tokens_per_image, images.image_size, num_slots
        pixels = jax.ShapeDtypeStruct((1, 3, *images.image_size), jnp.float32)
        one = jax.eval_shape(lambda p, x: nnx.merge(graphdef, p).encode_images(x), params, pixels)
        shape, dtype = (num_slots * self.tokens_per_image, one.shape[-1]), one.dtype
        sharding = None if mesh is None else NamedSharding(mesh, PartitionSpec())
        self._fresh = lambda: (jnp.zeros(shape, dtype) if sharding is None
                               else jax.device_put(jnp.zeros(shape, dtype), sharding))
        self.array = self._fresh()
        self.seconds = 0.0  # spent encoding, results on device (compiles not included: `programs`)
        self.num_encoded = 0

        def encode(params, array, pixels, slots):
            features = nnx.merge(graphdef, params).encode_images(pixels)  # [n, tokens_per_image, hidden]
            rows = array.reshape(num_slots, self.tokens_per_image, -1)
            rows = rows.at[slots].set(features.astype(array.dtype), mode="drop")  # slot num_slots: padding
            return rows.reshape(array.shape)

        self._encode = jax.jit(encode, donate_argnums=(1,), out_shardings=sharding)
        # One program per power of two of images up to the slots': every one of them held.
        self.programs = ProgramCache(bucket(num_slots).bit_length(), background=False)

    def nbytes(self) -> int:
        return self.array.nbytes

    def encode(self, params: nnx.State, images: list[tuple[ImageInput, int]]) -> None:
        """Encode each `(image, slot)` into its slot (the plan's `encode_images`)."""
        if not images:
            return
        n = bucket(len(images))
        pixels = np.zeros((n, 3, *self.image_size), np.float32)
        slots = np.full((n,), self.num_slots, np.int32)
        for i, (image, slot) in enumerate(images):
            if image.pixel_values.shape != pixels.shape[1:]:
                raise ValueError(f"image {image.content_hash[:12]}: pixels of shape {image.pixel_values.shape}, the "
                                 f"model encodes {pixels.shape[1:]}")
            pixels[i], slots[i] = image.pixel_values, slot
        args = (params, self.array, pixels, slots)
        _, program = self.programs.lookup(EncodeShape(n), lambda: functools.partial(
            _compile, self._encode, jax.tree.map(abstract_value, args)))
        start = time.perf_counter()
        try:
            self.array = jax.block_until_ready(program(*args))
        except BaseException:
            # The array is donated: a call that failed after taking it leaves none. The host's accounting forgets
            # every cached image with the failed step (`Scheduler.cancel`), so a zero array is all it needs.
            if self.array.is_deleted():
                logger.error("the image feature array was lost with a failed encode: a fresh one is made")
                self.array = self._fresh()
            raise
        self.seconds += time.perf_counter() - start
        self.num_encoded += len(images)


class EncodeShape(NamedTuple):
    """The compiled signature of an encode: its count of images (a power of two)."""

    images: int


def _compile(jitted, args: tuple):
    return jitted.lower(*args).compile()
