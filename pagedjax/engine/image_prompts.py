"""Prompts with images, as vLLM takes them: `{"prompt": text, "multi_modal_data": {"image": image or [images]}}`
(or `"prompt_token_ids"` instead of `"prompt"`) -> the prompt's token ids, with each image's placeholders expanded
the way the model's processor does, and one `ImageInput` per image (its pixels, content hash and placeholders).

An image is a PIL image (made into pixels by the model's processor, `pagedjax.model.multimodal.processor`) or an array
of pixels already processed, float32 `[3, H, W]` at the model's `ImageSpec.image_size` (what a model of one's own
without a processor takes). A text prompt names each image by the processor's placeholder (`<image>` for LLaVA,
`<start_of_image>` for Gemma 3), expanded as transformers' processor expands it; a token-id prompt holds either one
placeholder id per image (expanded here) or the expanded placeholders already. Every mismatch (a count of
placeholders other than the count of images, images for a model that takes none, a placeholder run that is not
whole images) is an `InvalidRequest` (a ValueError; `pagedjax.errors`) naming the request, its `param` "prompt" or
"images"; images to a model that takes none are an `UnsupportedFeature`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

from pagedjax.config.multimodal import ImageSpec
from pagedjax.core.images import ImageInput, image_hash, placeholder_starts
from pagedjax.errors import InvalidRequest, InvalidType, UnsupportedFeature

PROMPT_KEYS = ("prompt", "prompt_token_ids", "multi_modal_data")


class EncodedPrompt(NamedTuple):
    """A prompt encoded (`LLMEngine.encode_prompt`): its token ids, each image's placeholders expanded, and one
    `ImageInput` per image (pixels, content hash, placeholders); `make_request` takes it as a prompt as it is."""

    token_ids: list[int]
    images: tuple[ImageInput, ...] = ()


def image_prompt(request_id: str, prompt: Mapping, *, spec: ImageSpec | None, processor,
                 encode_text: Callable[[str], list[int]], token_list: Callable[[Any], list[int]]
                 ) -> tuple[list[int], tuple[ImageInput, ...]]:
    """(token ids, images) of a prompt dict (see the module docstring). `spec`: the model's images (None: it takes
    none); `processor`: its `ImageProcessor`, or None; `encode_text`: text -> token ids (the engine's tokenizer);
    `token_list`: checks a token-id prompt."""
    where = f"request {request_id!r}"
    unknown = sorted(set(prompt) - set(PROMPT_KEYS))
    if unknown:
        raise InvalidRequest(f"{where}: unknown prompt keys {unknown} (a prompt dict takes "
                             f"{', '.join(PROMPT_KEYS)})", param="prompt")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise InvalidRequest(f"{where}: a prompt dict takes 'prompt' (text) or 'prompt_token_ids', one of them",
                             param="prompt")
    images = _images(where, prompt.get("multi_modal_data"))
    if images and spec is None:
        raise UnsupportedFeature(f"{where}: this model takes no images (multi_modal_data)", param="images",
                                 code="images_not_supported")
    text = "prompt" in prompt
    if text:
        if not isinstance(prompt["prompt"], str):
            raise InvalidType(f"{where}: 'prompt' must be a str, got {type(prompt['prompt']).__name__}",
                              param="prompt")
        ids = _text_ids(where, prompt["prompt"], len(images), processor, encode_text)
    else:
        ids = _token_ids(where, token_list(prompt["prompt_token_ids"]), len(images), spec, processor)
    if spec is None:
        return ids, ()
    try:
        starts = placeholder_starts(ids, spec.image_token_id, spec.tokens_per_image)
    except ValueError as e:
        raise InvalidRequest(f"{where}: {e}", param="prompt") from None
    if len(starts) != len(images):
        raise InvalidRequest(f"{where}: the prompt holds the placeholders of {len(starts)} images "
                             f"({spec.tokens_per_image} tokens {spec.image_token_id} each), but multi_modal_data has "
                             f"{len(images)}", param="images")
    if spec.bidirectional and any(b - a == spec.tokens_per_image for a, b in zip(starts, starts[1:], strict=False)):
        raise InvalidRequest(f"{where}: two images' placeholders are adjacent; this model's image tokens attend to "
                             "their neighbours both ways, so adjacent images would attend to each other (separate "
                             "them, as the processor's expansion does)", param="prompt")
    pixels = _pixels(where, images, spec, processor)
    return ids, tuple(ImageInput(image_hash(p), start, spec.tokens_per_image, p) for start, p in zip(starts, pixels,
                                                                                                    strict=True))


def _images(where: str, data) -> list:
    if data is None:
        return []
    if not isinstance(data, Mapping):
        raise InvalidType(f"{where}: multi_modal_data must be a dict, got {type(data).__name__}", param="images")
    unknown = sorted(set(data) - {"image"})
    if unknown:
        raise InvalidRequest(f"{where}: multi_modal_data takes 'image' only, got {unknown}", param="images")
    images = data.get("image")
    if images is None:
        return []
    return list(images) if isinstance(images, list | tuple) else [images]


def _text_ids(where: str, text: str, num_images: int, processor, encode_text) -> list[int]:
    if processor is None:
        if num_images:
            # without a processor a text prompt cannot say where an image's placeholders go
            raise UnsupportedFeature(f"{where}: images with a text prompt need the model's image processor (an "
                                     "engine from a model folder); give prompt_token_ids with the placeholders "
                                     "instead", param="images", code="image_processor_required")
        return encode_text(text)
    found = processor.count_images(text)
    if found != num_images:
        raise InvalidRequest(f"{where}: the prompt names {found} images ({processor.placeholder!r}), but "
                             f"multi_modal_data has {num_images}", param="images")
    return encode_text(processor.expand_prompt(text))


def _token_ids(where: str, ids: list[int], num_images: int, spec: ImageSpec | None, processor) -> list[int]:
    if spec is None or processor is None:
        return ids
    expanded = sum(1 for t in ids if t == spec.image_token_id)
    if expanded == num_images * spec.tokens_per_image:
        return ids  # every image's placeholders expanded already
    named = processor.count_images(ids)  # one placeholder id per image, to expand
    if named == num_images and (expanded == 0 or processor.placeholder_id == spec.image_token_id):
        return processor.expand_token_ids(ids)
    raise InvalidRequest(f"{where}: prompt_token_ids hold {named} image placeholders ({processor.placeholder_id}) "
                         f"and {expanded} image tokens ({spec.image_token_id}), but multi_modal_data has {num_images} "
                         "images", param="images")


def _pixels(where: str, images: list, spec: ImageSpec, processor) -> list[np.ndarray]:
    out = []
    shape = (3, *spec.image_size)
    for i, image in enumerate(images):
        if isinstance(image, np.ndarray):
            if image.dtype != np.float32 or image.shape != shape:
                raise InvalidRequest(f"{where}: image {i} is an array of {image.dtype}{list(image.shape)}; "
                                     f"processed pixels are float32{list(shape)}", param="images")
            out.append(image)
            continue
        if processor is None:
            raise InvalidType(f"{where}: image {i} is a {type(image).__name__}; without the model's image processor "
                              f"give processed pixels (float32 numpy arrays of {list(shape)})", param="images")
        try:
            out.append(processor.pixel_values([image])[0])
        except TypeError as e:
            raise InvalidType(f"{where}: image {i}: {e}", param="images") from None
    return out
