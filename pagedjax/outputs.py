"""What a caller gets back: `RequestOutput` (one per request and step), `CompletionOutput` (one per sample),
`TokenLogprobs`, embeddings' `EmbeddingRequestOutput` / `EmbeddingOutput`, classification's
`ClassificationRequestOutput` / `ClassificationOutput`, relevance's `ScoringRequestOutput` / `ScoringOutput`, and
beam search's `BeamSearchOutput` /
`BeamSequence`. Plain data, no JAX.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

R = TypeVar("R")  # a pooling request's result: `EmbeddingOutput`, `ClassificationOutput`, `ScoringOutput`


@dataclass(frozen=True)
class TokenLogprobs:
    """One position's log-probabilities: the token there and the `top` most likely tokens, best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class CompletionOutput:
    """One sample of a request."""

    index: int  # the sample's index (its seed is the request's seed + index)
    token_ids: list[int]
    text: str | None
    cumulative_logprob: float | None  # None unless log-probabilities were computed (logprobs set, or best_of > n)
    logprobs: list[TokenLogprobs] | None  # per token, when SamplingParams.logprobs is set
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


@dataclass
class RequestOutput:
    """What a caller sees of a request after a step (or at the end of `generate`).

    `outputs` holds one `CompletionOutput` per sample (the n best when best_of > n, best first; otherwise in
    index order). The single-sample fields (`output_token_ids`, `text`, `finish_reason`) describe `outputs[0]`;
    `finish_reason` is None until every sample finished.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_cached_tokens: int
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    text: str | None = None
    error: str | None = None  # with finish_reason "error": what failed
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_generated_tokens: int = 0  # by every sample, those best_of drops included (what the request cost)
    embedding: list[float] | None = None  # a pooling request's, once finished ("stop"): `PoolingParams`

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EmbeddingOutput:
    """A pooling request's vector (`pagedjax.pooling_params`)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class PoolingRequestOutput(Generic[R]):
    """What a pooling entry point returns per prompt (vLLM's shape): its result (`outputs`), its prompt, and how
    many of the prompt's tokens came from the prefix cache."""

    request_id: str
    outputs: R
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True


class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    """`LLMEngine.embed`'s, per prompt."""


@dataclass
class ClassificationOutput:
    """A classifier's label probabilities for one prompt (`pagedjax.model.classifier.Classifier.probs`)."""

    probs: list[float]
    labels: tuple[str, ...] = ()  # each probability's label name

    @property
    def num_classes(self) -> int:
        return len(self.probs)

    @property
    def label(self) -> str:
        """The most probable label's name."""
        return self.labels[max(range(len(self.probs)), key=self.probs.__getitem__)]


class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    """`LLMEngine.classify`'s, per prompt."""


@dataclass
class ScoringOutput:
    """A (query, document) pair's relevance (`pagedjax.engine.relevance`)."""

    score: float


class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    """`LLMEngine.relevance`'s, per pair: `prompt_token_ids` the pair's tokens (a cross-encoder's one prompt; an
    embedding model's query then document)."""


@dataclass
class BeamSequence:
    """One finished beam: its generated tokens, their summed log-probability, and its score."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float
    text: str | None = None


@dataclass
class BeamSearchOutput:
    """The best `beam_width` beams of one prompt, best first."""

    prompt_token_ids: list[int]
    sequences: list[BeamSequence] = field(default_factory=list)
