"""The images of a request's prompt, as the host sees them: where each one's placeholder tokens sit, what
identifies its pixels, and which rows of its features a step's tokens take. Plain data and numpy, no JAX.

A vision-language model (`ModelSpec.images`) turns one image's pixels into `length` feature rows
(`encode_images`); those rows replace the input embeddings of the image's placeholder tokens, prompt positions
`[offset, offset + length)`. An image's `content_hash` is part of the hash of every block its placeholders touch
(the same text with another image never shares a block) and keys the encoder cache (`core.encoder_cache`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from pagedjax.errors import InvalidRequest


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image of a prompt: its processed pixels and its placeholder tokens (see the module docstring)."""

    content_hash: str
    offset: int  # the prompt position of its first placeholder token
    length: int  # placeholder tokens = feature rows
    pixel_values: np.ndarray  # float32 [3, H, W], as the model's processor made them

    @property
    def end(self) -> int:
        """The position after its last placeholder token."""
        return self.offset + self.length


def image_hash(pixel_values: np.ndarray) -> str:
    """The content hash of processed pixels: their dtype, shape and bytes (what the model sees, so two files of
    the same picture that process alike share blocks)."""
    x = np.ascontiguousarray(pixel_values)
    digest = hashlib.sha256(f"{x.dtype.str}{x.shape}".encode())
    digest.update(x.tobytes())
    return digest.hexdigest()


def overlapping(images: Sequence[ImageInput], start: int, end: int) -> list[ImageInput]:
    """The images whose placeholder tokens meet positions [start, end), in prompt order."""
    return [im for im in images if im.offset < end and start < im.end]


def placeholder_starts(token_ids: Sequence[int], image_token_id: int, tokens_per_image: int) -> list[int]:
    """The first position of each image's `tokens_per_image` placeholders in a prompt's token ids, in order (a run
    of consecutive placeholders is one or more whole images). ValueError for a run that is not."""
    starts, run = [], 0
    for i, t in enumerate([*token_ids, None]):
        if t == image_token_id:
            run += 1
            continue
        if run % tokens_per_image:
            raise ValueError(f"a run of {run} image placeholder tokens ({image_token_id}) ending at position {i} is "
                             f"not whole images of {tokens_per_image}")
        starts.extend(range(i - run, i, tokens_per_image))
        run = 0
    return starts


def check_images(images: Sequence[ImageInput], prompt_len: int) -> None:
    """InvalidRequest (param "images") unless the images are in prompt order, each one's placeholders non-empty,
    inside the prompt and apart from the others'."""
    prev_end = 0
    for i, im in enumerate(images):
        if im.length < 1 or im.offset < prev_end or im.end > prompt_len:
            raise InvalidRequest(f"image {i}: placeholder tokens [{im.offset}, {im.end}) must be non-empty, inside "
                                 f"the {prompt_len}-token prompt, after the previous image's and in order",
                                 param="images")
        prev_end = im.end


class ImageSegment(NamedTuple):
    """Tokens [token, token + count) of a step (indices into its ragged token array) take feature rows
    [row, row + count) of image `content_hash`, held in encoder cache slot `slot`; its last placeholder sits at
    prompt position `last_position`."""

    content_hash: str
    slot: int
    row: int
    token: int
    count: int
    last_position: int


def step_segments(images: Sequence[ImageInput], start: int, count: int, first_token: int,
                  slot_of: Callable[[str], int]) -> list[ImageSegment]:
    """The segments of one sequence's `count` tokens from position `start`, laid out from step token
    `first_token`; `slot_of` gives each image's encoder cache slot."""
    out = []
    for im in overlapping(images, start, start + count):
        lo, hi = max(im.offset, start), min(im.end, start + count)
        out.append(ImageSegment(im.content_hash, slot_of(im.content_hash), lo - im.offset, first_token + lo - start,
                                hi - lo, im.end - 1))
    return out
