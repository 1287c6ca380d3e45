"""Log-probabilities in OpenAI's two response formats, from the engine's per-token `TokenLogprobs`.

Completions (legacy format): `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`,
offsets counted in characters of the completion text from `offset` on. Chat: `{"content": [{"token", "logprob",
"bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`. A token's string is its own decode, or, when its
raw bytes are not valid UTF-8 on their own (a piece of a multi-byte character), `bytes:` and their escapes as
OpenAI writes them (`bytes:\\xe2\\x80`), so that distinct tokens never share a string.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedjax.core.request import TokenLogprobs


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


def completion_logprobs(tokenizer, entries: Sequence[TokenLogprobs], offset: int = 0) -> dict:
    """The completions format of `entries`, whose first token starts at character `offset` of the text."""
    tokens, offsets = [], []
    for e in entries:
        text = _token_text(tokenizer, e.token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{_token_text(tokenizer, t): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets}


def chat_logprobs(tokenizer, entries: Sequence[TokenLogprobs]) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        return {"token": _token_text(tokenizer, token_id), "logprob": logprob,
                "bytes": list(_token_bytes(tokenizer, token_id))}

    return {"content": [dict(item(e.token_id, e.logprob), top_logprobs=[item(t, lp) for t, lp in e.top])
                        for e in entries]}


def text_length(tokenizer, entries: Sequence[TokenLogprobs]) -> int:
    """Characters the tokens' own decodes add up to (the next `offset` of `completion_logprobs`)."""
    return sum(len(_token_text(tokenizer, e.token_id)) for e in entries)
