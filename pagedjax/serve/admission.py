"""A prompt's admission before it is tokenized: a prompt that cannot fit the context is refused by its size.

Tokenizing costs time and memory in proportion to the text (a 4 MiB prompt: 6.4 s and 800 MiB of RSS, for a
refusal as too long), so a prompt whose UTF-8 is longer than `(max_model_len - 1) * longest_token_bytes` bytes
is refused without it: every token stands for at most `longest_token_bytes` bytes of text, so such a prompt has
at least max_model_len tokens, which leaves no room for one generated. That holds when the tokenizer maps the
text to tokens whose bytes together are the text (nothing dropped or merged away): the byte tokenizer, and a
Hugging Face byte-level BPE without a normalizer whose pre-tokenizers only split. For any other tokenizer
`longest_token_bytes` is None and prompts are not bounded before tokenizing (only by the body limit).

Hugging Face's `Tokenizer.encode` holds the GIL for the whole text (1 MB: the event loop stopped for 1 s);
`encode_batch` of one text releases it (`encode_text`).

`ImageLimits` bound a chat request's images (`pagedjax.serve.images` checks them), here beside the other
per-request bounds so that pagedjax-serve's argument parser has them without the serve extra imported.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_MAX_CHAT_MESSAGES = 1024
# The most calls of one forced tool choice with parallel_tool_calls, and the most characters of a string argument
# of a forced call whose schema sets no maxLength (`pagedjax.serve.tools`; here, beside the other per-request
# bounds, so that pagedjax-serve's argument parser has them without the serve extra imported).
DEFAULT_MAX_PARALLEL_TOOL_CALLS = 4
DEFAULT_MAX_TOOL_STRING_LENGTH = 4096


def _limit(default: int, help: str, *, size: bool = False):  # noqa: A002 - argparse's word
    return field(default=default, metadata={"help": help, "size": size})


@dataclass(frozen=True)
class ImageLimits:
    """The most one chat request's images may hold, each checked before the work it bounds (`pagedjax.serve.images`):
    the counts and sizes before any image is decoded (a base64 text's length gives its bytes), the pixels from the
    image's header before its pixels are decoded; and, across the server's requests, the pixels being decoded at
    once and the requests waiting for that. Every field is an int >= 1; `pagedjax-serve` has a flag per field
    (`max_image_pixels` -> `--max-image-pixels`; the byte sizes also as `8MiB`)."""

    max_images_per_request: int = _limit(8, "images in one chat request; more get 400 before any is decoded")
    max_image_bytes: int = _limit(8 * 2**20, "bytes of one encoded image (its base64 text's length bounds them, "
                                             "before decoding); a larger one gets 413", size=True)
    max_image_bytes_per_request: int = _limit(16 * 2**20, "bytes of all the encoded images of one request "
                                                          "together; more get 413 before any is decoded", size=True)
    max_image_pixels: int = _limit(4096 * 4096, "width x height of one image, read from its header before its pixels "
                                                "are decoded; a larger one gets 413 (also Pillow's decompression-bomb "
                                                "limit, Image.MAX_IMAGE_PIXELS)")
    max_decoding_pixels: int = _limit(2 * 4096 * 4096, "pixels being decoded at once across all requests (each "
                                                       "image's width x height, a JPEG's at the reduced size it is "
                                                       "decoded at); an image waits, first come first served, until "
                                                       "it fits (one larger than this waits for all of it)")
    max_queued_image_requests: int = _limit(32, "requests whose images are waiting to be decoded or decoding; more "
                                                "get 503 (image_decodes_full) before they wait")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ImageLimits.{f.name} must be an int >= 1, got {value!r}")


DEFAULT_IMAGE_LIMITS = ImageLimits()

# Pre-tokenizers that only split the text (none drops a byte of it), with the behaviours that keep every piece.
_SPLITTING = {"ByteLevel", "Split", "Digits", "Punctuation", "Sequence"}


def longest_token_bytes(tokenizer: Any) -> int | None:
    """The most bytes of text one token of `tokenizer` can stand for, where that bounds a text's tokens from
    below (see the module docstring); None where it does not."""
    from pagedjax.model.tokenizer import ByteTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        return 1  # each byte is one token; its special tokens stand for no text
    inner = getattr(tokenizer, "tokenizer", None)
    if inner is None or not hasattr(inner, "to_str") or not hasattr(tokenizer, "decode_bytes"):
        return None
    spec = json.loads(inner.to_str())
    decoder = spec.get("decoder") or {}
    if spec.get("normalizer") is not None or decoder.get("type") != "ByteLevel" \
            or not _only_splits(spec.get("pre_tokenizer")):
        return None
    added = [t.content for t in inner.get_added_tokens_decoder().values()]  # matched in the text as they are
    return max(max((len(tokenizer.decode_bytes([i])) for i in range(tokenizer.vocab_size)), default=1),
               max((len(a.encode()) for a in added), default=1))


def _only_splits(pre: dict | None) -> bool:
    if pre is None:
        return True
    if pre.get("type") not in _SPLITTING or str(pre.get("behavior", "")).lower() == "removed":
        return False
    return all(_only_splits(p) for p in pre.get("pretokenizers", ()))


def utf8_length(text: str) -> int:
    """Bytes of `text` in UTF-8, a lone surrogate counted as one (the fewest a tokenizer makes of it: the byte
    tokenizer's surrogateescape; a JSON body cannot carry one anyway), so never more than a tokenizer sees."""
    return len(text) if text.isascii() else len(text.encode("utf-8", errors="replace"))


def encode_text(tokenizer: Any, text: str, **kwargs) -> list[int]:
    """`tokenizer.encode(text, **kwargs)`, without holding the GIL where the tokenizer can (a Hugging Face
    tokenizer's `encode_batch` of one text: the same ids)."""
    batch = getattr(tokenizer, "encode_batch", None)
    if batch is not None:
        return list(batch([text], **kwargs)[0])
    return list(tokenizer.encode(text, **kwargs))
