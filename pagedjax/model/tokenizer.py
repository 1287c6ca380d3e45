"""A byte-level tokenizer: token i < 256 is the byte i; then BOS, EOS and PAD.

Every string (and every byte string, valid UTF-8 or not) encodes losslessly, and a model over it needs no
vocabulary file: a pagedjax checkpoint whose vocab_size is 259 and that has no tokenizer.json loads with it
(`scripts/train_tiny.py --tokenizer byte` trains one; the bundled model uses a BPE vocabulary instead).

    tok = ByteTokenizer()
    ids = tok.encode("héllo")          # [256, 104, 195, 169, 108, 108, 111]
    tok.decode(ids)                    # "héllo"
"""

from __future__ import annotations

from collections.abc import Iterable


class ByteTokenizer:
    """256 byte tokens + BOS=256, EOS=257, PAD=258 (vocab 259)."""

    num_byte_tokens: int = 256
    bos_token_id: int = 256
    eos_token_id: int = 257
    pad_token_id: int = 258
    vocab_size: int = 259

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self.eos_token_id,)

    @property
    def special_token_ids(self) -> tuple[int, ...]:
        return (self.bos_token_id, self.eos_token_id, self.pad_token_id)

    def encode(self, text: str | bytes | bytearray | memoryview, add_bos: bool = True,
               add_eos: bool = False) -> list[int]:
        """Text (encoded as UTF-8) or raw bytes -> token ids, with BOS first unless `add_bos=False`.

        A string that carries raw bytes as lone surrogates U+DC80..U+DCFF (Python's `surrogateescape`, as
        in file names and `open(..., errors="surrogateescape")`) encodes back to exactly those bytes."""
        if isinstance(text, str):
            try:
                data = text.encode("utf-8", errors="surrogateescape")
            except UnicodeEncodeError:  # other lone surrogates: kept as their 3-byte forms
                data = text.encode("utf-8", errors="surrogatepass")
        elif isinstance(text, bytes | bytearray | memoryview):
            data = bytes(text)
        else:
            raise TypeError(f"encode takes str or bytes, got {type(text).__name__}")
        ids = list(data)
        if add_bos:
            ids.insert(0, self.bos_token_id)
        if add_eos:
            ids.append(self.eos_token_id)
        return ids

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Token ids -> the raw bytes they stand for; special tokens are dropped.

        Raises ValueError for an id outside the vocabulary.
        """
        out = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < self.num_byte_tokens:
                out.append(i)
            elif not self.num_byte_tokens <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the byte vocabulary [0, {self.vocab_size})")
        return bytes(out)

    def decode(self, ids: Iterable[int]) -> str:
        """Token ids -> text: UTF-8 with invalid sequences replaced by U+FFFD; special tokens dropped."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=259, bos=256, eos=257, pad=258)"


__all__ = ["ByteTokenizer"]
