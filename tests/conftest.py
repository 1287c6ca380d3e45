"""Shared pytest configuration: hypothesis profiles and CPU-only JAX set-up.

Profiles (select with HYPOTHESIS_PROFILE=...):
  ci     (default) derandomized: a fixed seed, so a landing is never blocked by chance.
  dev    random and larger: run it while developing; turn every failure into an @example.
  smoke  derandomized and a fifth of ci's examples: CI's newest-JAX pass, which checks what differs by JAX
         version (APIs, lowering), not the properties the ci pass already covers.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite compiles hundreds of small programs and runs each a few times, so XLA's LLVM optimisations cost more
# compile time than they save: at -O0 the whole suite takes 40% less CPU time. The HLO (what is computed) is the
# same; the machine code may round differently (no fused multiply-adds, other summation orders), which every
# tolerance covers. What it changes is a bit-level property of the optimised code: a test of one
# (`@pytest.mark.xla_default`) is skipped at -O0; scripts/test.sh runs those tests at XLA's default level
# (PAGEDJAX_TEST_XLA_OPT=default) after the suite. Set before JAX starts; subprocesses (the 8-device worker, the
# CLI runs) inherit it.
XLA_DEFAULT = os.environ.get("PAGEDJAX_TEST_XLA_OPT") == "default"
# XLA:CPU's MLIR fusion emitters took twice the compile time of its older loop emitters on the suite's programs
# (tests/engine/test_sampling_surface.py: 88 s of CPU time with them, 40 s without; most of the suite's time is
# compiling) and emit code for the same HLO. Newer XLA has only the MLIR emitters, and an XLA flag it does not know
# aborts the process, so the flag is passed where a probe (once per run: subprocesses and xdist workers inherit
# the answer) finds that this XLA accepts it.
LEGACY_EMITTERS_FLAG = "--xla_cpu_use_fusion_emitters=false"
# XLA:CPU splits each program's LLVM module into parts compiled on a thread pool: for the suite's small programs
# the parts cost more CPU time than the one module (an engine's steps: 20% less backend compile time, 10% less
# in all, with one part), and in CI both cores are busy with the two xdist workers anyway. Same code.
ONE_CODEGEN_PART_FLAG = "--xla_cpu_parallel_codegen_split_count=1"
# Optional flags -> the variable that carries the probe's answer to subprocesses and xdist workers.
_OPTIONAL_FLAGS = {LEGACY_EMITTERS_FLAG: "PAGEDJAX_TEST_LEGACY_EMITTERS",
                   ONE_CODEGEN_PART_FLAG: "PAGEDJAX_TEST_ONE_CODEGEN_PART"}


def _xla_accepts(*flags: str) -> bool:
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True)
    return probe.returncode == 0


if not XLA_DEFAULT:
    unknown = [flag for flag, var in _OPTIONAL_FLAGS.items() if var not in os.environ]
    together = len(unknown) > 1 and _xla_accepts(*unknown)  # one probe where this XLA knows them all
    for flag in unknown:
        os.environ[_OPTIONAL_FLAGS[flag]] = "1" if together or _xla_accepts(flag) else "0"
    optional = [flag for flag, var in _OPTIONAL_FLAGS.items() if os.environ[var] == "1"]
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0",
                                        "--xla_llvm_disable_expensive_passes=true", *optional]).strip()
# Engines share compiled programs through JAX's persistent cache (each engine compiles its own steps; this
# makes the second engine of a shape load them from disk). Kept between local runs; CI starts empty.
os.environ.setdefault("PAGEDJAX_COMPILE_CACHE",
                      os.path.join(os.path.dirname(os.path.dirname(__file__)), ".pytest_cache", "jax-compile-cache"))
# ... set up here, through JAX's own variables (this process, xdist workers and subprocesses: the engine and the CLI
# keep a folder JAX was given), without JAX's eviction: with a size limit (pagedjax's 2 GiB) JAX's cache lists the
# whole folder, stats every program and reads its access-time file on every write, and the suite writes ~4,600
# programs: 0.14 s a write near the end, ~300 s of CPU time in all, growing with the square of the suite. Instead a
# local folder is cut back once per run, before any test (`_prune_compile_cache`). Tests of the cache's own
# set-up (tests/cli/test_cli.py) run the CLI without these variables.
_COMPILE_CACHE = os.environ["PAGEDJAX_COMPILE_CACHE"]
_COMPILE_CACHE_BYTES = 1 << 30  # a local folder past this loses its oldest programs, down to half
if _COMPILE_CACHE.strip().lower() not in ("0", "off", "false", "no", "none", ""):
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _COMPILE_CACHE)
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", "-1")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def _prune_compile_cache(folder: str, limit: int) -> None:
    """Past `limit` bytes, delete the folder's least recently written programs until it holds half of it."""
    import pathlib

    entries = [(p.stat().st_mtime, p.stat().st_size, p) for p in pathlib.Path(folder).glob("*-cache")]
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries) if total > limit else ():
        if total <= limit // 2:
            break
        path.unlink(missing_ok=True)
        path.with_name(path.name.removesuffix("-cache") + "-atime").unlink(missing_ok=True)
        total -= size


