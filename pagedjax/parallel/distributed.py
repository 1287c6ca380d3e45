"""Several hosts: one process per host, all running the same program (JAX's multi-controller model).

    from pagedjax.parallel.distributed import initialize
    initialize("10.0.0.1:9876", num_processes=2, process_id=int(os.environ["RANK"]))   # before any JAX work
    engine = LLMEngine.from_pretrained(path, parallel_config=ParallelConfig(tensor_parallel_size=16))

Every process runs the same scheduler on the same requests: the scheduler is deterministic, so each computes the
same plans and feeds the same (replicated) step inputs to the one SPMD program spanning all hosts' devices;
each reads the replicated sampled tokens from its own devices. Process 0 alone takes requests; what the others need
to make the same plans reaches them through `exchange` (`pagedjax.engine.multihost` drives it each step).

`exchange` and `allgather_bytes` are JAX's own collectives (`jax.experimental.multihost_utils`) over every device:
no socket of pagedjax's, no serialization but the bytes their callers make. A process that died makes them raise
at once (the collective library's connection error); one that stalls makes them wait (callers bound the wait).
"""

from __future__ import annotations

import logging
import struct

import jax
import numpy as np

logger = logging.getLogger(__name__)

FRAME_BYTES = 8192  # one exchange's frame per process; a longer payload follows in one more all-gather
_MAGIC = b"PJX1"
_HEADER = struct.Struct("<4sQI")  # magic, the sender's digest (uint64), the payload's length in bytes
_MIN_TAIL = 4096  # a payload's tail is padded to a power of two from here: few program shapes, one compile each


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, local_device_ids: list[int] | None = None,
               heartbeat_timeout_s: int = 100, join_timeout_s: int = 300) -> None:
    """`jax.distributed.initialize`, with the CPU backend's cross-process collectives (gloo) turned on first, so
    the same code runs on CPU hosts (and in tests, as several processes on one machine). Call it before
    anything else touches JAX's devices. Without arguments JAX detects the cluster (SLURM, Open MPI, Cloud TPU,
    GKE / Kubernetes jobs). `heartbeat_timeout_s`: how long JAX's coordination service waits for a silent process
    before it ends every process of the job; `join_timeout_s`: how long each process waits at start for all of them
    to join (past it JAX ends the process)."""
    if jax.config.jax_platforms in (None, "", "cpu") or str(jax.config.jax_platforms).startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes=num_processes, process_id=process_id,
                               local_device_ids=local_device_ids, heartbeat_timeout_seconds=heartbeat_timeout_s,
                               initialization_timeout=join_timeout_s)
    logger.info("process %d of %d: %d local devices, %d in all", jax.process_index(), jax.process_count(),
                jax.local_device_count(), jax.device_count())


def exchange(payload: bytes, digest: int) -> tuple[bytes, list[int]]:
    """One round between every process: process 0's `payload` to all (other processes' payloads must be empty),
    and each process's `digest` (a uint64 of its state, `pagedjax.engine.multihost`) to all. Returns
    (process 0's payload, the digests by process index). One all-gather of `FRAME_BYTES` per process; a payload
    longer than a frame holds sends its rest in one all-gather more (JAX 0.12.1's `broadcast_one_to_all`, a psum of
    bytes, hung over gloo: measured). Raises what the collective raises (a process
    that died: jax's runtime error), ValueError for a frame that is not one."""
    if jax.process_index() != 0 and payload:
        raise ValueError("only process 0 sends a payload")
    if not 0 <= digest < 2 ** 64:
        raise ValueError(f"digest must be a uint64, got {digest}")
    room = FRAME_BYTES - _HEADER.size
    frame = np.zeros(FRAME_BYTES, np.uint8)
    head = _HEADER.pack(_MAGIC, digest, len(payload)) + payload[:room]
    frame[:len(head)] = np.frombuffer(head, np.uint8)
    frames = np.asarray(_allgather(frame))  # uint8[processes, FRAME_BYTES]
    headers = [_HEADER.unpack(frames[p, :_HEADER.size].tobytes()) for p in range(frames.shape[0])]
    for p, (magic, _, _) in enumerate(headers):
        if magic != _MAGIC:
            raise ValueError(f"process {p} sent a frame that is not pagedjax's (magic {magic!r})")
    size = headers[0][2]
    data = frames[0, _HEADER.size:_HEADER.size + min(size, room)].tobytes()
    if size > room:  # the rest, padded alike on every process (each read the length from process 0's header)
        tail = np.zeros(max(_MIN_TAIL, 1 << (size - room - 1).bit_length()), np.uint8)
        if jax.process_index() == 0:
            tail[:size - room] = np.frombuffer(payload[room:], np.uint8)
        data += np.asarray(_allgather(tail))[0, :size - room].tobytes()
    return data, [h[1] for h in headers]


def allgather_bytes(data: bytes) -> list[bytes]:
    """Every process's `data`, by process index (two all-gathers: the lengths, then the bytes padded to the
    longest)."""
    sizes = np.asarray(_allgather(np.array([len(data)], np.int64))).reshape(-1)
    buf = np.zeros(max(int(sizes.max()), 1), np.uint8)
    buf[:len(data)] = np.frombuffer(data, np.uint8)
    rows = np.asarray(_allgather(buf)).reshape(len(sizes), -1)
    return [rows[p, :int(n)].tobytes() for p, n in enumerate(sizes)]


def _allgather(x: np.ndarray) -> np.ndarray:
    from jax.experimental.multihost_utils import process_allgather

    return process_allgather(x)
