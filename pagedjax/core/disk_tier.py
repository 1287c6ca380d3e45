"""The disk tier of one block pool: blocks the host tier drops (`pagedjax.core.host_tier`) are kept as files, one per
key, under a directory named by everything that makes a pool's KV differ (`pagedjax.runner.host_tier.kv_identity`:
model, weights, dtypes, layout, block size, parallel layout, backend), so a restarted server, or a second one started
later on the same directory, finds the prefixes an earlier one computed, and two configurations never share a file.

Plain Python, no JAX: a file holds a block's bytes as the runner lays them out (its host slot's arrays, one after
the other), which this module neither reads nor shapes. The host tier reads a file back into a host slot when a
prefix lookup reaches a key found only here; the runner writes a file for each block the host tier stores (the disk
tier is written through: it holds what the host ever held, within its bound).

File `<key hex>.kv`: MAGIC | u64 payload length | 32-byte checksum | payload. The checksum is BLAKE2b-256 keyed by
the directory's tag (the configuration's digest and the pool) over the key and the payload: a truncated, corrupt or
renamed file, or one copied in from another configuration's directory, fails it and is a miss (the file is removed),
never loaded. Files are written to a temporary name and renamed, so a reader never sees a partial one; a crash leaves
at most a temporary file, removed at the next start.

Bounded by `capacity` files: past it the least recently used (read or written) is deleted. At start the index is
the directory's files, least recently modified first (a read refreshes a file's time).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import struct
import time
from collections import OrderedDict
from pathlib import Path

from pagedjax.core.block_pool import BlockHash

logger = logging.getLogger(__name__)

MAGIC = b"PJKVBLK1"
_HEADER = struct.Struct("<8sQ32s")
HEADER_BYTES = _HEADER.size
_SUFFIX = ".kv"
_TEMP = ".tmp"


class DiskTier:
    """At most `capacity` block files under `directory` (created if missing), checked with `tag` (module
    docstring)."""

    def __init__(self, directory: str | os.PathLike, capacity: int, tag: bytes) -> None:
        if capacity < 1:
            raise ValueError(f"a disk tier needs room for at least one block, got {capacity}")
        self.capacity = capacity
        self._temp_names = itertools.count()
        self.num_read = self.num_written = self.num_bad = 0  # files read back, written, found bad (and removed)
        self.bytes_read = self.bytes_written = 0
        self.seconds = 0.0  # spent reading and writing files
        self.open(directory, tag)

    def open(self, directory: str | os.PathLike, tag: bytes) -> None:
        """Serve the files under `directory` (created if missing), checked with `tag`, from now on: the blocks of
        another configuration (new weights). The previous folder's files stay where they are."""
        if not 1 <= len(tag) <= 64:
            raise ValueError(f"a disk tier's tag is 1 to 64 bytes, got {len(tag)}")
        self.directory = Path(directory)
        self._tag = tag
        self.directory.mkdir(parents=True, exist_ok=True)
        self._files: OrderedDict[BlockHash, None] = OrderedDict()  # least recently used first
        found = []
        for entry in os.scandir(self.directory):
            if entry.name.endswith(_TEMP):  # a write a crash interrupted
                _remove(Path(entry.path))
            elif entry.name.endswith(_SUFFIX) and entry.is_file():
                try:
                    key = bytes.fromhex(entry.name[:-len(_SUFFIX)])
                except ValueError:
                    continue  # not a block file of ours
                found.append((entry.stat().st_mtime_ns, entry.name, key))
        for _, _, key in sorted(found):
            self._files[key] = None
        self._trim()

    def __len__(self) -> int:
        return len(self._files)

    def __contains__(self, key: BlockHash) -> bool:
        return key in self._files

    def path(self, key: BlockHash) -> Path:
        return self.directory / (key.hex() + _SUFFIX)

    def _checksum(self, key: BlockHash, payload: bytes | memoryview) -> bytes:
        h = hashlib.blake2b(digest_size=32, key=self._tag, person=b"pagedjax-kvfile")
        h.update(key)
        h.update(payload)
        return h.digest()

    def read(self, key: BlockHash) -> bytes | None:
        """The payload of `key`'s file, or None: not here, or the file is missing, truncated, corrupt or foreign
        (then it is removed and counted in `num_bad`)."""
        if key not in self._files:
            return None
        start = time.perf_counter()
        try:
            return self._read(key)
        finally:
            self.seconds += time.perf_counter() - start

    def _read(self, key: BlockHash) -> bytes | None:
        path = self.path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:  # removed behind our back (another server's bound): a plain miss
            del self._files[key]
            return None
        except OSError as e:
            logger.warning("disk tier: cannot read %s (%s): a miss", path, e)
            return None
        payload = memoryview(data)[HEADER_BYTES:]
        if len(data) < HEADER_BYTES:
            reason = f"{len(data)} bytes, shorter than a header"
        else:
            magic, length, checksum = _HEADER.unpack_from(data)
            reason = ("not a block file" if magic != MAGIC else
                      f"{len(payload)} payload bytes, the header says {length}" if length != len(payload) else
                      "checksum mismatch (corrupt, or another configuration's)"
                      if checksum != self._checksum(key, payload) else None)
        if reason is not None:
            logger.warning("disk tier: %s is bad (%s): removed, a miss", path, reason)
            del self._files[key]
            _remove(path)
            self.num_bad += 1
            return None
        self._files.move_to_end(key)
        try:
            os.utime(path)  # the least recently used order survives a restart
        except OSError:
            pass
        self.num_read += 1
        self.bytes_read += len(payload)
        return payload.tobytes()

    def write(self, key: BlockHash, payload: bytes) -> bool:
        """Keep `payload` as `key`'s block (a key already here is only refreshed). False if the file could not be
        written (a full or read-only disk: logged, the block is simply not kept)."""
        if key in self._files:
            self._files.move_to_end(key)
            return True
        start = time.perf_counter()
        try:
            return self._write(key, payload)
        finally:
            self.seconds += time.perf_counter() - start

    def _write(self, key: BlockHash, payload: bytes) -> bool:
        path = self.path(key)
        temp = path.with_name(f"{path.name}.{os.getpid()}.{id(self):x}.{next(self._temp_names)}{_TEMP}")
        try:
            with open(temp, "wb") as f:
                f.write(_HEADER.pack(MAGIC, len(payload), self._checksum(key, payload)))
                f.write(payload)
            os.replace(temp, path)
        except OSError as e:
            logger.warning("disk tier: cannot write %s (%s): the block is not kept", path, e)
            _remove(temp)
            return False
        self._files[key] = None
        self.num_written += 1
        self.bytes_written += len(payload)
        self._trim()
        return True

    def _trim(self) -> None:
        while len(self._files) > self.capacity:
            key, _ = self._files.popitem(last=False)
            _remove(self.path(key))

    def check_invariants(self) -> None:
        """AssertionError if the index is over its bound (for tests)."""
        assert len(self._files) <= self.capacity, "the disk tier holds more files than its capacity"


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as e:
        logger.warning("disk tier: cannot remove %s (%s)", path, e)
