"""Log-probabilities in OpenAI's two response formats, from the engine's per-token `TokenLogprobs`.

Completions (legacy format): `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
"text_offset"}`, a token's offset being the characters of the completion text before it (`TextOffsets`: a
character whose bytes span several tokens counts once, at the token that completes it, and a stream keeps
counting across chunks). Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
"logprob", "bytes"}]}]}`. A token's string is its own decode, or, when its raw bytes are not valid UTF-8 on their
own (a piece of a multi-byte character), `bytes:` and their escapes as OpenAI writes them (`bytes:\\xe2\\x80`),
so that distinct tokens never share a string; `bytes` are the token's raw bytes (`decode_bytes`).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from pagedjax.outputs import TokenLogprobs


def _token_bytes(tokenizer, token_id: int) -> bytes:
    if hasattr(tokenizer, "decode_bytes"):
        return tokenizer.decode_bytes([token_id])
    return tokenizer.decode([token_id]).encode("utf-8")


def _token_text(tokenizer, token_id: int) -> str:
    raw = _token_bytes(tokenizer, token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class TextOffsets:
    """Where each token of one choice starts in its text, in characters, as tokens come."""

    def __init__(self):
        self.chars = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def take(self, raw: bytes) -> int:
        """The offset of a token of bytes `raw`; the characters it completes count from the next token on."""
        offset = self.chars
        self.chars += len(self._decoder.decode(raw))
        return offset


def completion_logprobs(tokenizer, entries: Sequence[TokenLogprobs],
                        offsets: TextOffsets | None = None) -> dict:
    """The completions format of `entries`; `offsets` carries the text offsets on from earlier chunks."""
    offsets = TextOffsets() if offsets is None else offsets
    return {"tokens": [_token_text(tokenizer, e.token_id) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{_token_text(tokenizer, t): lp for t, lp in e.top} for e in entries],
            "text_offset": [offsets.take(_token_bytes(tokenizer, e.token_id)) for e in entries]}


def chat_logprobs(tokenizer, entries: Sequence[TokenLogprobs]) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        return {"token": _token_text(tokenizer, token_id), "logprob": logprob,
                "bytes": list(_token_bytes(tokenizer, token_id))}

    return {"content": [dict(item(e.token_id, e.logprob), top_logprobs=[item(t, lp) for t, lp in e.top])
                        for e in entries]}
