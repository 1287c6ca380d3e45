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
  4. then the pixels are decoded (`load_image`): a truncated or corrupt image is a 400. The image is read as
     transformers' `load_image` reads one (converted to RGB, EXIF orientation applied), then made the model's
     pixels by its processor.

The server keeps serving whatever the bytes: every failure of Pillow on them is the request's 400. Steps 1-3 run
in the request's prepare stage (a worker thread); step 4 in the image pool (`ImageSupport`: `IMAGE_WORKERS`
threads at a lower priority than the engine's; never the event loop, the engine thread or the threads that
prepare other requests), within a server-wide budget of decoded pixels (`--max-decoding-pixels`, `PixelBudget`):
an image waits, first come first served, until it fits beside those being decoded, and a request's images are
decoded one after another, each decoded image dropped once its pixels are made, so the server holds at most the
budget's decoded pixels (plus, for an image not RGB, its RGB conversion) whatever its clients send. At most
`--max-queued-image-requests` requests wait or decode (more: 503). After a burst of large decodes the freed memory
goes back to the system (`pagedjax.serve.memory.trim_heap`).

Reduced decoding: the model's processor resizes every image to its small input (LLaVA 1.5: 336 x 336), so a large
image is shrunk first, as far as the processor's `reduce_factor` allows (at least `REDUCING_GAP` = 3 source pixels
per output pixel left along each axis): a JPEG is decoded at 1/2, 1/4 or 1/8 of its size (libjpeg's DCT scaling,
`Image.draft`), anything else is decoded whole and box-averaged (`Image.reduce`) before the processor's resize.
An image within 3x the model's input (in its short side, or its long side for a processor that pads to a square)
is decoded and resized exactly as the processor does it. A larger one's pixels differ from the processor's on the
full image: the resize's filter reads box averages of the image instead of its pixels (and libjpeg's scaled DCT
instead of the full decode), and an image whose sides are not multiples of the factor has a last, partial box
that the resize counts as a whole pixel (its geometry off by under one source pixel in 3). Measured on the
test images (`tests/serve/test_images_serving.py`): at most a few levels of 255 in a pixel, and the same tokens.

