"""The ground truth the engine tests compare against: greedy decoding by full recompute with the dense model
(`Llama.forward_dense`: no cache, every step recomputes the whole sequence)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pagedjax import ModelConfig
from pagedjax.model.llama import init_model


@functools.cache
def dense_forward(cfg: ModelConfig, seed: int):
    """jitted token ids `[B, S]` -> float32 logits `[B, S, vocab]` of `init_model(cfg, seed)`."""
    graphdef, state = nnx.split(init_model(cfg, seed))
    return jax.jit(lambda tokens: nnx.merge(graphdef, state).forward_dense(tokens))


def dense_greedy(cfg: ModelConfig, seed: int, prompts, max_tokens: int, max_len: int
                 ) -> tuple[list[list[int]], float]:
    """`greedy_by_recompute` with the dense model `init_model(cfg, seed)`."""
    return greedy_by_recompute(dense_forward(cfg, seed), prompts, max_tokens, max_len)


def greedy_by_recompute(forward, prompts, max_tokens: int, max_len: int) -> tuple[list[list[int]], float]:
    """Each prompt's greedy continuation of `max_tokens` tokens under `forward` (token ids `[B, max_len]` ->
    logits `[B, max_len, vocab]`), and the smallest top-1 / top-2 logit margin seen (a near tie would make
    "identical tokens" depend on rounding). Sequences are right-padded to `max_len` (causal attention: padding
    changes nothing before it), so one compilation serves every step."""
    seqs = [list(p) for p in prompts]
    margin = np.inf
    for _ in range(max_tokens):
        batch = np.zeros((len(seqs), max_len), np.int32)
        for i, s in enumerate(seqs):
            batch[i, : len(s)] = s
        logits = np.asarray(forward(jnp.asarray(batch)))
        for i, s in enumerate(seqs):
            row = logits[i, len(s) - 1]
            top2 = np.sort(row)[-2:]
            margin = min(margin, float(top2[1] - top2[0]))
            s.append(int(np.argmax(row)))
    return [s[len(p):] for s, p in zip(seqs, prompts, strict=True)], margin


def dense_beam_search(next_logprobs, width: int, max_tokens: int, eos, length_penalty: float = 1.0):
    """Beam search written independently of the engine's: the reference. `next_logprobs(tokens)` gives the
    log-probabilities `[vocab]` of the token after the prompt + `tokens` (-inf: not allowed). Each live beam
    offers its 2 * width best allowed tokens; the width best candidates by cumulative logprob go on; one ending
    in an `eos` id or reaching `max_tokens` is complete. Returns [(tokens, cumulative logprob)] best first by
    cum / len ** length_penalty."""
    live, complete = [([], 0.0)], []
    while live:
        candidates = []
        for bi, (tokens, cum) in enumerate(live):
            row = next_logprobs(tokens)
            for rank, t in enumerate(np.argsort(-row, kind="stable")[:2 * width]):
                if np.isfinite(row[t]):
                    candidates.append((-(cum + float(row[t])), bi, rank, int(t)))
        candidates.sort()
        survivors = []
        for neg, bi, _, t in candidates[:width]:
            beam = (live[bi][0] + [t], -neg)
            (complete if t in eos or len(beam[0]) >= max_tokens else survivors).append(beam)
        live = survivors
    complete.sort(key=lambda b: -b[1] / len(b[0]) ** length_penalty)
    return complete[:width]
