"""The trainer's side of on-policy RL: per-token log-probabilities whose values are the rollout engine's, bit for
bit, and whose gradient is the dense forward's.

Why not one forward for both: XLA compiles each program on its own, and the same forward computes other bits
inside a gradient program than alone (measured on this project's CPU with a 2-layer Llama: `jit(forward)` and the
forward inside `jit(value_and_grad(forward))` differ by up to 1.9e-6 in log-probabilities; the engine's step is a
third program). So no training forward can promise the bits of the engine's compiled step, and `exact_logprobs`
takes each part from where it is exact: the values from the engine (a rollout's own `logprobs`, or
`LLMEngine.score` of the same tokens after `update_weights` for a later minibatch; with `batch_invariant=True` both
are the bits sampling gives those tokens in any batch), the derivative from the dense forward:

    exact = engine + (dense - stop_gradient(dense))

whose value is `engine` exactly (d - d is +0 for every finite d, and e + 0 is e for every e but -0, which no
log-softmax returns) and whose gradient is dense's.
A policy-gradient loss over it sees an importance ratio exp(exact - rollout) of exactly 1 before the first update.

    batch = completion_batch(prompts, completions, pad_id=pad)      # tokens [B, W], mask [B, W - 1]
    rollout = scatter_logprobs(batch, [[lp.logprob for lp in c.logprobs] for c in samples])  # at the mask's places
    def loss(params):
        lp = exact_logprobs(dense_logprobs(nnx.merge(graphdef, params), batch.tokens), rollout)
        ...
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class CompletionBatch(NamedTuple):
    """Prompt + completion pairs as a trainer's padded arrays.

    tokens  i32[B, W]      prompt then completion, right-padded with the pad id
    mask    f32[B, W - 1]  1 where position t's logits predict a completion token (tokens[:, t + 1]), else 0
    """

    tokens: np.ndarray
    mask: np.ndarray


def completion_batch(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], *,
                     width: int | None = None, pad_id: int = 0) -> CompletionBatch:
    """Pad (prompt, completion) token-id pairs into a `CompletionBatch` of `width` columns (default: the longest
    pair's length; a fixed width keeps one compiled training step). ValueError for unequal counts, an empty
    prompt (nothing predicts the first completion token) or a pair longer than `width`; an empty completion is a
    row of zeros in the mask."""
    if len(prompts) != len(completions):
        raise ValueError(f"completion_batch: {len(prompts)} prompts for {len(completions)} completions")
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)]
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"completion_batch: prompt {i} is empty (its first completion token has no logits)")
    need = max(lengths, default=1)
    width = need if width is None else width
    if width < max(need, 2):
        raise ValueError(f"completion_batch: width {width} < {max(need, 2)} (the longest pair, and at least 2)")
    tokens = np.full((len(prompts), width), pad_id, np.int32)
    mask = np.zeros((len(prompts), width - 1), np.float32)
    for row, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        tokens[row, :len(p) + len(c)] = list(p) + list(c)
        mask[row, len(p) - 1:len(p) + len(c) - 1] = 1.0
    return CompletionBatch(tokens, mask)


def scatter_logprobs(batch: CompletionBatch, logprobs: Sequence[Sequence[float]]) -> np.ndarray:
    """f32[B, W - 1]: each row's completion log-probabilities (a rollout's, or `LLMEngine.score`'s) at the places
    its mask marks, 0 elsewhere: the `engine` argument of `exact_logprobs`. ValueError when a row's count is not
    its completion's length."""
    if len(logprobs) != len(batch.mask):
        raise ValueError(f"scatter_logprobs: {len(logprobs)} rows of log-probabilities for a batch of "
                         f"{len(batch.mask)}")
    out = np.zeros(batch.mask.shape, np.float32)
    for row, lps in enumerate(logprobs):
        places = np.flatnonzero(batch.mask[row])
        if len(lps) != len(places):
            raise ValueError(f"scatter_logprobs: row {row} has {len(lps)} log-probabilities for a completion of "
                             f"{len(places)} tokens")
        out[row, places] = np.asarray(lps, np.float32)
    return out


def dense_logprobs(model, tokens: jax.Array) -> jax.Array:
    """f32[B, W - 1]: log p(tokens[:, t + 1] | tokens[:, :t + 1]) by the model's dense forward (`forward_dense`:
    causal, no cache, the engine's mathematics) - the part of `exact_logprobs` that carries the gradient. Right
    padding does not change a real position's value (causal attention never looks right)."""
    logits = model.forward_dense(tokens)  # f32[B, W, vocab]
    lps = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(lps, tokens[:, 1:, None], axis=-1)[..., 0]


def exact_logprobs(dense: jax.Array, engine: jax.Array) -> jax.Array:
    """`engine`'s values bit for bit with `dense`'s gradient: `engine + (dense - stop_gradient(dense))` (see the
    module docstring). Both f32 of one shape (ValueError otherwise). A non-finite `dense` value makes that place
    NaN, never the engine's number: a broken trainer forward does not hide behind the rollout's values."""
    if dense.shape != engine.shape:
        raise ValueError(f"exact_logprobs: dense {dense.shape} and engine {engine.shape} log-probabilities differ "
                         "in shape")
    if dense.dtype != jnp.float32 or jnp.asarray(engine).dtype != jnp.float32:
        raise ValueError(f"exact_logprobs: float32 log-probabilities expected, got dense {dense.dtype} and engine "
                         f"{jnp.asarray(engine).dtype}")
    return engine + (dense - jax.lax.stop_gradient(dense))
