"""Incremental detokenization: the text of a growing token sequence as deltas that are safe to send.

    detok = IncrementalDetokenizer(tokenizer, stop=("\\n\\n",))
    for out in outputs:                      # cumulative token ids, one snapshot per engine step
        send(detok.update(out.output_token_ids))
    send(detok.finish(final_text))           # the engine's final text (cut at a stop string)

Each update decodes the accumulated ids with the tokenizer's own `decode` (so it works for any tokenizer the
engine carries: `ByteTokenizer`, `HFTokenizer`) and sends what it has not sent yet, holding back:

  * a trailing run of U+FFFD: the replacement character a decoder puts where the bytes of a multi-byte
    character are incomplete; the next token may complete it (a real U+FFFD is sent once text follows it);
  * the longest tail that could start a stop string, and everything from a complete one on: the engine cuts
    the final text there if the stop string completes, and text already sent cannot be taken back.

Every delta is a `str` (valid UTF-8 once encoded) and the deltas concatenate to the final text, provided the
tokenizer decodes prefix-stably: decoding more ids never changes the text of the earlier ones except for an
incomplete character at the end. Byte-level tokenizers and byte-level BPE do. If a tokenizer ever breaks that,
nothing more is sent until the text is consistent again, and `finish` sends the rest (logged if the text already
sent turned out not to be a prefix of the final text).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

logger = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"


def stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `stops` (0 if none)."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


class IncrementalDetokenizer:
    """Text deltas of one output sequence; see the module docstring. `tokenizer`: anything with `decode(ids)`."""

    def __init__(self, tokenizer, *, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.sent = ""  # the concatenation of every delta returned so far

    def update(self, token_ids: Sequence[int], text: str | None = None) -> str:
        """The new safe text after the output grew to `token_ids` (all of them, not only the new ones). `text`:
        their decode, when the caller has it already (the engine's `RequestOutput.text` is exactly that)."""
        if text is None:
            text = self.tokenizer.decode(list(token_ids))
        end = len(text.rstrip(REPLACEMENT))
        found = [i for i in (text.find(s, 0, end) for s in self.stop) if i >= 0]
        if found:  # the engine ends the text there (this snapshot is the request's last)
            end = min(found)
        end -= stop_prefix_len(text[:end], self.stop)
        if end <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta = text[len(self.sent):end]
        self.sent += delta
        return delta

    def finish(self, final_text: str) -> str:
        """Everything not sent yet of `final_text` (the whole output's text, cut at its stop string if any)."""
        if not final_text.startswith(self.sent):  # cannot be taken back: the client's text will differ
            logger.warning("detokenizer: the text sent so far (%d chars) is not a prefix of the final text; the "
                           "tokenizer's decode is not prefix-stable", len(self.sent))
        delta = final_text[len(self.sent):]
        self.sent += delta
        return delta
