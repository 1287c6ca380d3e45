"""Shared pytest configuration: hypothesis profiles and CPU-only JAX set-up.

Profiles (select with HYPOTHESIS_PROFILE=...):
  ci   (default) derandomized: a fixed seed, so a landing is never blocked by chance.
  dev  random and larger: run it while developing; turn every failure into an @example.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Engines share compiled programs through JAX's persistent cache (each engine compiles its own steps; this
# makes the second engine of a shape load them from disk). Kept between local runs; CI starts empty.
os.environ.setdefault("PAGEDJAX_COMPILE_CACHE",
                      os.path.join(os.path.dirname(os.path.dirname(__file__)), ".pytest_cache", "jax-compile-cache"))

import jax  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# float32 references must be computed at full precision on every backend.
jax.config.update("jax_default_matmul_precision", "highest")

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=25,
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
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_sessionfinish(session, exitstatus):
    # pytest-xdist interrupts a worker still busy 5 s after the run; pytest's last gc.collect() over a
    # worker's millions of JAX tracing objects could take that long, so the interrupt landed in a gc
    # callback (a "KeyboardInterrupt" traceback at the end of every run). Frozen objects are not scanned.
    import gc

    gc.freeze()
