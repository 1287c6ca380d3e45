"""`Engine`: what every engine-shaped class offers (`LLMEngine`, `DataParallelEngine`), and what the front ends
(`generate_batch`, the CLI, `pagedjax-serve`) rely on and nothing more."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pagedjax.core.request import Request
from pagedjax.outputs import RequestOutput
from pagedjax.pooling_params import PoolingParams
from pagedjax.sampling_params import LoRARequest, SamplingParams, StructuredOutput

if TYPE_CHECKING:
    from pagedjax.engine.image_prompts import EncodedPrompt
    from pagedjax.engine.stats import EngineStats
    from pagedjax.outputs import (
        BeamSearchOutput,
        ClassificationRequestOutput,
        EmbeddingRequestOutput,
        ScoringRequestOutput,
    )
    from pagedjax.runner.programs import CompileEvent
    from pagedjax.sampling_params import BeamSearchParams
    from pagedjax.structured_output.compiler import Constraint


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request not queued yet (`make_request`), with its compiled structured-output matcher, if any:
    what `add_prepared_request` queues, on whichever replica a front picks."""

    request: Request
    constraint: Constraint | None = None


@runtime_checkable
class Engine(Protocol):
    tokenizer: Any  # anything with encode / decode, or None (token ids only)
    model_config: Any
    max_request_tokens: int  # the most tokens (prompt + output) one request can hold
    classifier: Any  # a sequence classifier's head (`pagedjax.model.classifier.Classifier`), or None

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    sampling_params: SamplingParams | None = None, *, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None, pooling: PoolingParams | None = None) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def abort(self, request_id: str) -> bool: ...

    def has_unfinished_requests(self) -> bool: ...

    def generate(self, prompts: Sequence, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = ..., lora_request=None) -> list[RequestOutput]: ...

    def embed(self, prompts: Sequence, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = ..., lora_request=None) -> list[EmbeddingRequestOutput]: ...

    def classify(self, prompts: Sequence, use_tqdm: bool = ..., lora_request=None
                 ) -> list[ClassificationRequestOutput]: ...

    def relevance(self, text_1, text_2, use_tqdm: bool = ..., lora_request=None) -> list[ScoringRequestOutput]: ...

    def beam_search(self, prompts: Sequence, params: BeamSearchParams) -> list[BeamSearchOutput]: ...

    def stats(self) -> EngineStats: ...

    def stats_dict(self) -> dict: ...

    def warmup(self) -> float: ...  # compile the programs that stand in for every step; its seconds

    def start_warmup(self) -> Future: ...  # the same in the background; a future of its seconds

    def compile_notices(self, listener: Callable[[CompileEvent], None]) -> AbstractContextManager: ...  # see
    #                                                     LLMEngine.compile_notices: what a front end's progress hears

    def save_kv_tiers(self) -> int: ...  # the device's cached blocks to the disk tier (before exiting)

    def close(self) -> None: ...  # ends its background threads (waiting compiles): call when done with it

    # What `generate_batch` builds a batch with: validate everything first, then queue.
    # What the server's prepare stage encodes a prompt with images by, off the engine thread.
    def encode_prompt(self, request_id: str, prompt) -> EncodedPrompt: ...

    def make_request(self, request_id: str, prompt, sampling_params: SamplingParams | None = None, *,
                     cache_salt: str | None = None, lora_request: LoRARequest | None = None,
                     pooling: PoolingParams | None = None) -> PreparedRequest: ...

    def add_prepared_request(self, prepared: PreparedRequest) -> None: ...

    # What the server's prepare stage compiles a request's constraint with, off the engine thread.
    def compile_constraint(self, structured: StructuredOutput) -> Constraint: ...

    def fresh_request_ids(self, prefix: str, n: int) -> list[str]: ...