if "PYTEST_XDIST_WORKER" not in os.environ and os.path.isdir(os.environ.get("JAX_COMPILATION_CACHE_DIR", "")):
    _prune_compile_cache(os.environ["JAX_COMPILATION_CACHE_DIR"], _COMPILE_CACHE_BYTES)

import gc  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# float32 references must be computed at full precision on every backend.
jax.config.update("jax_default_matmul_precision", "highest")

# (CI time) 15 examples a property by default (25, then 20, until the suite outgrew CI's 12 minutes; the kernels'
# counts scale with it, `tests.kernels.cases.examples`); the dev profile runs 200 random ones.
settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=15,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    max_examples=200,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("smoke", settings.get_profile("ci"), max_examples=5)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    if XLA_DEFAULT:
        return
    skip = pytest.mark.skip(reason="a property of XLA's default optimisation level: run with "
                                   "PAGEDJAX_TEST_XLA_OPT=default (scripts/test.sh does, after the suite)")
    for item in items:
        if "xla_default" in item.keywords:
            item.add_marker(skip)


# The collector's default thresholds run a young-generation collection every 700 allocations, and JAX's tracing
# allocates millions of objects (most freed by reference count): ~4,700 collections and 3.4 s of CPU time in four
# engine and model test files, 40 and 1.5 s every 50,000 allocations. Cyclic garbage waits for those, or for the
# full collection before each module (below).
gc.set_threshold(50_000, 20, 10)


@pytest.fixture(autouse=True, scope="module")
def _gc_freeze_between_modules():
    """Before each test module: collect, then move every live object out of the collector's generations. A
    worker accumulates millions of JAX objects (traces, jaxprs, executables) over the suite, and every full
    collection walked them all: a module's tests ran 2-4x slower late in a worker than alone (in CI the MoE
    tests took 36 s instead of 4; test_engine_properties + test_kv_quant + test_moe in one process: 250 s, 114 s
    frozen). Objects that die by reference count are still freed; only cycles among frozen objects leak."""
    gc.collect()
    gc.freeze()
    yield


@pytest.fixture(autouse=True)
def _fresh_traces_when_patched(request):
    """Engines of one model structure share their traced programs in a process (`pagedjax.runner.runner._jitted`),
    so a test that monkeypatches code a step traces (a recorder, a fake KV write) would otherwise run an earlier
    test's trace: such a test starts and ends with JAX's caches cleared. A test that patches between two engines of
    one structure clears them itself."""
    patched = "monkeypatch" in request.fixturenames
    if patched:
        jax.clear_caches()
    yield
    if patched:
        jax.clear_caches()


def pytest_sessionfinish(session, exitstatus):
    # pytest-xdist interrupts a worker still busy 5 s after the run; pytest's last gc.collect() over a
    # worker's millions of JAX tracing objects could take that long, so the interrupt landed in a gc
    # callback (a "KeyboardInterrupt" traceback at the end of every run). Frozen objects are not scanned.
    gc.freeze()
