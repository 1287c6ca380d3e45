"""A thin wrapper over the `tokenizers` package for Hugging Face `tokenizer.json` files.

    tok = HFTokenizer.from_pretrained("path/to/folder")   # or HFTokenizer.from_file(".../tokenizer.json")
    ids = tok.encode("Hello")          # BOS added when the tokenizer's post-processor adds it (as in transformers)
    text = tok.decode(ids)             # special tokens skipped by default

No transformers or torch needed; the `tokenizers` package is imported lazily. An unreadable or invalid
tokenizer.json / tokenizer_config.json is a `ModelLoadError` (a ValueError) naming the file.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pagedjax.model.errors import ModelLoadError, read_json


def _token_content(token: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): the character each byte is stored as in the vocabulary -> the byte.
    Printable Latin-1 bytes stand for themselves; the others, in byte order, for chr(256), chr(257), ..."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)}
    alphabet, shifted = {}, 0
    for b in range(256):
        if b in printable:
            alphabet[chr(b)] = b
        else:
            alphabet[chr(256 + shifted)] = b
            shifted += 1
    return alphabet


_BYTE_LEVEL = _byte_level_alphabet()


class HFTokenizer:
    """Encode/decode with a `tokenizers.Tokenizer`.

    eos_token_ids: the ids that end generation (e.g. the model config's, which come from
    generation_config.json); when empty, the `eos_token` of tokenizer_config.json is used if present.
    """

    def __init__(self, tokenizer, eos_token_ids: Iterable[int] = (), bos_token_id: int | None = None):
        self._tok = tokenizer
        self.eos_token_ids: tuple[int, ...] = tuple(int(t) for t in eos_token_ids)
        self.bos_token_id = bos_token_id
        self._added = {i: t for i, t in tokenizer.get_added_tokens_decoder().items()}
        self._byte_level = type(tokenizer.decoder).__name__ == "ByteLevel"

    @classmethod
    def from_file(cls, tokenizer_json: str | os.PathLike, eos_token_ids: Iterable[int] = (),
                  bos_token_id: int | None = None) -> HFTokenizer:
        """Load `tokenizer.json`; special token ids fall back to a sibling tokenizer_config.json."""
        from tokenizers import Tokenizer

        path = Path(tokenizer_json)
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer file at {path}")
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - the tokenizers package raises bare Exceptions
            raise ModelLoadError(path, f"not a valid tokenizer file: {e}") from e
        eos = tuple(eos_token_ids)
        config_path = path.parent / "tokenizer_config.json"
        if config_path.is_file() and (not eos or bos_token_id is None):
            config = read_json(config_path)
            if not eos:
                eos_tok = _token_content(config.get("eos_token"))
                eos_id = tok.token_to_id(eos_tok) if eos_tok else None
                eos = (eos_id,) if eos_id is not None else ()
            if bos_token_id is None:
                bos_tok = _token_content(config.get("bos_token"))
                bos_token_id = tok.token_to_id(bos_tok) if bos_tok else None
        return cls(tok, eos, bos_token_id)

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike, eos_token_ids: Iterable[int] = (),
                        bos_token_id: int | None = None) -> HFTokenizer:
        """Load `folder/tokenizer.json`."""
        path = Path(folder) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {folder}")
        return cls.from_file(path, eos_token_ids, bos_token_id)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        """The first EOS id (None if there is none)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def special_token_ids(self) -> tuple[int, ...]:
        """Ids of the tokenizer's special added tokens (what `decode` skips)."""
        return tuple(sorted(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special))

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def tokenizer(self):
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    def encode(self, text: str | bytes, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. With add_special_tokens, the post-processor runs (e.g. adds BOS for Llama),
        as transformers' tokenizer call does. Bytes must be UTF-8 (a ValueError says where they are not): the
        engine accepts bytes prompts, and for the byte tokenizer any bytes are text."""
        if isinstance(text, bytes | bytearray | memoryview):
            try:
                text = bytes(text).decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"this tokenizer encodes text: the prompt's bytes are not UTF-8 ({e.reason} at "
                                 f"byte {e.start})") from None
        elif not isinstance(text, str):
            raise TypeError(f"encode takes str or bytes, got {type(text).__name__}")
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_pair(self, text: str, pair: str) -> list[int]:
        """Token ids of a text pair as the tokenizer's post-processor joins them (a cross-encoder's query and
        document: `[CLS] a [SEP] b [SEP]` for BERT's template), as transformers' `tokenizer(text, pair)`."""
        if not isinstance(text, str) or not isinstance(pair, str):
            raise TypeError(f"encode_pair takes two str, got {type(text).__name__} and {type(pair).__name__}")
        return list(self._tok.encode(text, pair, add_special_tokens=True).ids)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [list(e.ids) for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """The raw bytes the tokens stand for, special tokens dropped: a token holding part of a character gives
        its bytes (`decode` would give U+FFFD). Exact for byte-level BPE and for byte-fallback tokens (`<0xE2>`);
        other tokens give their decode's UTF-8. An id past the tokenizer's vocabulary (models pad theirs, e.g.
        Phi-3's 32,064 rows over 32,011 tokens) stands for no text, as in `decode`."""
        out = bytearray()
        for i in ids:
            i = int(i)
            added = self._added.get(i)
            if added is not None:
                if not added.special:
                    out += added.content.encode()
                continue
            piece = self._tok.id_to_token(i)
            if piece is None:
                continue
            if self._byte_level and all(c in _BYTE_LEVEL for c in piece):
                out += bytes(_BYTE_LEVEL[c] for c in piece)
            elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                out.append(int(piece[3:5], 16))
            else:
                out += self._tok.decode([i], skip_special_tokens=True).encode()
        return bytes(out)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size}, eos_token_ids={self.eos_token_ids})"
