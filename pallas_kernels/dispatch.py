"""The entry points' shared prologue: which kernel family (`gpu` or `tpu`) runs a call."""

from __future__ import annotations

import jax
from jax.experimental.pallas import tpu as pltpu

TARGETS = ("auto", "gpu", "tpu")


def resolve_target(target: str, interpret) -> str:
    """The kernel family a public entry point runs: "tpu" (Mosaic) or "gpu" (Triton). "auto" is "tpu" on a
    TPU backend and "gpu" everywhere else (compiled on a GPU, the Pallas interpreter on a CPU)."""
    if not isinstance(target, str) or target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    if target == "auto":
        target = "tpu" if jax.default_backend() == "tpu" else "gpu"
    if target == "gpu" and isinstance(interpret, pltpu.InterpretParams):
        raise ValueError("interpret=InterpretParams(...) configures the TPU interpret mode; it needs target='tpu'")
    return target


def tpu_has_no(name: str, value) -> None:
    if value is not None:
        raise ValueError(f"{name} tiles the GPU kernels' state columns; target 'tpu' keeps whole states in VMEM "
                         f"(leave {name} None)")