For the chat template, an image part is `{"type": "image"}` in the message's `content` list, as transformers gives
Hugging Face templates (which write the model's placeholder: LLaVA's `<image>`, Gemma 3's `<start_of_image>`);
`ImageSupport` holds what the server needs of a model that takes images.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import io
import logging
import struct
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pagedjax.runner.programs import lower_priority
from pagedjax.serve.admission import DEFAULT_IMAGE_LIMITS, ImageLimits
from pagedjax.serve.errors import APIError, bad_request
from pagedjax.serve.memory import trim_heap
from pagedjax.serve.protocol import ChatMessage

logger = logging.getLogger(__name__)

# Accepted media types -> Pillow's format names (the only readers Pillow may use on a client's bytes)
MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WEBP", "image/gif": "GIF"}
# Formats Pillow reports for a file of a declared format that are still that format
_ALSO = {"JPEG": ("MPO",)}  # a JPEG with more pictures (the first is the primary one)
_SHOWN = 60  # characters of a client's URL shown in an error
# Threads that decode images (`ImageSupport`): two, so that one large image does not hold up every other
# request's, and no more, since each competes with the engine's steps for the cores of a small machine.
IMAGE_WORKERS = 2
# Decoded pixels after which the image pool gives the freed memory back (`trim_heap`, queued in the pool when a
# decode ends and none other holds the budget: a request's next image may start beside it): about one 2048 x 2048
# image, the size from which glibc's arenas keep what Pillow frees (its blocks of up to 16 MiB, see
# `pagedjax.serve.memory`).
TRIM_AFTER_PIXELS = 2048 * 2048


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


@dataclass(frozen=True)
class OpenedImage:
    """An image whose header passed every check (`open_image`), its pixels not decoded yet (`load_image`)."""

    where: str
    image: Any  # a PIL.Image.Image opened on the encoded bytes, not loaded; a JPEG set to decode at its draft size
    reduce: int  # the factor `load_image` shrinks it by once decoded (1: not at all)

    @property
    def pixels(self) -> int:
        """The pixels decoding it makes (width x height, a JPEG's at its draft size): the pixel budget's unit."""
        width, height = self.image.size
        return width * height


@contextlib.contextmanager
def _pillow_errors(where: str, fmt: str, limit: str):
    """Pillow's failures on a client's bytes as the request's 400 (413 for its decompression-bomb guard, past
    `limit`); an APIError passes."""
    from PIL import Image

    try:
        yield
    except APIError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise APIError(413, f"{where}: the image is larger than {limit} ({e})", param=where,
                       code="image_too_large") from None
    except Exception as e:  # noqa: BLE001 - Pillow on hostile bytes: whatever it raises is this image's fault
        message = str(e)[:200] or type(e).__name__
        raise _invalid(where, f"the {fmt} image cannot be decoded (truncated or corrupt?): {message}") from None


def _pixels_text(limits: ImageLimits) -> str:
    return f"the {limits.max_image_pixels:,} pixels (width x height) this server takes (--max-image-pixels)"


def open_image(url: DataURL, limits: ImageLimits = DEFAULT_IMAGE_LIMITS,
               reduce_factor: Callable[[int, int], int] | None = None) -> OpenedImage:
    """A checked data URL's image opened and its header checked (steps 2 and 3 of the module docstring), nothing
    decoded; 400 (413 for a size) naming the field for anything wrong with it. `reduce_factor(width, height)`: how
    far the model's processor lets the image shrink before its resize (`ImageProcessor.reduce_factor`; None: not
    at all): a JPEG is then set to decode at the smallest of its draft sizes (1/2, 1/4, 1/8) within that, and
    `load_image` box-reduces what is left of the factor."""
    from PIL import Image, UnidentifiedImageError

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
    with _pillow_errors(where, fmt, _pixels_text(limits)):
        try:
            image = Image.open(io.BytesIO(data), formats=[fmt])
        except UnidentifiedImageError:
            raise _unreadable(data, url) from None
        detected = image.format
        if detected != fmt and detected not in _ALSO.get(fmt, ()):
            raise _invalid(where, f"declared {url.media_type}, but the data is a {detected} image")
        width, height = image.size
        if width * height > limits.max_image_pixels:
            raise APIError(413, f"{where}: an image of {width:,} x {height:,} pixels, more than "
                                f"{_pixels_text(limits)}", param=where, code="image_too_large")
        if width < 1 or height < 1:
            raise _invalid(where, f"the image has no pixels ({width} x {height})")
        if getattr(image, "is_animated", False) and detected == fmt:
            raise _invalid(where, f"an animated {fmt} ({getattr(image, 'n_frames', 'several')} frames) is not "
                                  "taken: send one frame (a still image)")
        factor = 1 if reduce_factor is None else reduce_factor(width, height)
        scale = min(8, factor & -factor)  # libjpeg's scales that divide the factor: 1, 2, 4, 8
        if scale > 1 and fmt == "JPEG" and image.draft(image.mode, (width // scale, height // scale)) is not None:
            factor //= scale
        return OpenedImage(where, image, factor)


def load_image(opened: OpenedImage):
    """An opened image's pixels as an RGB `PIL.Image.Image`, as transformers' `load_image` reads an image
    (converted to RGB, EXIF orientation applied), shrunk by `opened.reduce` (box averages, after the conversion);
    400 naming the field for a truncated or corrupt image. Each full-size image it makes is dropped before the
    next is made (at most the decoded image and its RGB conversion at once)."""
    from PIL import ImageOps

    image = opened.image
    fmt = image.format or "image"
    with _pillow_errors(opened.where, fmt, "the pixels this server takes"):
        image.load()
        if image.mode != "RGB":
            image = image.convert("RGB")
        if opened.reduce > 1:
            image = image.reduce(opened.reduce)
        ImageOps.exif_transpose(image, in_place=True)
        return image


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


class PixelBudget:
    """The server's budget of decoded pixels (`ImageLimits.max_decoding_pixels`), shared by every request's images.
    `acquire(n)` waits until `n` pixels fit beside those held and every earlier waiter got its share (first come,
    first served: a small image never overtakes a large one, which could then wait for ever), then holds them; an
    image of more pixels than the whole budget waits for all of it and holds all of it. `release(n)` gives them
    back. On the event loop only (not thread-safe). Invariant: `held <= capacity`."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.held = 0
        self._waiters: deque[tuple[int, asyncio.Future]] = deque()

    @property
    def waiting(self) -> int:
        """Acquires waiting for room (cancelled ones not yet passed over included)."""
        return len(self._waiters)

    async def acquire(self, pixels: int) -> int:
        """Hold `pixels` (at most the capacity) once they fit; the pixels held, which the caller must `release`."""
        need = min(pixels, self.capacity)
        if not self._waiters and self.held + need <= self.capacity:
            self.held += need
            return need
        granted = asyncio.get_running_loop().create_future()
        self._waiters.append((need, granted))
        try:
            await granted
        except asyncio.CancelledError:
            if granted.cancelled():  # still waiting: pass it over (it may have been first in line)
                self._grant()
            else:  # granted as it was cancelled
                self.release(need)
            raise
        return need

    def release(self, pixels: int) -> None:
        self.held -= pixels
        self._grant()

    def _grant(self) -> None:
        while self._waiters:
            need, granted = self._waiters[0]
            if not granted.cancelled() and self.held + need > self.capacity:
                return
            self._waiters.popleft()
            if not granted.cancelled():
                self.held += need
                granted.set_result(None)


class ImageSupport:
    """What the server needs of a model that takes images: its processor (the engine's `image_processor`, which
    expands each image's placeholder into the tokens its features take and makes the pixels), the limits, and
    whether the chat template reads text only from content parts; and the image pool, where images are decoded.

    processor      the engine's `pagedjax.model.multimodal.processor.ImageProcessor`: `placeholder` (the text that
                   stands for one image in a prompt), `count_images(text)`, `expand_prompt(text)`,
                   `pixel_values(images)`, and optionally `reduce_factor(width, height)` (how far an image may shrink
                   before its resize).
    content_parts  the template reads a message's text only from a list of parts (as LLaVA's Hugging Face
                   templates do): every message's content goes to it as parts (`ChatTemplate.reads_content_parts`).

    A request's images are opened and their headers checked in its prepare stage (`open`: every 400 and 413 before
    it waits for anything), then decoded and made the model's pixels (`pixels`) in the image pool: `IMAGE_WORKERS`
    threads at a lower scheduling priority than the engine's, within the server's `PixelBudget`. `close()` ends
    the pool.
    """

    def __init__(self, processor: Any, limits: ImageLimits = DEFAULT_IMAGE_LIMITS, *, content_parts: bool = False):
        if not isinstance(limits, ImageLimits):
            raise TypeError(f"limits must be ImageLimits, got {type(limits).__name__}")
        self.processor = processor
        self.limits = limits
        self.content_parts = content_parts
        self.budget = PixelBudget(limits.max_decoding_pixels)
        self._pool = ThreadPoolExecutor(IMAGE_WORKERS, thread_name_prefix="pagedjax-image", initializer=lower_priority)
        self._requests = 0  # in the decode stage, waiting or decoding (event loop side)
        self._since_trim = 0  # pixels decoded since the heap was last trimmed (event loop side)

    def close(self) -> None:
        """End the image pool (the server's shutdown): decodes not started are cancelled."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    @classmethod
    def for_engine(cls, llm: Any, template: Any, limits: ImageLimits = DEFAULT_IMAGE_LIMITS) -> ImageSupport | None:
        """The support of `llm`'s model for images (an `AsyncLLMEngine`, or anything with its `model_spec` and
        `image_processor`), or None when it takes none (`model_spec.images` absent or None); ValueError for a model
        that takes images whose engine has no `image_processor`."""
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

    def open(self, urls: Sequence[DataURL]) -> list[OpenedImage]:
        """A request's checked data URLs opened and every header checked (`open_image`), nothing decoded; a JPEG
        set to decode no larger than the processor's `reduce_factor` lets it."""
        factor = getattr(self.processor, "reduce_factor", None)
        return [open_image(url, self.limits, factor) for url in urls]

    async def pixels(self, opened: Sequence[OpenedImage]) -> tuple:
        """A request's opened images as the model's pixels (the processor's, one per image), each decoded in the
        image pool once the pixel budget has room for it: one image after another, requests first come first
        served, every decoded image dropped once its pixels are made. 503 when `max_queued_image_requests`
        requests are already waiting or decoding; 400 naming the field for an image that does not decode."""
        if self._requests >= self.limits.max_queued_image_requests:
            raise APIError(503, f"The server is overloaded: {self._requests} requests' images are waiting to be "
                                "decoded or decoding (--max-queued-image-requests); retry later",
                           code="image_decodes_full", headers={"Retry-After": "1"})
        self._requests += 1
        loop = asyncio.get_running_loop()
        try:
            out = []
            for image in opened:
                held = await self.budget.acquire(image.pixels)
                job = self._pool.submit(self._pixels_of, image)
                # released when the decode ends, not when this request stops waiting for it (a cancelled wait)
                job.add_done_callback(lambda _, held=held: _call_soon(loop, self._decoded, held))
                out.append(await asyncio.wrap_future(job))
            return tuple(out)
        finally:
            self._requests -= 1

    def _pixels_of(self, opened: OpenedImage):  # in the image pool
        try:
            return self.processor.pixel_values([load_image(opened)])[0]
        finally:
            opened.image.close()  # its decoded pixels and encoded bytes: nothing refers to them any more

    def _decoded(self, held: int) -> None:  # on the event loop: a decode ended
        self.budget.release(held)
        self._since_trim += held
        if self.budget.held == 0 and self._since_trim >= TRIM_AFTER_PIXELS:
            self._since_trim = 0
            self._pool.submit(trim_heap)


def _call_soon(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # the event loop is closed (the server stopped): nothing waits for the budget any more
        logger.debug("an image decode ended after the event loop closed")
