"""`EncoderCacheManager`: which images' features the device holds, by content hash, within a budget of feature rows,
and which requests still need each. Host accounting only (plain Python, no JAX): the scheduler decides here what a
step encodes and what may be dropped, and the runner keeps the arrays, following each plan's `encode_images` and
`free_images`.

An image is encoded in the step that first reaches its placeholder tokens, and its features stay while a request
has computed some of them but not all (a prompt chunked through the image). Once no request needs them they stay
cached, for another request with the same image or a recompute after a preemption, until their rows are needed
(least recently used first); a request that reaches an image whose features were dropped encodes it again.
"""

from __future__ import annotations

from collections import OrderedDict


class EncoderCacheManager:
    """Invariant: the rows of the cached images never exceed `budget`; an image some request references is never
    dropped; every dropped image is reported once by `take_freed`."""

    def __init__(self, budget: int):
        if budget < 1:
            raise ValueError(f"encoder cache budget must be >= 1 feature row, got {budget}")
        self.budget = budget
        self._rows: OrderedDict[str, int] = OrderedDict()  # cached images, least recently used first
        self._refs: dict[str, set[str]] = {}  # image -> requests that still need it (absent: none)
        self._freed: list[str] = []
        self.num_encoded = 0  # images encoded (each time), for statistics

    @property
    def num_used_rows(self) -> int:
        return sum(self._rows.values())

    def is_cached(self, content_hash: str) -> bool:
        return content_hash in self._rows

    def can_add(self, rows: int, keep=()) -> bool:
        """Whether `rows` more rows fit once every unreferenced image but those in `keep` is dropped."""
        kept = sum(n for h, n in self._rows.items() if self._refs.get(h) or h in keep)
        return kept + rows <= self.budget

    def add(self, content_hash: str, rows: int, request_id: str) -> None:
        """Make room for a new image's rows (dropping unreferenced images, least recently used first) and record it
        as cached and needed by `request_id`. RuntimeError if it does not fit (`can_add` says first)."""
        if content_hash in self._rows:
            raise RuntimeError(f"image {content_hash[:12]} is cached already")
        if not self.can_add(rows):
            raise RuntimeError(f"{rows} feature rows do not fit the encoder cache (check can_add first)")
        free = self.budget - self.num_used_rows
        for h in list(self._rows):
            if free >= rows:
                break
            if not self._refs.get(h):
                free += self._rows.pop(h)
                self._freed.append(h)
        self._rows[content_hash] = rows
        self.num_encoded += 1
        self.reference(content_hash, request_id)

    def reference(self, content_hash: str, request_id: str) -> None:
        """`request_id` needs this cached image (it becomes the most recently used)."""
        self._rows.move_to_end(content_hash)
        self._refs.setdefault(content_hash, set()).add(request_id)

    def release(self, request_id: str, hashes=None) -> None:
        """`request_id` no longer needs the given images (None: any); they stay cached."""
        for h in list(self._refs) if hashes is None else hashes:
            holders = self._refs.get(h)
            if holders is not None:
                holders.discard(request_id)
                if not holders:
                    del self._refs[h]

    def clear(self) -> None:
        """Forget every image, needed or not (a failed step: whatever it was to encode may be missing); requests
        that still need one encode it again when they next reach it."""
        self._freed.extend(self._rows)
        self._rows.clear()
        self._refs.clear()

    def take_freed(self) -> list[str]:
        """The images dropped since the last call (the runner frees their features)."""
        freed, self._freed = self._freed, []
        return freed

    def check(self, live_request_ids: set[str]) -> None:
        """AssertionError if the invariant is broken or a reference names a request that is not live."""
        assert self.num_used_rows <= self.budget, (self.num_used_rows, self.budget)
        for h, holders in self._refs.items():
            assert h in self._rows and holders, h
            assert holders <= live_request_ids, (h, holders - live_request_ids)
