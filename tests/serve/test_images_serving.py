"""Images in /v1/chat/completions (`pagedjax.serve.images`): data URLs only, decoded under limits, refused with a
clear 400 (413 for a size) naming the field, and the server serving normally after every hostile input.

One server per module, over the tests' small text model. Most of the tests give it a stand-in for a model that
takes images (the `vision` fixture: an image processor whose placeholder is "@", a chat template that writes "@"
for an image part, and an engine `make_request` that expands the placeholders and records what it got), so that
everything up to the engine runs as it does for a vision-language model; `test_a_vision_model_end_to_end` needs a
real one. Every image is made here with Pillow: no files, no network.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import dataclasses
import io
import json
import os
import struct
import threading
import weakref
import zlib
from unittest import mock

import httpx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageFile

from pagedjax.runner.programs import COMPILE_NICENESS
from pagedjax.serve.admission import ImageLimits
from pagedjax.serve.chat_template import DEFAULT_TEMPLATE, ChatTemplate
from pagedjax.serve.errors import APIError
from pagedjax.serve.images import DataURL, ImageSupport, PixelBudget, load_image, open_image
from tests.serve.server_utils import MAX_MODEL_LEN, MODEL_NAME, make_engine, running_server, sse_events

LIMITS = ImageLimits(max_images_per_request=3, max_image_bytes=64 * 2**10, max_image_bytes_per_request=100 * 2**10,
                     max_image_pixels=250_000)
TOKENS_PER_IMAGE = 8
# The default template, with "@" written for an image part (a model's template writes its placeholder)
PARTS_TEMPLATE = (
    "{% for message in messages %}# {{ message['role'] }}:\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}@{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}# assistant:\n{% endif %}"
)


class Processor:
    """A stand-in for the engine's image processor: "@" (a byte token) stands for an image in a prompt and becomes
    `tokens_per_image` "%" tokens; an image's "pixels" are the decoded image's own array (the tests read its size)."""

    placeholder = "@"
    expanded = "%"

    def __init__(self, tokens_per_image: int = TOKENS_PER_IMAGE):
        self.tokens_per_image = tokens_per_image

    def count_images(self, text: str) -> int:
        return text.count(self.placeholder)

    def expand_prompt(self, text: str) -> str:
        return text.replace(self.placeholder, self.expanded * self.tokens_per_image)

    def pixel_values(self, images):
        return [np.asarray(image) for image in images]


def expanded(text: str, tokens_per_image: int = TOKENS_PER_IMAGE) -> str:
    """A prompt's text as the engine gets it: each "@" expanded."""
    return Processor(tokens_per_image).expand_prompt(text)


@pytest.fixture(scope="module", autouse=True)
def pillow_limit():
    """Pillow's (process-wide) pixel limit as it was, after the module: decoding sets it to the limits'."""
    before = Image.MAX_IMAGE_PIXELS
    yield
    Image.MAX_IMAGE_PIXELS = before


@pytest.fixture(scope="module")
def server():
    with running_server(make_engine()) as server:
        yield server


@pytest.fixture
def vision(server, monkeypatch):
    """The server as for a model that takes images (see the module docstring); the prompts the engine got."""
    serving = server.app.state.serving
    support = ImageSupport(Processor(), LIMITS)
    monkeypatch.setattr(serving, "images", support)
    monkeypatch.setattr(serving, "chat_template", ChatTemplate(PARTS_TEMPLATE))
    prompts: list[dict] = []
    real = server.llm.encode_prompt

    def encode_prompt(request_id, prompt):
        if isinstance(prompt, dict):  # the interface of an engine whose model takes images
            try:
                asyncio.get_running_loop()
                on_loop = True
            except RuntimeError:
                on_loop = False
            prompts.append({**prompt, "thread": threading.current_thread().name, "on_loop": on_loop})
            assert sorted(prompt) == ["multi_modal_data", "prompt_token_ids"]
            images = prompt["multi_modal_data"]["image"]
            per_image = serving.images.processor.tokens_per_image
            assert prompt["prompt_token_ids"].count(ord(Processor.expanded)) == len(images) * per_image
            prompt = prompt["prompt_token_ids"]  # (the text model takes the expanded tokens as text)
        return real(request_id, prompt)

    monkeypatch.setattr(server.llm, "encode_prompt", encode_prompt)
    yield prompts
    support.close()


# ---------------------------------------------------------------------------------------------------- helpers
def encoded(image: Image.Image, fmt: str = "PNG", **save) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **save)
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


SMALL_PNG = data_url(encoded(Image.new("RGB", (6, 4), "red")))


def chat(server, content, *, messages=None, **body) -> httpx.Response:
    messages = messages if messages is not None else [{"role": "user", "content": content}]
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                      json={"model": MODEL_NAME, "messages": messages, "max_tokens": 2, **body})


