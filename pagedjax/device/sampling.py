"""Token sampling on device: greedy, temperature, top-k, top-p, min-p, penalties, with per-request seeds, and
the log-probabilities of what was sampled.

Each row's random key depends only on its request's seed and on how many tokens it has generated, so the
same seed gives the same output whatever else is in the batch (and whether decode runs 1 or N steps a call).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class SamplingMetadata(NamedTuple):
    """Per-row sampling parameters, `[num_seqs]` each.

    temperature: f32, 0 = greedy; top_k: i32, <= 0 = off; top_p: f32, 1 = off; min_p: f32, 0 = off;
    seed_hi, seed_lo: u32 halves of a 64-bit seed; step: i32, tokens generated so far by the row's request.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    seed_hi: jax.Array
    seed_lo: jax.Array
    step: jax.Array

    @staticmethod
    def from_lists(temperature, top_k, top_p, seeds, steps, min_p=None) -> SamplingMetadata:
        seeds = np.asarray(seeds, dtype=np.uint64)
        min_p = np.zeros(len(seeds), np.float32) if min_p is None else min_p
        return SamplingMetadata(
            temperature=np.asarray(temperature, np.float32),
            top_k=np.asarray(top_k, np.int32),
            top_p=np.asarray(top_p, np.float32),
            min_p=np.asarray(min_p, np.float32),
            seed_hi=(seeds >> np.uint64(32)).astype(np.uint32),
            seed_lo=(seeds & np.uint64(0xFFFFFFFF)).astype(np.uint32),
            step=np.asarray(steps, np.int32),
        )


class PenaltyMetadata(NamedTuple):
    """Per-row penalties (OpenAI / Hugging Face semantics), present only in steps where some row uses them.

    presence, frequency, repetition: f32 `[S]` (0, 0, 1 = off); min_tokens: i32 `[S]`;
    output_counts: i32 `[S, vocab]` occurrences of each token in the row's output so far;
    prompt_mask: bool `[S, vocab]` tokens of the row's prompt; stop_ids: i32 `[S, K]` ids that cannot be sampled
    before min_tokens outputs (EOS and stop ids; -1 = none).
    """

    presence: jax.Array
    frequency: jax.Array
    repetition: jax.Array
    min_tokens: jax.Array
    output_counts: jax.Array
    prompt_mask: jax.Array
    stop_ids: jax.Array


def apply_penalties(logits: jax.Array, pen: PenaltyMetadata, num_outputs: jax.Array) -> jax.Array:
    """logits f32 `[S, vocab]` after the repetition penalty (on tokens of the prompt or output: positive
    logits divided by it, negative ones multiplied), then frequency (times the count) and presence (once)
    penalties on output tokens, and stop ids masked to -inf while `num_outputs` i32 `[S]` < min_tokens."""
    vocab = logits.shape[-1]
    counts = pen.output_counts
    in_output = counts > 0
    rep = pen.repetition[:, None]
    logits = jnp.where(in_output | pen.prompt_mask, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - pen.frequency[:, None] * counts - pen.presence[:, None] * in_output
    rows = jnp.arange(logits.shape[0])[:, None]
    stops = jnp.where(pen.stop_ids < 0, vocab, pen.stop_ids)  # -1 -> out of range, dropped
    is_stop = jnp.zeros(logits.shape, bool).at[rows, stops].set(True, mode="drop")
    return jnp.where(is_stop & (num_outputs < pen.min_tokens)[:, None], -jnp.inf, logits)


def apply_token_mask(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """logits f32 `[S, vocab]` with every token `mask` disallows set to -inf: mask i32 `[S, cdiv(vocab, 32)]`,
    token t allowed where bit t % 32 of word t // 32 is set (an all-ones row allows everything; structured
    output, `pagedjax.structured_output.compiler`)."""
    t = jnp.arange(logits.shape[-1])
    allowed = (mask[:, t // 32] >> (t % 32)) & 1
    return jnp.where(allowed != 0, logits, -jnp.inf)


def count_tokens(counts: jax.Array, tokens: jax.Array, active: jax.Array) -> jax.Array:
    """counts i32 `[S, vocab]` plus one occurrence of `tokens[s]` where `active[s]`."""
    rows = jnp.arange(counts.shape[0])
    return counts.at[rows, jnp.maximum(tokens, 0)].add(active.astype(counts.dtype))


def _row_key(seed_hi: jax.Array, seed_lo: jax.Array, step: jax.Array) -> jax.Array:
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(0), seed_hi), seed_lo)
    return jax.random.fold_in(key, step)


def filter_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  min_p: jax.Array | None = None) -> jax.Array:
    """Temperature-scaled logits with everything outside top-k / top-p / min-p set to -inf (min-p keeps the
    tokens whose probability is at least min_p times the most likely token's).

    logits: `[num_seqs, vocab]` float32. The most likely token always survives. A row with every filter off
    (top_k <= 0, top_p >= 1, min_p <= 0) is its scaled logits exactly, whatever the other rows ask for: "off"
    means off (top_p = 1 through the cumulative sum would cut a tail whose mass rounds to 0 in float32), and a
    row's values never depend on its batch. The vocabulary sort runs only when some row filters: on the CPU it is
    most of a sampled decode step's time (~150 ms of ~230 ms at batch 16 over 32k tokens).
    """
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    scaled = logits / t
    filters = (top_k > 0) | (top_p < 1)
    if min_p is not None:
        filters |= min_p > 0

    def cut() -> jax.Array:
        vocab = logits.shape[-1]
        order = jnp.argsort(-scaled, axis=-1)
        sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
        rank = jnp.arange(vocab)[None, :]
        k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)[:, None]
        keep = rank < k
        probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs  # probability of strictly more likely tokens
        keep &= (mass_before < top_p[:, None]) | (rank == 0)
        if min_p is not None:
            full_probs = jax.nn.softmax(sorted_logits, axis=-1)
            keep &= full_probs >= min_p[:, None] * full_probs[:, :1]
        filtered_sorted = jnp.where(keep, sorted_logits, -jnp.inf)
        # Scatter back to vocabulary order.
        filtered = jnp.zeros_like(scaled).at[jnp.arange(scaled.shape[0])[:, None], order].set(filtered_sorted)
        return jnp.where(filters[:, None], filtered, scaled)

    return jax.lax.cond(jnp.any(filters), cut, lambda: scaled)


