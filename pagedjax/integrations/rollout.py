"""An `LLMEngine` as an RL framework's rollout worker, in the arrays such frameworks exchange (Tunix's
`BaseRollout` among them: `pagedjax.integrations.tunix` is this class behind Tunix's interface).

What it adds to the engine: samples of a prompt repeated k times in a row (GRPO's group) become one request with
`n=k`, so the k samples share the prompt's prefill and KV blocks (forked, `Scheduler`), seeded so that sample j of
the batch uses `seed + j` however the batch groups; prompts cut to their last `max_prompt_length` tokens (said in
a warning) and left-padded; each completion without its stop token, with its log-probabilities; scoring of
padded (prompt, completion) arrays by the engine's own step (`LLMEngine.score`). Weights change in place
(`update_params` is `LLMEngine.update_weights`: no copy, no recompilation) and the KV pool can be released around
a training step (`sleep`, woken by the next call; `sleep_when_idle` after every call).

Log-probabilities are those of the raw logits (`SamplingParams`), as the trainer's forward computes them at
temperature 1; with `batch_invariant=True` on the engine, a completion's rollout log-probabilities and its score
are the same bits in any batch (`pagedjax.runner.invariant`), the values `pagedjax.integrations.policy` trains on.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby

import numpy as np

from pagedjax.sampling_params import LoRARequest, SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rollouts:
    """One `RolloutEngine.generate` call's samples, in the prompts' order.

    tokens                     each completion's token ids (i32), without the stop token that ended it
    left_padded_prompt_tokens  i32[B, max_prompt_length]: each prompt as sampled from (cut to its last tokens),
                               left-padded with the pad id
    logprobs                   each token's log-probability (f32, one per token of `tokens`), when asked
    """

    tokens: list[np.ndarray]
    left_padded_prompt_tokens: np.ndarray
    logprobs: list[np.ndarray] | None


class RolloutEngine:
    """Rollouts and scores from `engine` (an `LLMEngine`) for prompts given as token ids. `pad_id` pads prompt and
    completion arrays; `stop_ids` end a completion (stripped from `Rollouts.tokens`) unless a call names others.
    `lora_request`: every rollout and score runs under this adapter (a trainer's LoRA policy, its weights replaced
    by `LLMEngine.add_lora_adapter` as they change). `sleep_when_idle`: the KV pool exists only during `generate`
    and `score` (released at once and after each call, re-created before the next: `LLMEngine.sleep` / `wake`), so a
    training step between rollouts in the same process has its memory; each call then pays the pool's allocation
    (`LLMEngine.wake`'s seconds)."""

    def __init__(self, engine, *, pad_id: int, stop_ids: Sequence[int], sleep_when_idle: bool = False,
                 lora_request: LoRARequest | None = None):
        if not stop_ids:
            raise ValueError("RolloutEngine: stop_ids is empty (a rollout would only end at max_tokens)")
        self.engine = engine
        self.pad_id = int(pad_id)
        self.stop_ids = tuple(int(i) for i in stop_ids)
        self.sleep_when_idle = bool(sleep_when_idle)
        self.lora_request = lora_request
        if self.sleep_when_idle:
            self.sleep()

    @contextlib.contextmanager
    def _awake(self):
        """The pool for one call: woken first if asleep (a no-op otherwise), released afterwards with
        `sleep_when_idle`."""
        self.wake()
        try:
            yield
        finally:
            if self.sleep_when_idle:
                self.sleep()

    def generate(self, prompts: Sequence[Sequence[int]], *, max_tokens: int, max_prompt_length: int,
                 temperature: float, top_p: float | None = None, top_k: int | None = None, seed: int | None = None,
                 stop_ids: Sequence[int] | None = None, return_logprobs: bool = False) -> Rollouts:
        """Sample one completion of at most `max_tokens` tokens for each prompt (token ids; equal prompts in a
        row share one prefill). `top_p` None means 1, `top_k` None or <= 0 no top-k; `seed` None draws fresh
        randomness, otherwise sample j of the batch is seeded `seed + j`. ValueError for a prompt that is empty
        or a `max_prompt_length` below 1; RuntimeError naming the request when a sample ends otherwise than by a
        stop or its length (an engine error, an abort): no partial batch is returned."""
        if max_prompt_length < 1:
            raise ValueError(f"RolloutEngine.generate: max_prompt_length must be >= 1, got {max_prompt_length}")
        prompts = [list(map(int, p)) for p in prompts]
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"RolloutEngine.generate: prompt {i} is empty")
        cut = [i for i, p in enumerate(prompts) if len(p) > max_prompt_length]
        if cut:
            logger.warning("rollout: %d of %d prompts are longer than max_prompt_length %d: kept their last %d "
                           "tokens (prompt %d had %d)", len(cut), len(prompts), max_prompt_length,
                           max_prompt_length, cut[0], len(prompts[cut[0]]))
            prompts = [p[-max_prompt_length:] for p in prompts]
        stops = self.stop_ids if stop_ids is None else tuple(int(i) for i in stop_ids)
        groups = [(p, len(list(run))) for p, run in groupby(prompts)]
        params, first = [], 0
        for _, n in groups:
            params.append(SamplingParams(
                n=n, max_tokens=max_tokens, temperature=float(temperature),
                top_p=1.0 if top_p is None else float(top_p), top_k=0 if top_k is None or top_k <= 0 else int(top_k),
                seed=None if seed is None else int(seed) + first, stop_token_ids=stops, min_p=0.0,
                repetition_penalty=1.0, logprobs=0 if return_logprobs else None))
            first += n
        with self._awake():
            outs = self.engine.generate([p for p, _ in groups], params, use_tqdm=False,
                                        lora_request=self.lora_request) if groups else []
        tokens, logprobs = [], []
        for out in outs:
            for sample in out.outputs:
                if sample.finish_reason not in ("stop", "length"):  # never train on a sample that failed
                    raise RuntimeError(f"rollout of request {out.request_id} ended with {sample.finish_reason!r}"
                                       f"{'' if out.error is None else ': ' + out.error}")
                ids = list(sample.token_ids)
                keep = len(ids) - (sample.finish_reason == "stop" and bool(ids) and ids[-1] in stops)
                tokens.append(np.asarray(ids[:keep], np.int32))
                if return_logprobs:
                    logprobs.append(np.asarray([lp.logprob for lp in sample.logprobs[:keep]], np.float32))
        padded = np.full((len(prompts), max_prompt_length), self.pad_id, np.int32)
        for row, p in enumerate(prompts):
            padded[row, max_prompt_length - len(p):] = p
        return Rollouts(tokens, padded, logprobs if return_logprobs else None)

    def score(self, prompt_tokens: np.ndarray, completion_tokens: np.ndarray) -> np.ndarray:
        """f32[B, C]: the log-probability of each completion token after its prompt, by the engine's own step
        (`LLMEngine.score`), 0 at padding. `prompt_tokens` i32[B, P] left-padded, `completion_tokens` i32[B, C]
        right-padded, both with the pad id (leading pads of a prompt and trailing pads of a completion are
        padding, the convention of Tunix's masks). ValueError for mismatched shapes or a prompt of padding only."""
        prompt_tokens, completion_tokens = np.asarray(prompt_tokens), np.asarray(completion_tokens)
        if prompt_tokens.ndim != 2 or completion_tokens.ndim != 2 or len(prompt_tokens) != len(completion_tokens):
            raise ValueError(f"RolloutEngine.score: prompt tokens {prompt_tokens.shape} and completion tokens "
                             f"{completion_tokens.shape} must be [B, P] and [B, C]")
        out = np.zeros(completion_tokens.shape, np.float32)
        rows, prompts, completions = [], [], []
        for row, (p, c) in enumerate(zip(prompt_tokens.tolist(), completion_tokens.tolist(), strict=True)):
            start = next((i for i, t in enumerate(p) if t != self.pad_id), len(p))
            end = len(c) - next((i for i, t in enumerate(reversed(c)) if t != self.pad_id), len(c))
            if start == len(p):
                raise ValueError(f"RolloutEngine.score: prompt row {row} is all padding")
            if end:  # an empty completion has nothing to score
                rows.append(row)
                prompts.append(p[start:])
                completions.append(c[:end])
        with self._awake():
            scored = self.engine.score(prompts, completions, self.lora_request) if rows else []
        for row, lps in zip(rows, scored, strict=True):
            out[row, :len(lps)] = lps
        return out

    def update_params(self, params) -> None:
        """Serve `params` (the model's `nnx.State`, or the module) from the next step on, in place."""
        self.engine.update_weights(params)

    def sleep(self) -> int:
        """Release the KV pool's device memory around a training step; returns bytes freed per device. The next
        `generate` or `score` wakes it."""
        return self.engine.sleep()

    def wake(self) -> float:
        """Re-create the KV pool after `sleep` (0.0 s if awake); returns the seconds it took."""
        return self.engine.wake()
