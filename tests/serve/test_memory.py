"""`pagedjax.serve.memory`: `trim_heap` gives freed malloc memory back to the system, and `HeapTrimmer` trims once
the resident memory grew past its threshold."""

from __future__ import annotations

import ctypes
import threading
import time

import pytest

from pagedjax.serve import memory

needs_glibc = pytest.mark.skipif(memory._malloc_trim() is None or memory.resident_bytes() is None,
                                 reason="glibc's malloc_trim and /proc/self/statm")


@needs_glibc
def test_trim_heap_gives_freed_heap_memory_back():
    """What glibc keeps after free(): blocks under the mmap threshold, below one still in use (the top of the heap
    pinned, so free() itself cannot shrink it): 64 MiB resident until `trim_heap`."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    block, count = 64 * 2**10, 1024  # under glibc's least mmap threshold (128 KiB): from the heap
    blocks = [libc.malloc(block) for _ in range(count + 1)]
    try:
        for address in blocks:
            ctypes.memset(address, 1, block)  # resident
        for address in blocks[:-1]:
            libc.free(address)
        before = memory.resident_bytes()
        assert memory.trim_heap()
        after = memory.resident_bytes()
    finally:
        libc.free(blocks[-1])
    assert before - after > count * block // 2, (before / 2**20, after / 2**20)


@needs_glibc
def test_the_trimmer_trims_when_resident_memory_grew_past_its_threshold(monkeypatch):
    resident, trims, lock = [1000], [], threading.Lock()

    def trim():
        with lock:
            trims.append(resident[0])
            resident[0] -= 150  # what the trim gave back
        return True

    monkeypatch.setattr(memory, "resident_bytes", lambda: resident[0])
    monkeypatch.setattr(memory, "trim_heap", trim)

    def settle(condition) -> None:
        deadline = time.monotonic() + 10
        while not condition():
            assert time.monotonic() < deadline
            time.sleep(0.005)

    trimmer = memory.HeapTrimmer(interval=0.005, threshold=100)
    try:
        with lock:
            resident[0] = 1100  # +100: not past the threshold
        time.sleep(0.1)
        assert trims == []
        with lock:
            resident[0] = 900  # freed meanwhile (unmapped): the floor follows it down
        time.sleep(0.1)
        with lock:
            resident[0] = 1050  # +150 over the floor of 900
        settle(lambda: trimmer.trims == 1)
        assert trims == [1050] and trimmer.released == 150 and resident[0] == 900
        time.sleep(0.1)
        assert trimmer.trims == 1  # the floor is what the trim left
    finally:
        trimmer.stop()
    assert not trimmer._thread.is_alive()
