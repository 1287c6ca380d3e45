"""Several hosts from the command line: the same command on every host, `--nnodes N --node-rank I
--dist-init-addr HOST0:PORT` (or `--dist-init-addr auto`: JAX detects SLURM, Open MPI, Cloud TPU, GKE). Process 0
does the front end's work (reads the prompts, serves HTTP) through a `MultiHostEngine`; every other process
builds the same engine and follows it (`pagedjax.engine.multihost.follow`), printing and serving nothing.

A lost process ends the run: process 0's requests fail with the error, and every process leaves with exit code 2
at once (`os._exit`: JAX's own shutdown would wait for the lost process, then abort).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import socket
import sys
import time
from pathlib import Path

from pagedjax.cli.errors import EXIT_ERROR, EXIT_OK, CLIError

logger = logging.getLogger(__name__)

# Flags that differ between the processes of one run, or are secrets: left out of what every process compares.
_PER_PROCESS = frozenset({"node_rank", "api_key", "api_key_file", "host", "port", "log_level", "dist_join_timeout"})


def start(args: argparse.Namespace) -> int | None:
    """Join the other processes (`jax.distributed`) when the flags ask for several: this process's index then
    (0 leads), None for a run of one process. Call before anything uses JAX's devices. CLIError for flags that
    do not fit together."""
    if args.dist_init_addr is None:
        if args.nnodes > 1 or args.node_rank:
            raise CLIError("--nnodes / --node-rank need --dist-init-addr HOST:PORT (process 0's)")
        return None
    if args.data_parallel_size > 1:
        raise CLIError("--data-parallel-size with --dist-init-addr: replicas across hosts are not served yet (one "
                       "engine spans the processes: use --tensor-parallel-size)")
    from pagedjax.parallel.distributed import initialize

    if args.dist_init_addr == "auto":
        if args.nnodes > 1 or args.node_rank:
            raise CLIError("--dist-init-addr auto takes the process count and index from the cluster: leave out "
                           "--nnodes and --node-rank")
        try:
            initialize(join_timeout_s=math.ceil(args.dist_join_timeout))
        except ValueError as e:  # JAX found no cluster whose variables say where process 0 is, or how many run
            raise CLIError(f"--dist-init-addr auto found no cluster (SLURM, Open MPI, Cloud TPU, GKE): {e} Give "
                           "--dist-init-addr HOST:PORT with --nnodes and --node-rank") from None
    else:
        if args.node_rank >= args.nnodes:
            raise CLIError(f"--node-rank {args.node_rank} must be below --nnodes {args.nnodes}")
        host, _, port = args.dist_init_addr.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise CLIError(f"--dist-init-addr must be HOST:PORT (a port 1-65535), got {args.dist_init_addr!r}")
        if args.node_rank:
            _wait_for_coordinator(host, int(port), args.dist_join_timeout)
        initialize(args.dist_init_addr, num_processes=args.nnodes, process_id=args.node_rank,
                   join_timeout_s=math.ceil(args.dist_join_timeout))
    import jax

    # Read by `engine_setup.engine_config_of`: no background compiles across processes (`MultiHostEngine`).
    args.processes = jax.process_count()
    return jax.process_index() if args.processes > 1 else None


def _wait_for_coordinator(host: str, port: int, timeout_s: float) -> None:
    """Until process 0's coordinator takes a connection at host:port; CLIError after `timeout_s`. (JAX's own wait
    ends the process with a fatal log and an abort, not an error.)"""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), port), timeout=min(5.0, timeout_s)):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise CLIError(f"process 0's coordinator at {host}:{port} did not answer within {timeout_s:g} s "
                               f"({e.strerror or e}): is process 0 started with the same --dist-init-addr, and the "
                               "port open to this host? (--dist-join-timeout)") from None
            time.sleep(0.5)


def description(args: argparse.Namespace) -> dict:
    """What every process's command must agree on: its flags (but the per-process ones) and the model folder's
    files (names and sizes)."""
    flags = {k: str(v) for k, v in sorted(vars(args).items()) if k not in _PER_PROCESS}
    files = {}
    if args.model is not None and Path(args.model).is_dir():
        files = {str(p.relative_to(args.model)): p.stat().st_size for p in sorted(Path(args.model).rglob("*"))
                 if p.is_file()}
    return {"flags": flags, "model_files": files}


def leader(engine, args: argparse.Namespace, on_lost=None):
    """Process 0's engine: `MultiHostEngine` over `engine` (the processes compared first)."""
    from pagedjax.engine.multihost import MultiHostEngine, RanksMismatchError

    try:
        return MultiHostEngine(engine, timeout_s=args.dist_timeout, on_lost=on_lost, extra=description(args))
    except (RanksMismatchError, ValueError) as e:
        raise CLIError(str(e)) from None


def follower(engine, args: argparse.Namespace, prog: str) -> int:
    """Process i > 0: follow process 0 until it closes (EXIT_OK); a lost process or a mismatch leaves at once."""
    import jax

    from pagedjax.engine.multihost import RanksMismatchError, follow
    from pagedjax.errors import EngineUnavailable

    logger.info("process %d of %d: following process 0", jax.process_index(), jax.process_count())
    try:
        follow(engine, extra=description(args))
    except (RanksMismatchError, ValueError) as e:
        raise CLIError(str(e)) from None
    except EngineUnavailable as e:
        exit_lost(e, prog)
    return EXIT_OK


def exit_lost(error: BaseException, prog: str) -> None:
    """Say why (as `prog`) and leave now (see the module docstring)."""
    print(f"{prog}: error: {error}", file=sys.stderr, flush=True)
    logging.shutdown()
    os._exit(EXIT_ERROR)
