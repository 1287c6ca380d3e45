"""Speculative decoding's configuration (`LLMEngine(speculative_config=...)`): a frozen dataclass of its own, as
`pagedjax.config.quant` and `pagedjax.config.moe` are, re-exported by `pagedjax.config`.

Plain Python, no JAX. How proposals are made and verified: `pagedjax.spec_decode` and `Scheduler.update`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from pagedjax.config.fields import check_choice, check_int, describe, option

SPECULATIVE_METHODS: tuple[str, ...] = ("ngram", "draft", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (`pagedjax.spec_decode.speculator`): each decoding step verifies up to
    `num_speculative_tokens` proposed tokens per request; the output is exactly the non-speculative one.

    method "ngram" (prompt lookup): the proposal is what followed the most recent earlier occurrence of the
    request's last n tokens in its prompt and output, for the longest n in [prompt_lookup_min, prompt_lookup_max]
    that occurs; no occurrence, no proposal (the request decodes as usual), and a request whose last proposal
    failed holds back for a few tokens (`pagedjax.spec_decode.speculator.NgramProposer`).
    method "draft": `draft_model` (a model folder, a `ModelConfig` (random weights) or a model module, with the
    target's vocabulary) proposes its greedy tokens (`pagedjax.spec_decode.draft_model`).
    method "mtp": a multi-token-prediction head over the target's hidden states proposes its greedy guesses
    (`pagedjax.spec_decode.mtp`); `draft_model` is the head (a folder `save_head` wrote, or an `MTPHead`), None
    for the model folder's own `mtp/` (`from_pretrained` and `--model` look there; the bundled model ships one).
    """

    method: str = option("ngram", "speculative decoding (exact: the same output): 'ngram' proposes what followed "
                                  "the last tokens' earlier occurrence in the prompt and output, 'draft' a draft "
                                  "model's greedy tokens (--speculative-draft-model), 'mtp' a multi-token-prediction "
                                  "head's (the model folder's mtp/, or --speculative-draft-model)")
    num_speculative_tokens: int = option(4, "tokens proposed and verified per request per step")
    prompt_lookup_min: int = option(2, "ngram: the shortest suffix looked up")
    prompt_lookup_max: int = option(4, "ngram: the longest suffix looked up, tried first")
    draft_model: object = option(None, "draft: the draft model's folder (as --model reads it), of the model's "
                                       "vocabulary; mtp: the head's folder (default: the model folder's mtp/)")

    def __post_init__(self) -> None:
        check_choice("SpeculativeConfig", "method", self.method, SPECULATIVE_METHODS, optional=False)
        object.__setattr__(self, "num_speculative_tokens",
                           check_int("SpeculativeConfig", "num_speculative_tokens", self.num_speculative_tokens,
                                     lo=1, hi=64))
        object.__setattr__(self, "prompt_lookup_min",
                           check_int("SpeculativeConfig", "prompt_lookup_min", self.prompt_lookup_min, lo=1))
        object.__setattr__(self, "prompt_lookup_max",
                           check_int("SpeculativeConfig", "prompt_lookup_max", self.prompt_lookup_max,
                                     lo=self.prompt_lookup_min))
        if self.method == "draft" and self.draft_model is None:
            raise ValueError("SpeculativeConfig.draft_model is needed by method 'draft'")
        if self.method == "ngram" and self.draft_model is not None:
            raise ValueError(f"SpeculativeConfig.draft_model is for methods 'draft' and 'mtp', got "
                             f"{describe(self.draft_model)} with method 'ngram'")

    def __repr__(self) -> str:
        # A draft given as a model module would print whole (every parameter array): its type stands for it.
        draft = self.draft_model
        if draft is None:
            shown = ""
        elif isinstance(draft, str | os.PathLike) or dataclasses.is_dataclass(draft):  # a folder, a ModelConfig
            shown = f", draft_model={draft!r}"
        else:
            shown = f", draft_model=<{type(draft).__name__} module>"
        return (f"SpeculativeConfig(method={self.method!r}, num_speculative_tokens={self.num_speculative_tokens}, "
                f"prompt_lookup_min={self.prompt_lookup_min}, prompt_lookup_max={self.prompt_lookup_max}{shown})")
