"""Images in `/v1/chat/completions`: OpenAI's `image_url` content parts (and vLLM's `{"image_url": "<url>"}`
shorthand), as data URLs only, decoded with Pillow under limits, for a model that takes images.

    data:image/png;base64,iVBORw0KGgo...

The server fetches nothing: an `http(s)://`, `file://` or any other URL is refused (400 naming the field,
`messages[i].content[j].image_url.url`). A data URL must be base64 (`;base64,`, the standard alphabet with its
padding, nothing else in it) of one of `MEDIA_TYPES` (image/png, image/jpeg, image/webp, image/gif); parameters
before `;base64` (`;name=x.png`) are allowed and unused. Only user messages take images (as OpenAI's API).

Every check runs before the work it bounds (`ImageLimits`, a flag each):
  1. before anything is decoded: the number of images (400), each one's bytes and all of them together (413; a
     base64 text's length gives its bytes exactly), each URL's scheme and media type;
  2. Pillow opens the bytes with the declared format's reader only (no other of Pillow's readers ever sees them);
     bytes that are another accepted format are refused as mismatched, anything else as unreadable (400);
  3. from the header, before any pixel is decoded: width x height against `max_image_pixels` (413; Pillow's own
     decompression-bomb guard is on too: `Image.MAX_IMAGE_PIXELS` is the same limit, its warning an error), a zero
     width or height (400), and more than one frame (400: an animated GIF, APNG or WebP is refused whole, never cut
     to its first frame; a single-frame GIF is taken). A JPEG carrying more pictures (MPO, from some cameras) is
     read as its primary picture, as every JPEG reader does;
  4. then the pixels are decoded: a truncated or corrupt image is a 400. The image is returned as transformers'
     `load_image` reads one (EXIF orientation applied, converted to RGB), fully loaded.

The server keeps serving whatever the bytes: every failure of Pillow on them is the request's 400. Decoding runs
in the request's prepare stage (a worker thread: never on the event loop or the engine thread).

For the chat template, an image part is `{"type": "image"}` in the message's `content` list, as transformers gives
Hugging Face templates (which write the model's placeholder: LLaVA's `<image>`, Gemma 3's `<start_of_image>`);
`ImageSupport` holds what the server needs of a model that takes images.
"""

from __future__ import annotations

import base64
import binascii
import io
import logging
import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedjax.serve.admission import DEFAULT_IMAGE_LIMITS, ImageLimits
from pagedjax.serve.errors import APIError, bad_request
from pagedjax.serve.protocol import ChatMessage

logger = logging.getLogger(__name__)

# Accepted media types -> Pillow's format names (the only readers Pillow may use on a client's bytes)
MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WEBP", "image/gif": "GIF"}
# Formats Pillow reports for a file of a declared format that are still that format
_ALSO = {"JPEG": ("MPO",)}  # a JPEG with more pictures (the first is the primary one)
_SHOWN = 60  # characters of a client's URL shown in an error


@dataclass(frozen=True)
class ImageRef:
    """One image part of a request: where it is (`messages[i].content[j]`), where its URL is, and the URL."""

    part: str  # "messages[0].content[1]"
    where: str  # "messages[0].content[1].image_url.url"
    url: str


@dataclass(frozen=True)
class DataURL:
    """A data URL checked for its form and size (not decoded yet)."""

    where: str
    media_type: str
    payload: str  # the base64 text
    size: int  # the bytes it decodes to (exact for valid base64)


def image_refs(messages: Sequence[ChatMessage]) -> list[ImageRef]:
    """The image parts of a chat, in order; 400 naming the part for one outside a user message."""
    refs = []
    for i, message in enumerate(messages):
        for j, part in message.image_parts():
            ref = ImageRef(f"messages[{i}].content[{j}]", f"messages[{i}].content[{j}].{part.url_field}", part.url)
            if message.role != "user":
                raise bad_request(f"{ref.part}: only user messages take images (this is a {message.role} message)",
                                  ref.part, "invalid_image_part")
            refs.append(ref)
    return refs


def _shown(url: str) -> str:
    return repr(url) if len(url) <= _SHOWN else f"{url[:_SHOWN]!r}... ({len(url):,} characters)"


def _too_large(where: str, what: str, limit: int, flag: str, code: str = "image_too_large") -> APIError:
    return APIError(413, f"{where}: {what}, more than the {limit:,} this server takes ({flag})", param=where,
                    code=code)


