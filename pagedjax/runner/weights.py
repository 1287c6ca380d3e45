"""An engine inside a training loop: new weights in place, and the KV pool's memory lent to the trainer.

`update_weights(runner, scheduler, params)`: the compiled step programs take the weights as an argument (see
`runner._jitted`), so new weights of the same structure, shapes, dtypes and shardings serve from the next step
on with no recompilation, and no copy: the runner holds the caller's arrays themselves. Anything else is
refused before the engine changes, naming the first leaf that differs (its path in the params tree).

`sleep(runner, scheduler)` deletes the KV pool's device arrays (the trainer can use that memory); `wake(runner)`
allocates a zero pool of the same shapes, dtype and sharding, which the compiled programs take as they are.

Policy for requests in flight (one, for both): nothing computed under the old state is read again. Every
running request is preempted by recompute (`Scheduler.drop_computed_kv`, the path a lost KV cache takes), and
the prefix cache forgets every block, since cached KV was computed by the old weights (or is gone). Tokens
already generated stay; a request's later tokens attend to KV recomputed by the new weights over its whole
sequence, so it continues exactly as a fresh engine with the new weights would continue that sequence. Waiting
requests are untouched. Call these between steps, on the thread that steps the engine.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import jax
from flax import nnx

if TYPE_CHECKING:
    from pagedjax.core.scheduler import Scheduler
    from pagedjax.runner.runner import ModelRunner

logger = logging.getLogger(__name__)


def leaf_name(path) -> str:
    """A params leaf's path as dotted text (`layers.0.self_attn.q_proj.kernel`)."""
    name = jax.tree_util.keystr(path, simple=True, separator=".")
    return name.removesuffix(".value")  # nnx.State leaves sit in a Variable's `value`


def _state(params) -> nnx.State:
    if isinstance(params, nnx.Module):
        return nnx.state(params)
    return params


def checked_leaves(expected: nnx.State, params) -> list[jax.Array]:
    """`params`' leaves in `expected`'s order, if `params` (an `nnx.State` or a module) has `expected`'s tree
    structure and each leaf is a live `jax.Array` of the expected shape, dtype and sharding. Otherwise a
    ValueError (TypeError for a leaf that is not a `jax.Array`) naming the first leaf that differs."""
    want = jax.tree_util.tree_flatten_with_path(expected)[0]
    got_leaves, got_def = jax.tree_util.tree_flatten_with_path(_state(params))
    if got_def != jax.tree.structure(expected):
        want_names = [leaf_name(p) for p, _ in want]
        got_names = [leaf_name(p) for p, _ in got_leaves]
        missing = [n for n in want_names if n not in set(got_names)]
        extra = [n for n in got_names if n not in set(want_names)]
        detail = (f"missing leaf {missing[0]!r}" if missing else f"unexpected leaf {extra[0]!r}" if extra
                  else "the same leaf names in another tree structure")
        raise ValueError(f"update_weights: params do not have the model's structure: {detail} "
                         f"({len(got_names)} leaves, the model has {len(want_names)})")
    leaves = []
    for (path, ref), (_, x) in zip(want, got_leaves, strict=True):
        name = leaf_name(path)
        if not isinstance(x, jax.Array):
            raise TypeError(f"update_weights: leaf {name!r} is a {type(x).__name__}, not a jax.Array on the "
                            f"engine's devices (put it there with jax.device_put(x, {ref.sharding}))")
        if x.is_deleted():
            raise ValueError(f"update_weights: leaf {name!r} was deleted (donated to another computation?)")
        if x.shape != ref.shape or x.dtype != ref.dtype:
            raise ValueError(f"update_weights: leaf {name!r} is {x.dtype}{list(x.shape)}, the model's is "
                             f"{ref.dtype}{list(ref.shape)}")
        if not x.sharding.is_equivalent_to(ref.sharding, x.ndim):
            raise ValueError(f"update_weights: leaf {name!r} has sharding {x.sharding}, the engine's is "
                             f"{ref.sharding}")
        leaves.append(x)
    return leaves


def update_weights(runner: ModelRunner, scheduler: Scheduler, params) -> None:
    """Serve `params` from the next step on (see the module's docstring); nothing changes if they are
    refused. The runner keeps the arrays given: do not donate or delete them while the engine serves them
    (except what `ModelRunner.served_params` copies: a mixture-of-experts model's experts on one CPU device)."""
    runner.set_params(checked_leaves(runner.params, runner.served_params(_state(params))))
    scheduler.drop_computed_kv()


def sleep(runner: ModelRunner, scheduler: Scheduler) -> int:
    """Delete the KV pool's device arrays; returns the bytes freed on each device (0 if already asleep).
    Steps are refused until `wake`."""
    if runner.asleep:
        return 0
    scheduler.drop_computed_kv()
    return release_kv(runner)


def release_kv(runner: ModelRunner) -> int:
    """Delete `runner`'s KV arrays (the host forgets what they held); returns the bytes freed on each device.
    Its steps are refused until `wake`."""
    freed = runner.kv_cache.nbytes_per_device
    for x in jax.tree.leaves(runner.kv_cache):
        x.delete()
    runner.asleep = True
    logger.info("sleep: released a KV pool (%.1f MiB per device)", freed / 2**20)
    return freed


def wake(runner: ModelRunner) -> float:
    """Allocate the KV pool again (zeros, as at start: every block is unwritten after `sleep`); returns the
    seconds it took, until the arrays exist on device (0.0 if awake)."""
    if not runner.asleep:
        return 0.0
    start = time.perf_counter()
    runner.reset_kv_cache()
    jax.block_until_ready(runner.kv_cache)
    runner.asleep = False
    seconds = time.perf_counter() - start
    logger.info("wake: re-created the KV pool in %.3f s", seconds)
    return seconds