def sample(logits: jax.Array, meta: SamplingMetadata, penalties: PenaltyMetadata | None = None, *,
           draws: bool = True) -> jax.Array:
    """Pick one token per row. logits `[num_seqs, vocab]` -> int32 `[num_seqs]`.

    `draws=False` (static) leaves the random draw out of the program, for a step whose rows are all greedy
    (temperature 0): the same tokens as `draws=True` gives them, and a program that compiles in about half the
    time on a small model (the draw's vocabulary sort, top-k / top-p / min-p cut and per-row keys are most of a
    2-layer step's HLO). With `draws=True` an all-greedy batch skips the draw at run time instead."""
    logits = logits.astype(jnp.float32)
    if penalties is not None:
        logits = apply_penalties(logits, penalties, meta.step)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not draws:
        return greedy

    def draw() -> jax.Array:
        filtered = filter_logits(logits, meta.temperature, meta.top_k, meta.top_p, meta.min_p)
        keys = jax.vmap(_row_key)(meta.seed_hi, meta.seed_lo, meta.step)
        sampled = jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)
        return jnp.where(meta.temperature > 0, sampled, greedy)

    # An all-greedy batch skips the sampling (and a batch without top-k / top-p / min-p skips the sort).
    return jax.lax.cond(jnp.any(meta.temperature > 0), draw, lambda: greedy)


class LogprobArrays(NamedTuple):
    """Log-probabilities (log-softmax in float32 of the raw logits) at `[N]` positions: of the chosen token,
    and the `num_top` most likely tokens, best first. Device arrays of a whole step; the host turns each row
    into the public per-token `pagedjax.TokenLogprobs` (`pagedjax.engine.output_processor`)."""

    logprob: jax.Array  # f32[N]
    top_ids: jax.Array  # i32[N, num_top]
    top_logprobs: jax.Array  # f32[N, num_top]


def token_logprobs(logits: jax.Array, tokens: jax.Array, num_top: int) -> LogprobArrays:
    """logits `[N, vocab]`, tokens i32 `[N]` (negative: any; its logprob is then meaningless)."""
    return chosen_logprobs(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), tokens, num_top)


def chosen_logprobs(logprobs: jax.Array, tokens: jax.Array, num_top: int) -> LogprobArrays:
    """`token_logprobs` from the log-softmax already taken: logprobs f32 `[N, vocab]`, tokens i32 `[N]`."""
    chosen = jnp.take_along_axis(logprobs, jnp.maximum(tokens, 0)[:, None], axis=-1)[:, 0]
    num_top = min(num_top, logprobs.shape[-1])
    if num_top:
        top_logprobs, top_ids = jax.lax.top_k(logprobs, num_top)
    else:
        top_logprobs = jnp.zeros((logprobs.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((logprobs.shape[0], 0), jnp.int32)
    return LogprobArrays(chosen, top_ids.astype(jnp.int32), top_logprobs)