def parse_data_url(ref: ImageRef) -> DataURL:
    """`ref`'s URL as a base64 data URL of an accepted media type; 400 naming the field otherwise."""
    url, where = ref.url, ref.where
    scheme, colon, rest = url.partition(":")
    if not colon or scheme.lower() != "data":
        kind = f"a {scheme.lower()}: URL" if colon and scheme.isascii() and scheme.isalnum() and len(scheme) < 20 \
            else "not a data URL"
        raise bad_request(f"{where}: only data URLs are taken (data:image/png;base64,...): the server fetches "
                          f"nothing; got {kind} ({_shown(url)})", where, "invalid_image_url")
    header, comma, payload = rest.partition(",")
    if not comma:
        raise bad_request(f"{where}: a data URL has its data after a comma (data:image/png;base64,<data>); got "
                          f"{_shown(url)}", where, "invalid_image_url")
    media_type, *params = [p.strip() for p in header.split(";")]
    media_type = media_type.lower()
    if not params or params[-1].lower() != "base64" or any("=" not in p for p in params[:-1]):
        raise bad_request(f"{where}: the data URL must be base64 (data:{media_type or 'image/png'};base64,<data>); "
                          f"got the header {header[:_SHOWN]!r}", where, "invalid_image_url")
    if media_type not in MEDIA_TYPES:
        hint = " (image/jpeg is its name)" if media_type in ("image/jpg", "image/pjpeg") else ""
        raise bad_request(f"{where}: media type {media_type[:_SHOWN]!r} is not taken{hint}; images are "
                          f"{', '.join(MEDIA_TYPES)}", where, "unsupported_image_type")
    padding = len(payload) - len(payload.rstrip("="))
    return DataURL(where, media_type, payload, len(payload) * 3 // 4 - min(padding, 2))


def check_images(refs: Sequence[ImageRef], limits: ImageLimits = DEFAULT_IMAGE_LIMITS) -> list[DataURL]:
    """The request's images as data URLs, every limit on their number and bytes checked: nothing is decoded."""
    if len(refs) > limits.max_images_per_request:
        raise bad_request(f"messages: {len(refs):,} images, more than the {limits.max_images_per_request:,} this "
                          "server takes in one request (--max-images-per-request)", "messages", "too_many_images")
    urls = [parse_data_url(ref) for ref in refs]
    for url in urls:
        if url.size > limits.max_image_bytes:
            raise _too_large(url.where, f"an image of {url.size:,} bytes", limits.max_image_bytes,
                             "--max-image-bytes")
    total = sum(url.size for url in urls)
    if total > limits.max_image_bytes_per_request:
        raise _too_large("messages", f"{len(urls)} images of {total:,} bytes together",
                         limits.max_image_bytes_per_request, "--max-image-bytes-per-request", "images_too_large")
    return urls


def _invalid(where: str, what: str) -> APIError:
    return bad_request(f"{where}: {what}", where, "invalid_image")


def _bomb_guard(max_pixels: int) -> None:
    """Pillow's decompression-bomb guard at `max_pixels`, its warning an error (process-wide settings: set before
    each decode, so that they hold whatever else ran; one server per process sets the same values)."""
    from PIL import Image

    if Image.MAX_IMAGE_PIXELS != max_pixels:
        Image.MAX_IMAGE_PIXELS = max_pixels
    if not any(f[0] == "error" and f[2] is Image.DecompressionBombWarning for f in warnings.filters):
        warnings.filterwarnings("error", category=Image.DecompressionBombWarning)


def _png_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a PNG's IHDR, or None (for a clear message where Pillow only says it cannot read it)."""
    if data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and len(data) >= 24:
        return struct.unpack(">II", data[16:24])
    return None


def decode_image(url: DataURL, limits: ImageLimits = DEFAULT_IMAGE_LIMITS):
    """The image of a checked data URL as an RGB `PIL.Image.Image`, fully loaded (see the module docstring for the
    checks); 400 (413 for a size) naming the field for anything wrong with it."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    where, fmt = url.where, MEDIA_TYPES[url.media_type]
    try:
        data = base64.b64decode(url.payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise _invalid(where, f"the data is not valid base64 (the standard alphabet, padded, nothing else): {e}") \
            from None
    if not data:
        raise _invalid(where, "the image is empty")
    if len(data) > limits.max_image_bytes:  # (the length check before decoding holds; kept as the real bound)
        raise _too_large(where, f"an image of {len(data):,} bytes", limits.max_image_bytes, "--max-image-bytes")
    _bomb_guard(limits.max_image_pixels)
    pixels = f"the {limits.max_image_pixels:,} pixels (width x height) this server takes (--max-image-pixels)"
    try:
        try:
            image = Image.open(io.BytesIO(data), formats=[fmt])
        except UnidentifiedImageError:
            raise _unreadable(data, url) from None
        detected = image.format
        if detected != fmt and detected not in _ALSO.get(fmt, ()):
            raise _invalid(where, f"declared {url.media_type}, but the data is a {detected} image")
        width, height = image.size
        if width * height > limits.max_image_pixels:
            raise APIError(413, f"{where}: an image of {width:,} x {height:,} pixels, more than {pixels}",
                           param=where, code="image_too_large")
        if width < 1 or height < 1:
            raise _invalid(where, f"the image has no pixels ({width} x {height})")
        if getattr(image, "is_animated", False) and detected == fmt:
            raise _invalid(where, f"an animated {fmt} ({getattr(image, 'n_frames', 'several')} frames) is not "
                                  "taken: send one frame (a still image)")
        image.load()
        return ImageOps.exif_transpose(image).convert("RGB")
    except APIError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise APIError(413, f"{where}: the image is larger than {pixels} ({e})", param=where,
                       code="image_too_large") from None
    except Exception as e:  # noqa: BLE001 - Pillow on hostile bytes: whatever it raises is this image's fault
        message = str(e)[:200] or type(e).__name__
        raise _invalid(where, f"the {fmt} image cannot be decoded (truncated or corrupt?): {message}") from None


def _unreadable(data: bytes, url: DataURL) -> APIError:
    """The error for bytes the declared format's reader does not take: another accepted format's, a zero-size PNG,
    or neither."""
    from PIL import Image

    fmt = MEDIA_TYPES[url.media_type]
    try:
        detected = Image.open(io.BytesIO(data), formats=list(MEDIA_TYPES.values())).format
    except Exception:  # noqa: BLE001 - not any accepted format either
        detected = None
    if detected is not None:
        return _invalid(url.where, f"declared {url.media_type}, but the data is a {detected} image")
    size = _png_size(data) if fmt == "PNG" else None
    if size is not None and 0 in size:
        return _invalid(url.where, f"the image has no pixels ({size[0]} x {size[1]})")
    return _invalid(url.where, f"the data is not a {fmt} image Pillow can read (not one, or corrupt)")


class ImageSupport:
    """What the server needs of a model that takes images: its processor (the engine's `image_processor`, which
    expands each image's placeholder into the tokens its features take and makes the pixels), the limits, and
    whether the chat template reads text only from content parts.

    processor      the engine's `pagedjax.model.processor.ImageProcessor`: `placeholder` (the text that stands for
                   one image in a prompt), `count_images(text)`, `expand_prompt(text)`, `pixel_values(images)`.
    content_parts  the template reads a message's text only from a list of parts (as LLaVA's Hugging Face
                   templates do): every message's content goes to it as parts (`ChatTemplate.reads_content_parts`).
    """

    def __init__(self, processor: Any, limits: ImageLimits = DEFAULT_IMAGE_LIMITS, *, content_parts: bool = False):
        if not isinstance(limits, ImageLimits):
            raise TypeError(f"limits must be ImageLimits, got {type(limits).__name__}")
        self.processor = processor
        self.limits = limits
        self.content_parts = content_parts

    @classmethod
    def for_engine(cls, llm: Any, template: Any, limits: ImageLimits = DEFAULT_IMAGE_LIMITS) -> ImageSupport | None:
        """The support of `llm`'s model for images, or None when it takes none (`model_spec.images` absent or
        None); ValueError for a model that takes images whose engine has no `image_processor`."""
        if getattr(llm.model_spec, "images", None) is None:
            return None
        processor = getattr(llm, "image_processor", None)
        if processor is None:
            raise ValueError("the model takes images (model_spec.images), but its engine has no image_processor: the "
                             "server needs it to expand an image prompt's placeholders and make its pixels")
        return cls(processor, limits, content_parts=template.reads_content_parts)

    def expand(self, text: str, num_images: int) -> str:
        """A rendered chat's text with each image placeholder expanded into the tokens its features take, as
        transformers' processor expands it (before tokenizing: Gemma 3's newlines around an image then tokenize as
        its processor's do). 400 unless it has one placeholder per image (a template that does not render image
        parts, or a message whose text holds the placeholder itself)."""
        found = self.processor.count_images(text)
        if found != num_images:
            raise bad_request(f"messages: the prompt has {found} image placeholders ({self.processor.placeholder!r}) "
                              f"for the request's {num_images} images: the chat template must write one per image "
                              "part, and a message's text must not contain the placeholder itself", "messages",
                              "invalid_image_part")
        return self.processor.expand_prompt(text)

    def pixels(self, images: list) -> tuple:
        """Decoded images as the model's pixels (float32 `[3, H, W]` each): the processor's resizing and
        normalizing, done in the server's prepare stage rather than on the engine thread."""
        return tuple(self.processor.pixel_values(images))
