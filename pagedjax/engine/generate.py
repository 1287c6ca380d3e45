"""`generate`, `embed` and `classify`: a whole batch through any engine-shaped object (`LLMEngine`,
`DataParallelEngine`)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np

from pagedjax.compile_cache import cache_note
from pagedjax.config.fields import is_int
from pagedjax.errors import UnsupportedFeature
from pagedjax.model.classifier import HEAD_POOLING
from pagedjax.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
)
from pagedjax.pooling_params import PoolingParams
from pagedjax.runner.programs import CompileEvent
from pagedjax.sampling_params import LoRARequest, SamplingParams

_PROMPT_SHAPES = ("a str, bytes, a list of token ids, a dict {'prompt': ...} or {'prompt_token_ids': ...} (with "
                  "'multi_modal_data' for images)")


def batch_of_prompts(prompts) -> list:
    """The requests `generate(prompts)` means, as vLLM's `LLM.generate` reads them: a str, bytes, a token-id
    list or a prompt dict is ONE request; a list of those is a batch. A sequence whose every item is an int is
    one token-id prompt (an empty list is an empty batch). Each request comes back as a str, bytes or a token-id
    sequence (a dict unwrapped), for `make_request` to validate. TypeError naming what was given otherwise: a
    plain `list(prompts)` used to split "def f" into five one-character requests, silently."""
    if isinstance(prompts, (str, bytes, dict)):
        return [_one_prompt(prompts, "prompts")]
    if not isinstance(prompts, (Sequence, np.ndarray)):
        raise TypeError(f"prompts must be {_PROMPT_SHAPES}, or a list of them; got {type(prompts).__name__}")
    items = list(prompts)
    ints = [is_int(p) for p in items]
    if items and all(ints):
        return [items]
    if any(ints):
        raise TypeError(f"prompts mixes ints with {type(items[ints.index(False)]).__name__}: a list of ints is "
                        "one token-id prompt, a batch is a list of prompts")
    return [_one_prompt(p, f"prompts[{i}]") for i, p in enumerate(items)]


def _one_prompt(prompt, where: str):
    """One request's prompt as `make_request` takes it (a dict unwrapped); TypeError naming `where` otherwise."""
    if isinstance(prompt, dict):
        keys = sorted(map(str, prompt))
        if keys == ["prompt"] and isinstance(prompt["prompt"], (str, bytes)):
            return prompt["prompt"]
        if keys == ["prompt_token_ids"] and not isinstance(prompt["prompt_token_ids"], (str, bytes, dict)):
            return prompt["prompt_token_ids"]
        if "multi_modal_data" in keys:  # a prompt with images: the engine reads it whole (`engine.image_prompts`)
            return prompt
        raise TypeError(f"{where} must be {{'prompt': str}} or {{'prompt_token_ids': [int, ...]}} (with "
                        f"'multi_modal_data' for images), got a dict "
                        f"with keys {keys} and values of type "
                        f"{sorted({type(v).__name__ for v in prompt.values()})}")
    if isinstance(prompt, (str, bytes, Sequence, np.ndarray)):
        return prompt
    raise TypeError(f"{where} must be {_PROMPT_SHAPES}; got {type(prompt).__name__}")


def batch_of_params(sampling_params, n: int) -> list[SamplingParams]:
    """One `SamplingParams` per request: None (the defaults) or one shared by all, or a list of exactly `n`.
    TypeError naming the type given otherwise (a dict used to be read as a list of its keys, "got str")."""
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params or SamplingParams()] * n
    if not isinstance(sampling_params, (list, tuple)):
        raise TypeError(f"sampling_params must be SamplingParams or a list of them, got "
                        f"{type(sampling_params).__name__}")
    params = list(sampling_params)
    if len(params) != n:
        raise ValueError(f"{len(params)} sampling params for {n} prompts")
    return params


