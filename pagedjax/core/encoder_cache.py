"""`EncoderCacheManager`: which images' features the device holds, by content hash, in a fixed number of slots (one
image's feature rows each), and which requests still need each. Host accounting only (plain Python, no JAX): the
scheduler decides here what a step encodes and into which slot, and the runner keeps one feature array of
`num_slots` images, writing each plan's `encode_images` into their slots before the step runs.

An image is encoded in the step that first reaches its placeholder tokens, and its features stay while a request
has computed some of them but not all (a prompt chunked through the image). Once no request needs them they stay
cached, for another request with the same image or a recompute after a preemption, until their slot is needed
(least recently used first); a request that reaches an image whose features were dropped encodes it again.
"""

from __future__ import annotations

from collections import OrderedDict


class EncoderCacheManager:
    """Invariant: each cached image holds one slot of `num_slots` and no two hold the same; an image some request
    references is never dropped."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"the encoder cache needs at least one image slot, got {num_slots}")
        self.num_slots = num_slots
        self._slots: OrderedDict[str, int] = OrderedDict()  # cached images -> slot, least recently used first
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._refs: dict[str, set[str]] = {}  # image -> requests that still need it (absent: none)
        self.num_encoded = 0  # images encoded (each time), for statistics

    @property
    def num_cached(self) -> int:
        return len(self._slots)

    def is_cached(self, content_hash: str) -> bool:
        return content_hash in self._slots

    def slot_of(self, content_hash: str) -> int:
        return self._slots[content_hash]

    def can_add(self, num_images: int, keep=()) -> bool:
        """Whether `num_images` more images fit once every unreferenced image but those in `keep` is dropped."""
        kept = sum(1 for h in self._slots if self._refs.get(h) or h in keep)
        return kept + num_images <= self.num_slots

    def add(self, content_hash: str, request_id: str) -> int:
        """A slot for a new image (dropping the least recently used unreferenced image if none is free), recorded as
        cached and needed by `request_id`. RuntimeError if none can be had (`can_add` says first)."""
        if content_hash in self._slots:
            raise RuntimeError(f"image {content_hash[:12]} is cached already")
        if not self._free:
            victim = next((h for h in self._slots if not self._refs.get(h)), None)
            if victim is None:
                raise RuntimeError("no encoder cache slot is free or unreferenced (check can_add first)")
            self._free.append(self._slots.pop(victim))
        self._slots[content_hash] = slot = self._free.pop()
        self.num_encoded += 1
        self.reference(content_hash, request_id)
        return slot

    def reference(self, content_hash: str, request_id: str) -> None:
        """`request_id` needs this cached image (it becomes the most recently used)."""
        self._slots.move_to_end(content_hash)
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
        self._free.extend(self._slots.values())
        self._slots.clear()
        self._refs.clear()

    def check(self, live_request_ids: set[str]) -> None:
        """AssertionError if the invariant is broken or a reference names a request that is not live."""
        used = list(self._slots.values())
        assert len(set(used)) == len(used) and not set(used) & set(self._free), "a slot held twice"
        assert sorted(used + self._free) == list(range(self.num_slots)), "a slot lost"
        for h, holders in self._refs.items():
            assert h in self._slots and holders, h
            assert holders <= live_request_ids, (h, holders - live_request_ids)
