"""Scoring given token sequences with an engine's own numerics: what an RL loop compares with its trainer's
log-probabilities (`LLMEngine.score`)."""

from __future__ import annotations

import numpy as np

from pagedjax.sampling_params import RAW_SAMPLING, SamplingParams


def completion_logprobs(engine, prompts, completions, lora_request=None) -> list[np.ndarray]:
    """For each (prompt, completion) pair of token id lists, the log-probability (float32 `[len(completion)]`)
    of each completion token after the prompt and the completion tokens before it, from the engine's own
    compiled step over prompt + completion (`SamplingParams.prompt_logprobs`: every position recomputed, no
    prefix-cache hits; one throwaway token is sampled). Log-softmax of the raw logits, as rollouts' `logprobs`.
    `lora_request`: as `generate`'s (the pairs scored under those adapters)."""
    prompts, completions = list(prompts), list(completions)
    if len(prompts) != len(completions):
        raise ValueError(f"score: {len(prompts)} prompts for {len(completions)} completions")
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        if len(p) == 0 or len(c) == 0:
            raise ValueError(f"score: pair {i} has an empty {'prompt' if len(p) == 0 else 'completion'}")
    outs = engine.generate([list(p) + list(c) for p, c in zip(prompts, completions, strict=True)],
                           SamplingParams(max_tokens=1, prompt_logprobs=0, **RAW_SAMPLING), use_tqdm=False,
                           lora_request=lora_request)
    return [np.array([lp.logprob for lp in out.prompt_logprobs[len(p):]], np.float32)
            for out, p in zip(outs, prompts, strict=True)]