def assert_error(response: httpx.Response, status: int, param: str, says: str, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert code is None or error["code"] == code, error
    assert len(error["message"]) < 600, error  # a client's megabytes are never echoed
    return error


def assert_serving(server, with_image: bool = True) -> None:
    """A normal request is served (with an image when the server takes them)."""
    assert httpx.get(f"{server.url}/health").status_code == 200
    content = [{"type": "text", "text": "What is this?"}, *([image_part(SMALL_PNG)] if with_image else [])]
    response = chat(server, content)
    assert response.status_code == 200, response.text


def png_bytes(width: int, height: int, idat: bytes = b"") -> bytes:
    """A PNG made by hand: its header says `width` x `height` (RGB, 8 bits), whatever its data holds."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat or zlib.compress(b"\0" * 64))
            + chunk(b"IEND", b""))


def frames(fmt: str) -> bytes:
    """An animated image of two frames."""
    first, second = Image.new("RGB", (8, 8), "red"), Image.new("RGB", (8, 8), "blue")
    return encoded(first, fmt, save_all=True, append_images=[second])


def noise(width: int, height: int) -> Image.Image:
    return Image.effect_noise((width, height), 64).convert("RGB")


# ------------------------------------------------------------------------------------------ a text-only model
def test_an_image_part_to_a_text_model_is_refused(server):
    for content in ([{"type": "text", "text": "What is this?"}, image_part(SMALL_PNG)], [{"image_url": SMALL_PNG}]):
        j = len(content) - 1
        assert_error(chat(server, content), 400, f"messages[0].content[{j}]",
                     "this model (pagedjax-tiny) does not take images", "images_not_supported")
    # before its URL is looked at: any image part
    assert_error(chat(server, [image_part("https://example.com/cat.png")]), 400, "messages[0].content[0]",
                 "does not take images")
    assert_serving(server, with_image=False)


def test_completions_take_no_images(server):
    url = f"{server.url}/v1/completions"
    response = httpx.post(url, json={"model": MODEL_NAME, "prompt": [image_part(SMALL_PNG)], "max_tokens": 2})
    assert_error(response, 400, "prompt", "prompt: must be")
    response = httpx.post(url, json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2,
                                     "multi_modal_data": {"image": [SMALL_PNG]}})
    assert_error(response, 400, "multi_modal_data", "unknown field 'multi_modal_data'")
    assert_serving(server, with_image=False)


def test_text_parts_are_rendered_as_one_string_as_before(server):
    """A text model's chat of text parts is the same prompt as their text in one string (today's behaviour)."""
    parts = chat(server, [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world."}], temperature=0)
    whole = chat(server, "Hello, world.", temperature=0)
    assert parts.status_code == whole.status_code == 200, parts.text
    assert parts.json()["usage"] == whole.json()["usage"]
    assert parts.json()["choices"][0]["message"] == whole.json()["choices"][0]["message"]


NESTED = [[[{"type": "text", "text": "x"}]]]


@pytest.mark.parametrize(("content", "says"), [
    ([{"type": "image"}], 'part 0: type must be "text" or "image_url" (got \'image\')'),
    ([{"type": "input_audio", "input_audio": {}}], "got 'input_audio'"),
    ([{"type": 7}], 'type must be "text" or "image_url" (got a number)'),
    ([{"text": "x"}], 'part 0: has no "type"'),
    ([{"type": "text", "text": "x"}, None], "part 1: must be an object"),
    (NESTED, "part 0: must be an object"),
    ([{"type": "text", "text": 5}], "part 0: text: Input should be a valid string"),
    ([{"type": "text", "text": "x", "image_url": SMALL_PNG}], "part 0: unknown field 'image_url'"),
    ([{"type": "image_url", "image_url": SMALL_PNG}], 'image_url must be an object {"url": ...}'),
    ([{"type": "image_url", "image_url": {"url": 5}}], "part 0: image_url.url: Input should be a valid string"),
    ([{"type": "image_url", "image_url": {"url": SMALL_PNG, "detail": "max"}}], "image_url.detail"),
    ([{"type": "image_url", "image_url": {"url": SMALL_PNG, "size": 1}}], "unknown field 'image_url.size'"),
    ([{"image_url": {"url": SMALL_PNG}}], "part 0: image_url: Input should be a valid string"),
    ({"type": "text", "text": "x"}, "must be a string, a list of content parts or null, got an object"),
    (5, "must be a string, a list of content parts or null"),
])
def test_malformed_content_parts_are_refused_naming_the_part(server, content, says):
    error = assert_error(chat(server, None, messages=[{"role": "user", "content": "Hi."},
                                                      {"role": "user", "content": content}]), 400, "messages", says)
    assert error["message"].startswith("messages.1.content: "), error
    assert_serving(server, with_image=False)


def test_content_nested_past_the_json_parsers_depth_is_refused(server):
    content = "[" * 100_000 + '"x"' + "]" * 100_000
    body = json.dumps({"model": MODEL_NAME, "messages": [{"role": "user", "content": "CONTENT"}]}).replace(
        '"CONTENT"', content)
    response = httpx.post(f"{server.url}/v1/chat/completions", content=body.encode(), timeout=60)
    assert_error(response, 400, None, "the body is not valid JSON: recursion limit exceeded")
    assert_serving(server, with_image=False)


# ------------------------------------------------------------------------------------ a model that takes images
def test_images_reach_the_engine_decoded_and_in_order(server, vision):
    rgba = Image.new("RGBA", (13, 7), (0, 0, 255, 128))
    rotated = Image.new("RGB", (20, 10), "green")
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees on display
    mpo = encoded(Image.new("RGB", (9, 5)), "MPO", save_all=True, append_images=[Image.new("RGB", (3, 3))])
    content = [
        {"type": "text", "text": "Compare "},
        image_part(data_url(encoded(rgba))),
        {"type": "text", "text": " with "},
        {"image_url": data_url(encoded(rotated, "JPEG", exif=exif), "image/jpeg")},  # vLLM's shorthand
        {"type": "image_url", "image_url": {"url": data_url(encoded(Image.new("P", (5, 3)), "GIF"), "IMAGE/GIF"),
                                            "detail": "low"}},
    ]
    response = chat(server, content, max_tokens=3, temperature=0)
    assert response.status_code == 200, response.text
    (prompt,) = vision
    images = prompt["multi_modal_data"]["image"]
    assert [im.shape for im in images] == [(7, 13, 3), (20, 10, 3), (3, 5, 3)]  # RGB, EXIF-rotated
    text = bytes(t for t in prompt["prompt_token_ids"] if t < 256).decode()
    assert text == expanded("# user:\nCompare @ with @@\n# assistant:\n")
    assert response.json()["usage"]["prompt_tokens"] == len(prompt["prompt_token_ids"])
    # Encoded (pixels, hashes) in a worker thread: neither the engine's nor the event loop.
    assert prompt["thread"] != "pagedjax-engine" and not prompt["on_loop"]
    # A JPEG with more pictures (MPO) is its primary one; WebP is taken too; more requests, more prompts
    for url, size in ((data_url(mpo, "image/jpeg"), (9, 5)),
                      (data_url(encoded(noise(7, 6), "WEBP"), "image/webp"), (7, 6))):
        assert chat(server, [image_part(url)]).status_code == 200
        assert vision[-1]["multi_modal_data"]["image"][0].shape == (size[1], size[0], 3)


def test_images_are_decoded_in_a_worker_thread(server, vision, monkeypatch):
    import pagedjax.serve.images as images_module

    threads = []
    real = images_module.load_image

    def decode(*args):
        try:
            asyncio.get_running_loop()
            loop = True
        except RuntimeError:
            loop = False
        threads.append((threading.current_thread().name, loop))
        return real(*args)

    monkeypatch.setattr(images_module, "load_image", decode)
    assert chat(server, [image_part(SMALL_PNG)]).status_code == 200
    (name, loop), = threads
    assert not loop and name.startswith("pagedjax-image"), threads  # the image pool: neither loop nor engine


def test_the_expanded_prompt_counts_for_the_context(server, vision, monkeypatch):
    monkeypatch.setattr(server.app.state.serving, "images", ImageSupport(Processor(120), LIMITS))
    response = chat(server, [{"type": "text", "text": "Two:"}, image_part(SMALL_PNG)])  # max_tokens: up to the end
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == len("# user:\nTwo:@\n# assistant:\n") + 1 + 119
    response = chat(server, [image_part(SMALL_PNG), image_part(SMALL_PNG)], max_tokens=None)
    assert_error(response, 400, "messages", f"maximum context length is {MAX_MODEL_LEN} tokens",
                 "context_length_exceeded")
    assert vision[-1]["prompt_token_ids"].count(ord(Processor.expanded)) == 120  # the refused one never got there


BMP = encoded(Image.new("RGB", (4, 4)), "BMP")
PNG = encoded(noise(32, 32))
JPEG = encoded(noise(32, 32), "JPEG")
URL_FIELD = "messages[0].content[0].image_url.url"
HOSTILE = {
    # name: (url, status, code, what the message says)
    "http": ("http://example.com/cat.png", 400, "invalid_image_url", "only data URLs are taken"),
    "https": ("https://169.254.169.254/latest/meta-data", 400, "invalid_image_url", "the server fetches nothing"),
    "file": ("file:///etc/passwd", 400, "invalid_image_url", "got a file: URL"),
    "no scheme": ("cat.png", 400, "invalid_image_url", "got not a data URL"),
    "no comma": ("data:image/png;base64", 400, "invalid_image_url", "has its data after a comma"),
    "not base64": ("data:image/png,%89PNG", 400, "invalid_image_url", "must be base64"),
    "bad base64 alphabet": ("data:image/png;base64,iVBO@@@@", 400, "invalid_image", "not valid base64"),
    "base64 padding": ("data:image/png;base64,iVBOR", 400, "invalid_image", "not valid base64"),
    "base64 with newlines": (data_url(PNG).replace("A", "A\n", 1), 400, "invalid_image", "not valid base64"),
    "url-safe base64": ("data:image/png;base64,-_-_", 400, "invalid_image", "not valid base64"),
    "non-ascii": ("data:image/png;base64,ééé=", 400, "invalid_image", "not valid base64"),
    "empty": ("data:image/png;base64,", 400, "invalid_image", "the image is empty"),
    "bmp": (data_url(BMP, "image/bmp"), 400, "unsupported_image_type", "media type 'image/bmp' is not taken"),
    "svg": ("data:image/svg+xml;base64,PHN2Zy8+", 400, "unsupported_image_type", "'image/svg+xml' is not taken"),
    "jpg": (data_url(JPEG, "image/jpg"), 400, "unsupported_image_type", "(image/jpeg is its name)"),
    "text": ("data:text/plain;base64,aGk=", 400, "unsupported_image_type", "'text/plain' is not taken"),
    "jpeg as png": (data_url(JPEG), 400, "invalid_image", "declared image/png, but the data is a JPEG image"),
    "png as jpeg": (data_url(PNG, "image/jpeg"), 400, "invalid_image", "declared image/jpeg, but the data is a PNG"),
    "bmp as png": (data_url(BMP), 400, "invalid_image", "not a PNG image Pillow can read"),
    "text as png": (data_url(b"hello, world"), 400, "invalid_image", "not a PNG image Pillow can read"),
    "truncated png": (data_url(PNG[:len(PNG) // 2]), 400, "invalid_image", "cannot be decoded (truncated or corrupt?)"),
    "truncated jpeg": (data_url(JPEG[:len(JPEG) // 2], "image/jpeg"), 400, "invalid_image", "cannot be decoded"),
    "jpeg header only": (data_url(JPEG[:20], "image/jpeg"), 400, "invalid_image", "not a JPEG image Pillow can read"),
    "zero width": (data_url(png_bytes(0, 10)), 400, "invalid_image", "the image has no pixels (0 x 10)"),
    "bomb header": (data_url(png_bytes(100_000, 100_000)), 413, "image_too_large", "--max-image-pixels"),
    "compressible png": (data_url(encoded(Image.new("L", (1000, 1000)))), 413, "image_too_large", "250,000 pixels"),
    "just past the pixels": (data_url(encoded(Image.new("L", (501, 500)))), 413, "image_too_large",
                             "--max-image-pixels"),
    "animated gif": (data_url(frames("GIF"), "image/gif"), 400, "invalid_image", "an animated GIF (2 frames)"),
    "apng": (data_url(frames("PNG")), 400, "invalid_image", "an animated PNG"),
    "animated webp": (data_url(frames("WEBP"), "image/webp"), 400, "invalid_image", "an animated WEBP"),
    "too many bytes": (data_url(encoded(noise(200, 200))), 413, "image_too_large", "--max-image-bytes)"),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_image_is_refused_and_the_server_serves_after(server, vision, name):
    url, status, code, says = HOSTILE[name]
    error = assert_error(chat(server, [image_part(url)]), status, URL_FIELD, says, code)
    assert error["message"].startswith(f"{URL_FIELD}: "), error
    assert vision == []  # nothing reached the engine
    budget = server.app.state.serving.images.budget  # an image refused as it decoded gave its pixels back
    assert budget.held == 0 and budget.waiting == 0
    assert_serving(server)


def test_the_shorthand_names_its_own_field(server, vision):
    assert_error(chat(server, [{"type": "text", "text": "x"}, {"image_url": "http://example.com/a.png"}]), 400,
                 "messages[0].content[1].image_url", "only data URLs are taken", "invalid_image_url")
    assert_serving(server)


def test_limits_on_a_requests_images_are_checked_before_decoding_any(server, vision, monkeypatch):
    import pagedjax.serve.images as images_module

    decoded = []
    real = images_module.load_image
    monkeypatch.setattr(images_module, "load_image", lambda *a: decoded.append(a) or real(*a))
    four = [image_part(SMALL_PNG)] * 4
    assert_error(chat(server, four), 400, "messages", "4 images, more than the 3 this server takes in one request "
                                                      "(--max-images-per-request)", "too_many_images")
    half = data_url(encoded(noise(120, 120)))  # ~43 KiB each, under the 64 KiB of one image
    assert_error(chat(server, [image_part(half)] * 3), 413, "messages",
                 "3 images of 1", "images_too_large")
    # the last of three too large: refused before the first is decoded
    assert_error(chat(server, [image_part(SMALL_PNG), image_part(SMALL_PNG), image_part(HOSTILE["too many bytes"][0])]),
                 413, "messages[0].content[2].image_url.url", "more than the 65,536 this server takes")
    assert decoded == [] and vision == []
    assert chat(server, [image_part(half)] * 2).status_code == 200  # 2 x 43 KiB: under the 100 KiB together
    assert len(decoded) == 2


# ------------------------------------------------------------------------------- what decoding costs the server
BIG = (490, 490)  # each "big" image below: under LIMITS' 250,000 pixels; two do not fit in a budget of 300,000
BUDGET = dataclasses.replace(LIMITS, max_decoding_pixels=300_000)
LINGER_S = 0.5  # how long a decode waits for another to start (the window in which overlaps are seen)


def big_png(shade: int) -> str:
    return data_url(encoded(Image.new("L", BIG, shade)))  # 240,100 pixels in a few hundred bytes


@pytest.fixture
def images_under(server, vision, monkeypatch):
    """Installs the vision fixture's stand-in processor under other limits (`images_under(limits)`: the
    `ImageSupport`); their pools are closed after the test."""
    made = []

    def install(limits: ImageLimits) -> ImageSupport:
        made.append(ImageSupport(Processor(), limits))
        monkeypatch.setattr(server.app.state.serving, "images", made[-1])
        return made[-1]

    yield install
    for support in made:
        support.close()


@contextlib.contextmanager
def pixels_held(*, before=None, linger: bool = False):
    """Watches every PIL image made meanwhile, in any thread: at each decode's start (after `before()`, if given),
    the pixels of those that hold decoded pixels then (loaded and neither closed nor freed, or decoding), this one's
    included. `linger`: each decode then waits up to LINGER_S for another decode to start, so that decodes that
    may overlap do."""
    images: dict[int, weakref.ref] = {}  # id -> the image (PIL images are not hashable)
    decoding: set[int] = set()  # ids of the images whose decode started
    peaks, lock, started = [], threading.Lock(), []
    real_init, real_load = Image.Image.__init__, ImageFile.ImageFile.load

    def holds(image) -> bool:
        try:
            return image.im is not None
        except ValueError:  # closed
            return False
        except AssertionError:  # no pixels yet (Pillow asserts): unless decoding
            return id(image) in decoding

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        key = id(self)
        with lock:
            images[key] = weakref.ref(self, lambda _: images.pop(key, None))

    def load(self):
        if id(self) in decoding:  # loaded already (load() is idempotent)
            return real_load(self)
        if before is not None:
            before()
        with lock:
            decoding.add(id(self))
            alive = [image for image in (ref() for ref in list(images.values())) if image is not None]
            peaks.append(sum(image.width * image.height for image in alive if holds(image)))
            event = threading.Event()
            for other in started:
                other.set()
            started.append(event)
        try:
            return real_load(self)
        finally:
            if linger:
                event.wait(LINGER_S)

    with mock.patch.object(Image.Image, "__init__", init), mock.patch.object(ImageFile.ImageFile, "load", load):
        yield peaks


def test_a_requests_images_are_decoded_one_at_a_time(server, images_under):
    """Issue 63: eight compressed 4096 x 4096 PNGs (a 0.6 MiB body) were all held decoded at once (+655 MiB for one
    request). Three images of 240,100 pixels with a budget of 300,000: each decoded image is dropped before the next
    one is decoded."""
    images_under(BUDGET)
    with pixels_held() as peaks:
        response = chat(server, [image_part(big_png(shade)) for shade in (0, 100, 200)])
    assert response.status_code == 200, response.text
    assert peaks == [BIG[0] * BIG[1]] * 3


def test_concurrent_requests_wait_for_the_pixel_budget(server, images_under, monkeypatch):
    """Three requests of one big image each, at once, with room for one in the budget: the decodes wait for it in
    turn (the first held until all three requests are in the server, each lingering to let another start), and all
    three are served."""
    support = images_under(BUDGET)
    serving, arrived, all_in = server.app.state.serving, [], threading.Event()
    real_prepare = serving.prepare_chat

    def prepare(body):
        arrived.append(body)
        if len(arrived) == 3:
            all_in.set()
        return real_prepare(body)

    monkeypatch.setattr(serving, "prepare_chat", prepare)
    with pixels_held(before=lambda: all_in.wait(60), linger=True) as peaks, \
            concurrent.futures.ThreadPoolExecutor(3) as clients:
        responses = list(clients.map(lambda shade: chat(server, [image_part(big_png(shade))]), (0, 100, 200)))
    assert [r.status_code for r in responses] == [200] * 3, [r.text for r in responses]
    assert peaks == [BIG[0] * BIG[1]] * 3
    assert support.budget.held == 0 and support.budget.waiting == 0  # all given back


@contextlib.contextmanager
def gated_decodes():
    """Every decode waits until the gate (the yielded Event) is set; `gate.entered` counts those that reached it,
    `gate.threads` their (thread name, nice value)."""
    gate, real_load = threading.Event(), ImageFile.ImageFile.load
    gate.entered, gate.threads = threading.Semaphore(0), []

    def load(self):
        nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        gate.threads.append((threading.current_thread().name, nice))
        gate.entered.release()
        assert gate.wait(60), "the gate was never opened"
        return real_load(self)

    with mock.patch.object(ImageFile.ImageFile, "load", load):
        try:
            yield gate
        finally:
            gate.set()


def test_a_text_stream_runs_while_images_wait_to_be_decoded(server, images_under, monkeypatch):
    """Issue 63: decoding images stalled a text stream on the same server by seconds. Decoding runs in the image
    pool, at a lower priority than the engine's thread, never in the threads that prepare requests: with every
    decode held and more image requests than those threads, a streamed text chat still runs to its end."""
    preparers = min(32, (os.cpu_count() or 1) + 4)  # asyncio's default executor, where requests are prepared
    images_under(dataclasses.replace(LIMITS, max_queued_image_requests=preparers + 1))
    serving, arrived, enough = server.app.state.serving, [], threading.Event()
    real_prepare = serving.prepare_chat

    def prepare(body):
        arrived.append(body)
        if len(arrived) >= preparers:
            enough.set()
        return real_prepare(body)

    monkeypatch.setattr(serving, "prepare_chat", prepare)
    with gated_decodes() as gate, concurrent.futures.ThreadPoolExecutor(preparers + 1) as clients:
        images = [clients.submit(chat, server, [image_part(SMALL_PNG)]) for _ in range(preparers + 1)]
        assert enough.wait(60)  # as many image requests as preparing threads came first
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            events = list(sse_events(response.iter_lines()))
        assert events[-1] == "[DONE]" and not any(f.done() for f in images)
        gate.set()
        assert [f.result().status_code for f in images] == [200] * (preparers + 1)
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert {name.rsplit("_", 1)[0] for name, _ in gate.threads} == {"pagedjax-image"}
    assert all(nice == min(19, mine + COMPILE_NICENESS) for _, nice in gate.threads), (mine, gate.threads)


def test_more_image_requests_than_may_wait_get_503(server, images_under):
    images_under(dataclasses.replace(LIMITS, max_queued_image_requests=1))
    with gated_decodes() as gate, concurrent.futures.ThreadPoolExecutor(1) as clients:
        first = clients.submit(chat, server, [image_part(SMALL_PNG)])
        assert gate.entered.acquire(timeout=60)
        response = chat(server, [image_part(SMALL_PNG)])
        assert_error(response, 503, None, "1 requests' images are waiting to be decoded or decoding "
                                          "(--max-queued-image-requests)", "image_decodes_full")
        assert response.headers["retry-after"] == "1"
        assert_serving(server, with_image=False)
        gate.set()
        assert first.result().status_code == 200
    assert_serving(server)


def test_the_pixel_budget_is_first_come_first_served():
    """A small image that would fit beside those held waits behind an earlier large one (else a stream of small
    images could hold the large one off for ever); one of more pixels than the whole budget waits for all of it."""
    async def run():
        budget, order = PixelBudget(100), []

        async def take(name: str, pixels: int) -> int:
            held = await budget.acquire(pixels)
            order.append(name)
            return held

        assert await budget.acquire(60) == 60
        large = asyncio.create_task(take("large", 80))
        await asyncio.sleep(0)
        small = asyncio.create_task(take("small", 10))  # 60 + 10 fit: it still waits behind the large one
        await asyncio.sleep(0)
        assert order == [] and budget.waiting == 2 and budget.held == 60
        budget.release(60)
        assert (await large, await small) == (80, 10) and order == ["large", "small"] and budget.held == 90
        huge = asyncio.create_task(take("huge", 1000))
        await asyncio.sleep(0)
        budget.release(80)
        await asyncio.sleep(0)
        assert not huge.done()  # 10 still held
        budget.release(10)
        assert await huge == 100 and budget.held == 100 and budget.waiting == 0

    asyncio.run(run())


def test_a_cancelled_wait_for_the_pixel_budget_gives_back_its_place_and_its_grant():
    async def run():
        budget = PixelBudget(100)
        await budget.acquire(100)
        first, second = asyncio.create_task(budget.acquire(50)), asyncio.create_task(budget.acquire(50))
        await asyncio.sleep(0)
        first.cancel()  # still waiting, first in line: passed over
        with pytest.raises(asyncio.CancelledError):
            await first
        assert budget.waiting == 1 and budget.held == 100
        budget.release(100)
        assert await second == 50 and budget.held == 50
        third = asyncio.create_task(budget.acquire(60))
        await asyncio.sleep(0)
        budget.release(50)  # grants the third ...
        assert budget.held == 60
        third.cancel()  # ... which is cancelled before it resumes: the grant goes back
        with pytest.raises(asyncio.CancelledError):
            await third
        assert budget.held == 0 and budget.waiting == 0

    asyncio.run(run())


def test_a_request_gone_while_its_image_decodes_holds_the_budget_until_the_decode_ends():
    """A client that leaves (its request cancelled) while its image decodes: the pixels stay held, and the next
    request waits, until the decode in the pool ends (it cannot be stopped); then everything is given back."""
    support = ImageSupport(Processor(), BUDGET)

    def opened(shade: int):
        data = encoded(Image.new("L", BIG, shade))
        return support.open([DataURL("x", "image/png", base64.b64encode(data).decode(), len(data))])

    async def run(gate):
        gone = asyncio.create_task(support.pixels(opened(0)))
        assert await asyncio.to_thread(gate.entered.acquire, timeout=60)  # decoding
        waiting = asyncio.create_task(support.pixels(opened(100)))
        await asyncio.sleep(0.05)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert support.budget.held == BIG[0] * BIG[1] and support.budget.waiting == 1 and not waiting.done()
        gate.set()
        (pixels,) = await waiting
        assert pixels.shape == (*BIG, 3) and support.budget.held == 0 and support.budget.waiting == 0

    try:
        with gated_decodes() as gate:
            asyncio.run(run(gate))
    finally:
        support.close()


def test_decodes_give_the_freed_memory_back_once_none_runs(server, images_under, monkeypatch):
    import pagedjax.serve.images as images_module

    trimmed, held_then = threading.Event(), []
    support = images_under(BUDGET)

    def trim():
        held_then.append(support.budget.held)
        trimmed.set()
        return True

    monkeypatch.setattr(images_module, "trim_heap", trim)
    monkeypatch.setattr(images_module, "TRIM_AFTER_PIXELS", 3 * BIG[0] * BIG[1])
    assert chat(server, [image_part(big_png(0))]).status_code == 200
    assert not trimmed.wait(0.2)  # fewer pixels decoded than TRIM_AFTER_PIXELS since the last trim
    assert chat(server, [image_part(big_png(0)), image_part(big_png(100))]).status_code == 200
    assert trimmed.wait(60) and held_then == [0]  # queued after the last decode, when none held the budget


def test_images_only_in_user_messages(server, vision):
    messages = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}, image_part(SMALL_PNG)]},
                {"role": "user", "content": "Hi."}]
    assert_error(chat(server, None, messages=messages), 400, "messages[0].content[1]",
                 "only user messages take images (this is a system message)", "invalid_image_part")
    assert_serving(server)


def test_placeholders_must_match_the_images(server, vision, monkeypatch):
    # a message's text holding the placeholder itself
    assert_error(chat(server, [{"type": "text", "text": "an @ sign"}, image_part(SMALL_PNG)]), 400, "messages",
                 "the prompt has 2 image placeholders ('@') for the request's 1 images")
    assert_error(chat(server, "just an @"), 400, "messages", "has 1 image placeholders ('@') for the request's 0")
    # a template that does not render image parts
    monkeypatch.setattr(server.app.state.serving, "chat_template", ChatTemplate(DEFAULT_TEMPLATE))
    assert_error(chat(server, [image_part(SMALL_PNG)]), 400, "messages", "has 0 image placeholders")
    assert vision == []


def test_a_template_that_reads_only_parts_gets_every_message_as_parts(server, vision, monkeypatch):
    """LLaVA's Hugging Face templates loop over a message's parts (a string content renders nothing): for a model
    that takes images and such a template, text-only messages are sent as parts too."""
    template = ChatTemplate("{% for m in messages %}{{ m['role'] }}:{% for p in m['content'] %}"
                            "{% if p['type'] == 'image' %}@{% else %}{{ p['text'] }}{% endif %}{% endfor %}{{ '\\n' }}"
                            "{% endfor %}")
    assert template.reads_content_parts and not ChatTemplate(PARTS_TEMPLATE).reads_content_parts
    serving = server.app.state.serving
    monkeypatch.setattr(serving, "chat_template", template)
    monkeypatch.setattr(serving, "images", ImageSupport(Processor(), LIMITS, content_parts=True))
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Look:"}, image_part(SMALL_PNG)]}]
    assert chat(server, None, messages=messages).status_code == 200
    text = bytes(t for t in vision[-1]["prompt_token_ids"] if t < 256).decode()
    assert text == expanded("system:Be brief.\nuser:Look:@\n")


# llava-hf/llava-1.5-7b-hf's chat template (its text only from parts; `generation` is transformers' tag)
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\\n' }}{% endfor %}{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}"
    "{% endfor %}{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
# Gemma 3's chat template (strings or parts), its system-message and turn logic kept
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = 'model' -%}{%- else -%}"
    "{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}{%- elif item['type'] == 'text' -%}"
    "{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}{%- endif -%}{{ '<end_of_turn>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{'<start_of_turn>model\\n'}}{%- endif -%}"
)


def test_hugging_face_templates_write_their_placeholders():
    from pagedjax.serve.protocol import ChatMessage
    from pagedjax.serve.tools import template_messages

    messages = [ChatMessage(role="system", content="Be brief."),
                ChatMessage.model_validate({"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                                        image_part(SMALL_PNG)]}),
                ChatMessage(role="assistant", content="A cat."),
                ChatMessage.model_validate({"role": "user", "content": [image_part(SMALL_PNG), {"image_url": SMALL_PNG},
                                                                        {"type": "text", "text": "And these?"}]})]
    llava, gemma = ChatTemplate(LLAVA_TEMPLATE), ChatTemplate(GEMMA3_TEMPLATE, bos_token="<bos>")
    assert llava.reads_content_parts and not gemma.reads_content_parts
    as_parts = template_messages(messages, None, supports_tools=False, content_parts=True)
    assert llava.render(as_parts) == ("Be brief. USER: <image>\nWhat is this? ASSISTANT: A cat. USER: <image>\n"
                                      "<image>\nAnd these? ASSISTANT:")
    # strings where the template reads them: the text-only messages exactly as for a text model
    as_strings = template_messages(messages, None, supports_tools=False)
    assert [m["content"] for m in as_strings[::2]] == ["Be brief.", "A cat."]
    assert gemma.render(as_strings) == (
        "<bos><start_of_turn>user\nBe brief.\n\nWhat is this?<start_of_image><end_of_turn>\n<start_of_turn>model\n"
        "A cat.<end_of_turn>\n<start_of_turn>user\n<start_of_image><start_of_image>And these?<end_of_turn>\n"
        "<start_of_turn>model\n")


@pytest.mark.parametrize("kind", ["llava", "gemma3"])
def test_vision_folders_without_a_template_get_their_familys(tmp_path, kind):
    """A LLaVA / Gemma 3 folder without a chat template renders as its family's published template does, with
    the folder's image placeholder for each image part (the built-in default dropped them: 400 on every image
    chat)."""
    pytest.importorskip("transformers")
    from pagedjax.model.multimodal.processor import load_image_processor
    from pagedjax.serve.protocol import ChatMessage
    from pagedjax.serve.tools import template_messages
    from tests.model.vision_folders import save_folder

    folder = save_folder(kind, tmp_path / kind)
    template = ChatTemplate.from_model(folder)
    assert template.source == f"built-in {kind} template ({folder} has no chat template)"
    assert not template.reads_content_parts  # text-only messages go as strings
    messages = [ChatMessage(role="system", content="Be brief."),
                ChatMessage.model_validate({"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                                        image_part(SMALL_PNG)]}),
                ChatMessage(role="assistant", content="A cat."),
                ChatMessage.model_validate({"role": "user", "content": [image_part(SMALL_PNG), {"image_url": SMALL_PNG},
                                                                        {"type": "text", "text": "And these?"}]})]
    text = template.render(template_messages(messages, None, supports_tools=False))
    assert load_image_processor(folder).count_images(text) == 3
    published = ChatTemplate(LLAVA_TEMPLATE if kind == "llava" else GEMMA3_TEMPLATE, bos_token=template.bos_token)
    as_published = template_messages(messages, None, supports_tools=False, content_parts=kind == "llava")
    assert text == (template.bos_token if kind == "llava" else "") + published.render(as_published)


def test_the_flags_set_the_limits():
    from pagedjax.serve.cli import build_parser, image_limits

    assert image_limits(build_parser().parse_args([])) == ImageLimits()
    args = build_parser().parse_args(["--max-images-per-request", "2", "--max-image-bytes", "1MiB",
                                      "--max-image-bytes-per-request", "3MB", "--max-image-pixels", "1000000"])
    assert image_limits(args) == ImageLimits(2, 2**20, 3_000_000, 1_000_000)
    args = build_parser().parse_args(["--max-decoding-pixels", "5000000", "--max-queued-image-requests", "3"])
    assert image_limits(args) == ImageLimits(max_decoding_pixels=5_000_000, max_queued_image_requests=3)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--max-image-pixels", "0"])


# ------------------------------------------------------------------------------------------------ the fuzz test
SEEDS = [PNG, JPEG, encoded(Image.new("P", (8, 8)), "GIF"), encoded(noise(8, 8), "WEBP"), frames("GIF")]
MEDIA = ["image/png", "image/jpeg", "image/gif", "image/webp", "image/gif"]


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, len(SEEDS) - 1), data=st.data())
def test_fuzzed_image_bytes_decode_or_are_refused(seed, data):
    """Random byte changes, cuts and appended junk in images of each format: the decoder returns an RGB image or
    raises its 400 / 413, nothing else."""
    raw = bytearray(SEEDS[seed])
    for _ in range(data.draw(st.integers(0, 8), label="changes")):
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] = data.draw(st.integers(0, 255))
    raw = raw[:data.draw(st.integers(0, len(raw)), label="cut")] + data.draw(st.binary(max_size=16), label="junk")
    url = DataURL("x", MEDIA[seed], base64.b64encode(bytes(raw)).decode(), len(raw))
    try:
        image = load_image(open_image(url, LIMITS))
    except APIError as e:
        assert e.status in (400, 413) and e.param == "x" and len(e.message) < 600, e.message
    else:
        assert image.mode == "RGB" and image.width * image.height <= LIMITS.max_image_pixels


# ------------------------------------------------------------------------------ a real vision-language model
def photo(width: int, height: int, seed: int = 0) -> Image.Image:
    """An image of a photograph's kind: smooth gradients, sharp-edged shapes over them, a little noise."""
    from PIL import ImageDraw

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    image = Image.fromarray(np.stack([x * 255 // width, y * 255 // height, (x + y) * 127 // (width + height)],
                                     -1).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(20):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        box = [x0, y0, x0 + int(rng.integers(4, width // 3)), y0 + int(rng.integers(4, height // 3))]
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=tuple(map(int, rng.integers(0, 256, 3))))
    pixels = np.asarray(image, np.int16) + rng.integers(-12, 13, (height, width, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def rotated(image: Image.Image) -> bytes:
    """`image` as a JPEG whose EXIF orientation rotates it on display."""
    exif = Image.Exif()
    exif[0x0112] = 6
    return encoded(image, "JPEG", exif=exif)


@pytest.fixture(scope="module")
def llava_folder(tmp_path_factory):
    """A tiny LLaVA's folder as transformers saves one (configs, tokenizer, processor; no weights)."""
    pytest.importorskip("transformers")
    from tests.model.vision_folders import save_folder

    return save_folder("llava", tmp_path_factory.mktemp("llava"))


def test_images_within_3x_the_input_decode_exactly_larger_ones_reduced_within_a_few_levels(llava_folder):
    """Reduced decoding (`pagedjax.serve.images`): an image within 3x the model's input (a tiny LLaVA's 16 pixels)
    is made the very pixels the processor makes of the whole decoded image; a larger one is shrunk while decoded
    (a JPEG at 1/8 of its size) or right after (box averages), and its pixels stay within 7 levels of 255 of the
    processor's (at most 7 measured on these, a mean under 2)."""
    from pagedjax.model.multimodal.processor import decode_image, load_image_processor

    processor = load_image_processor(llava_folder)  # CLIP: the short side to 16, a crop of 16
    support = ImageSupport(processor, dataclasses.replace(LIMITS, max_image_bytes=2**20,
                                                          max_image_bytes_per_request=2**20, max_image_pixels=2**20))
    level = np.asarray(processor.transform.normalize[1], np.float32)[:, None, None] / processor.transform.rescale
    cases = {  # name: (bytes, media type, pixels decoded, largest difference in levels)
        "rgba png": (encoded(Image.new("RGBA", (40, 30), (0, 0, 255, 128))), "image/png", 1200, 0),
        "rotated jpeg": (rotated(photo(47, 47)), "image/jpeg", 47 * 47, 0),
        "gif": (encoded(noise(30, 40).convert("P"), "GIF"), "image/gif", 1200, 0),
        "photo png": (encoded(photo(768, 512)), "image/png", 768 * 512, 7),  # reduced by 8 after decoding
        "photo jpeg": (encoded(photo(512, 768), "JPEG"), "image/jpeg", 64 * 96, 7),  # decoded at 1/8
        "rotated photo jpeg": (rotated(photo(640, 480, 1)), "image/jpeg", 320 * 240, 7),  # at 1/2, reduced by 5
        "noise png": (encoded(noise(96, 96)), "image/png", 96 * 96, 7),  # reduced by 2
    }
    try:
        for name, (data, media, decoded, most) in cases.items():
            (opened,) = support.open([DataURL(name, media, base64.b64encode(data).decode(), len(data))])
            assert opened.pixels == decoded, name
            (pixels,) = asyncio.run(support.pixels([opened]))
            expected = processor.pixel_values([decode_image(data)])[0]
            levels = np.abs(pixels - expected) * level
            assert levels.max() <= most + 1e-3 and levels.mean() < 2, (name, levels.max(), levels.mean())
            if most == 0:
                assert np.array_equal(pixels, expected), name
    finally:
        support.close()


def test_a_vision_model_end_to_end(server, llava_folder):
    """A tiny random LLaVA served: the images reach its encoder and the answer is the engine's own on the whole
    images, also for two large ones the server decodes reduced (a PNG box-averaged by 8, a JPEG decoded at 1/8):
    the same tokens."""
    from flax import nnx

    from pagedjax import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
    from pagedjax.model.hf_tokenizer import HFTokenizer
    from pagedjax.model.multimodal.hf_vision import load_config as load_vision_config
    from pagedjax.model.multimodal.llava import Llava
    from pagedjax.model.multimodal.processor import decode_image, load_image_processor

    # the folder's configs, tokenizer and processor, as transformers writes them; random weights (the model's
    # equality with transformers is tests/engine/test_images_engine.py's)
    folder = llava_folder
    model = Llava(load_vision_config(folder), rngs=nnx.Rngs(0))
    llm = LLMEngine(model=model, tokenizer=HFTokenizer.from_pretrained(folder, eos_token_ids=model.spec.eos_token_ids),
                    image_processor=load_image_processor(folder),
                    cache_config=CacheConfig(block_size=16, num_blocks=64),
                    scheduler_config=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=2))
    # The folder has no chat template: the built-in LLaVA one (every image chat used to be a 400: the default
    # template dropped the image parts)
    template = ChatTemplate.from_model(folder)
    assert template.source.startswith("built-in llava template")
    files = [(encoded(noise(23, 37)), "image/png"), (encoded(photo(768, 512)), "image/png"),
             (encoded(photo(512, 768, 1), "JPEG"), "image/jpeg")]
    messages = [{"role": "system", "content": "the cat"},
                {"role": "user", "content": [{"type": "text", "text": "what is this ?"},
                                             *(image_part(data_url(data, media)) for data, media in files)]}]
    with running_server(llm, chat_template=template) as vlm:
        assert vlm.app.state.serving.images is not None
        response = chat(vlm, None, messages=messages, max_tokens=8, temperature=0, ignore_eos=True)
        assert response.status_code == 200, response.text
        assert_serving(vlm)
    # the same prompt offline, each image decoded whole (the server's engine thread has stopped)
    text = template.render([{"role": "system", "content": [{"type": "text", "text": "the cat"}]},
                            {"role": "user", "content": [{"type": "text", "text": "what is this ?"},
                                                         *[{"type": "image"}] * len(files)]}])
    ids = template.encode(llm.tokenizer, text)
    whole = [decode_image(data) for data, _ in files]
    offline = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": whole}},
                           SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert response.json()["choices"][0]["message"]["content"] == offline.text
    assert response.json()["usage"]["prompt_tokens"] == len(offline.prompt_token_ids)
