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
import io
import json
import struct
import threading
import zlib

import httpx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from pagedjax.serve.admission import ImageLimits
from pagedjax.serve.chat_template import DEFAULT_TEMPLATE, ChatTemplate
from pagedjax.serve.errors import APIError
from pagedjax.serve.images import DataURL, ImageSupport, decode_image
from tests.serve.server_utils import MAX_MODEL_LEN, MODEL_NAME, make_engine, running_server

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
    monkeypatch.setattr(serving, "images", ImageSupport(Processor(), LIMITS))
    monkeypatch.setattr(serving, "chat_template", ChatTemplate(PARTS_TEMPLATE))
    prompts: list[dict] = []
    real = server.llm.make_request

    def make_request(request_id, prompt, params=None, **kwargs):
        if isinstance(prompt, dict):  # the interface of an engine whose model takes images
            prompts.append({**prompt, "thread": threading.current_thread().name})
            assert sorted(prompt) == ["multi_modal_data", "prompt_token_ids"]
            images = prompt["multi_modal_data"]["image"]
            per_image = serving.images.processor.tokens_per_image
            assert prompt["prompt_token_ids"].count(ord(Processor.expanded)) == len(images) * per_image
            prompt = prompt["prompt_token_ids"]  # (the text model takes the expanded tokens as text)
        return real(request_id, prompt, params, **kwargs)

    monkeypatch.setattr(server.llm, "make_request", make_request)
    return prompts


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
    assert prompt["thread"] == "pagedjax-engine"
    # A JPEG with more pictures (MPO) is its primary one; WebP is taken too; more requests, more prompts
    for url, size in ((data_url(mpo, "image/jpeg"), (9, 5)),
                      (data_url(encoded(noise(7, 6), "WEBP"), "image/webp"), (7, 6))):
        assert chat(server, [image_part(url)]).status_code == 200
        assert vision[-1]["multi_modal_data"]["image"][0].shape == (size[1], size[0], 3)


def test_images_are_decoded_in_a_worker_thread(server, vision, monkeypatch):
    import pagedjax.serve.serving as serving_module

    threads = []
    real = serving_module.decode_image

    def decode(*args):
        try:
            asyncio.get_running_loop()
            loop = True
        except RuntimeError:
            loop = False
        threads.append((threading.current_thread().name, loop))
        return real(*args)

    monkeypatch.setattr(serving_module, "decode_image", decode)
    assert chat(server, [image_part(SMALL_PNG)]).status_code == 200
    (name, loop), = threads
    assert not loop and name != "pagedjax-engine", threads  # the event loop's executor: neither loop nor engine


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
    assert_serving(server)


def test_the_shorthand_names_its_own_field(server, vision):
    assert_error(chat(server, [{"type": "text", "text": "x"}, {"image_url": "http://example.com/a.png"}]), 400,
                 "messages[0].content[1].image_url", "only data URLs are taken", "invalid_image_url")
    assert_serving(server)


def test_limits_on_a_requests_images_are_checked_before_decoding_any(server, vision, monkeypatch):
    import pagedjax.serve.serving as serving_module

    decoded = []
    real = serving_module.decode_image
    monkeypatch.setattr(serving_module, "decode_image", lambda *a: decoded.append(a) or real(*a))
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
    from pagedjax.model.processor import load_image_processor
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
        image = decode_image(url, LIMITS)
    except APIError as e:
        assert e.status in (400, 413) and e.param == "x" and len(e.message) < 600, e.message
    else:
        assert image.mode == "RGB" and image.width * image.height <= LIMITS.max_image_pixels


# ------------------------------------------------------------------------------ a real vision-language model
def test_a_vision_model_end_to_end(server, tmp_path):
    """A tiny random LLaVA served: the image reaches its encoder and the answer is the engine's own."""
    pytest.importorskip("transformers")
    from flax import nnx

    from pagedjax import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
    from pagedjax.model.hf_tokenizer import HFTokenizer
    from pagedjax.model.llava import Llava
    from pagedjax.model.loading.hf_vision import load_vision_config
    from pagedjax.model.processor import load_image_processor
    from tests.model.vision_folders import save_folder

    # the folder's configs, tokenizer and processor, as transformers writes them; random weights (the model's
    # equality with transformers is tests/engine/test_images_engine.py's)
    folder = save_folder("llava", tmp_path / "llava")
    model = Llava(load_vision_config(folder), rngs=nnx.Rngs(0))
    llm = LLMEngine(model=model, tokenizer=HFTokenizer.from_pretrained(folder, eos_token_ids=model.spec.eos_token_ids),
                    image_processor=load_image_processor(folder),
                    cache_config=CacheConfig(block_size=16, num_blocks=64),
                    scheduler_config=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=2))
    # The folder has no chat template: the built-in LLaVA one (every image chat used to be a 400: the default
    # template dropped the image parts)
    template = ChatTemplate.from_model(folder)
    assert template.source.startswith("built-in llava template")
    image = noise(23, 37)
    messages = [{"role": "system", "content": "the cat"},
                {"role": "user", "content": [{"type": "text", "text": "what is this ?"},
                                             image_part(data_url(encoded(image)))]}]
    with running_server(llm, chat_template=template) as vlm:
        assert vlm.app.state.serving.images is not None
        response = chat(vlm, None, messages=messages, max_tokens=8, temperature=0, ignore_eos=True)
        assert response.status_code == 200, response.text
        assert_serving(vlm)
    # the same prompt offline (the server's engine thread has stopped)
    text = template.render([{"role": "system", "content": [{"type": "text", "text": "the cat"}]},
                            {"role": "user", "content": [{"type": "text", "text": "what is this ?"},
                                                         {"type": "image"}]}])
    ids = template.encode(llm.tokenizer, text)
    offline = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [image]}},
                           SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert response.json()["choices"][0]["message"]["content"] == offline.text
    assert response.json()["usage"]["prompt_tokens"] == len(offline.prompt_token_ids)