def batch_of_loras(lora_request, n: int) -> list[LoRARequest | None]:
    """One adapter (or None: the base model) per request: None or one `LoRARequest` for all, or a list of exactly
    `n` of them and None. TypeError naming the type given otherwise."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    if not isinstance(lora_request, (list, tuple)):
        raise TypeError(f"lora_request must be a LoRARequest or a list of them, got {type(lora_request).__name__}")
    loras = list(lora_request)
    if len(loras) != n:
        raise ValueError(f"{len(loras)} lora requests for {n} prompts")
    bad = [type(x).__name__ for x in loras if x is not None and not isinstance(x, LoRARequest)]
    if bad:
        raise TypeError(f"lora_request must hold LoRARequests or None, got {bad[0]}")
    return loras


def batch_of_pooling(pooling_params, n: int) -> list[PoolingParams]:
    """One `PoolingParams` per request, as `batch_of_params` reads sampling params."""
    if pooling_params is None or isinstance(pooling_params, PoolingParams):
        return [pooling_params or PoolingParams()] * n
    if not isinstance(pooling_params, (list, tuple)):
        raise TypeError(f"pooling_params must be PoolingParams or a list of them, got {type(pooling_params).__name__}")
    params = list(pooling_params)
    if len(params) != n:
        raise ValueError(f"{len(params)} pooling params for {n} prompts")
    return params


def embed_batch(engine, prompts, pooling_params, use_tqdm: bool, lora_request=None) -> list[EmbeddingRequestOutput]:
    """`embed` over any engine-shaped object: `generate_batch` of pooling requests, each output as vLLM's
    `EmbeddingRequestOutput`. A request that failed (its step raised alone) raises RuntimeError naming it."""
    outs = generate_batch(engine, prompts, None, use_tqdm, lora_request, pooling=True,
                          pooling_params=pooling_params)
    bad = [o for o in outs if o.embedding is None]
    if bad:
        raise RuntimeError(f"embed: request {bad[0].request_id!r} ended with {bad[0].finish_reason!r}"
                           f"{': ' + bad[0].error if bad[0].error else ''}")
    return [EmbeddingRequestOutput(o.request_id, EmbeddingOutput(o.embedding), o.prompt_token_ids,
                                   o.num_cached_tokens) for o in outs]


def classify_batch(engine, prompts, use_tqdm: bool, lora_request=None) -> list[ClassificationRequestOutput]:
    """`classify` over any engine-shaped object with a `classifier`: `embed_batch` of the last token's hidden state
    (unnormalised), through the classifier's head."""
    head = engine.classifier
    if head is None:
        raise UnsupportedFeature("classify needs a sequence classifier (a *ForSequenceClassification folder); this "
                                 "model has no classification head", param="model", code="classify_not_supported")
    outs = embed_batch(engine, prompts, HEAD_POOLING, use_tqdm, lora_request)
    return [ClassificationRequestOutput(o.request_id, ClassificationOutput(head.probs(np.asarray(o.outputs.embedding))
                                                                           .tolist(), head.labels),
                                        o.prompt_token_ids, o.num_cached_tokens) for o in outs]


def generate_batch(engine, prompts, sampling_params, use_tqdm: bool, lora_request=None, *, pooling: bool = False,
                   pooling_params=None) -> list[RequestOutput]:
    """`generate` over any engine-shaped object (`LLMEngine`, `DataParallelEngine`): validate the whole batch,
    queue it under fresh ids, step until every request finished, outputs in input order. An interrupted call
    aborts what it queued, so nothing keeps running behind the caller's back. `lora_request` (see
    `batch_of_loras`) needs an engine whose `make_request` takes one; with `pooling`, pooling requests
    (`embed_batch`) of `pooling_params` (as `batch_of_pooling` reads them) instead of sampling ones."""
    prompts = batch_of_prompts(prompts)
    loras = batch_of_loras(lora_request, len(prompts))
    ids = engine.fresh_request_ids("embed" if pooling else "gen", len(prompts))
    if pooling:
        prepared = [engine.make_request(rid, prompt, lora_request=lora, pooling=p) for rid, prompt, p, lora
                    in zip(ids, prompts, batch_of_pooling(pooling_params, len(prompts)), loras, strict=True)]
    else:
        prepared = [engine.make_request(rid, prompt, p, lora_request=lora) for rid, prompt, p, lora
                    in zip(ids, prompts, batch_of_params(sampling_params, len(prompts)), loras, strict=True)]
    for p in prepared:
        engine.add_prepared_request(p)
    results: dict[str, RequestOutput] = {}
    bar, notices = None, contextlib.nullcontext()
    if use_tqdm:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(ids), desc="embed" if pooling else "generate", unit="req")
        notices = engine.compile_notices(_CompileNote(bar))
    pending = set(ids)
    try:
        with notices:
            while pending:
                if not engine.has_unfinished_requests():
                    raise RuntimeError(f"requests {sorted(pending)[:5]} vanished without finishing")
                for out in engine.step():
                    if out.finished and out.request_id in pending:
                        results[out.request_id] = out
                        pending.discard(out.request_id)
                        if bar is not None:
                            bar.update(1)
    except BaseException:
        for rid in pending:
            engine.abort(rid)
        raise
    finally:
        if bar is not None:
            bar.close()
    return [results[i] for i in ids]


class _CompileNote:
    """`generate`'s bar says which program a step waits for while it compiles ("compiling step program 2 (first
    run; cached afterwards)"): the first run's compiles take seconds (minutes for a large model) in which the bar
    would stand still at 0% with no word of why."""

    def __init__(self, bar):
        self.bar = bar
        self.count = 0

    def __call__(self, event: CompileEvent) -> None:
        if event.seconds is None:
            self.count += 1
            self.bar.set_postfix_str(f"compiling step program {self.count} ({cache_note()})")
        else:
            self.bar.set_postfix_str("")
