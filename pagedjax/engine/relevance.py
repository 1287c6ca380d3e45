"""Relevance scores of (query, document) pairs: vLLM's `LLM.score`, named `relevance` here (`LLMEngine.score` gives
log-probabilities). A model scores a pair one of two ways:
  - a cross-encoder (a sequence classifier with one label: `pagedjax.model.classifier`) reads the pair as one
    prompt, two texts joined by the tokenizer's pair template (`encode_pair`: `[CLS] q [SEP] d [SEP]` for BERT's),
    two token-id lists one after the other; the score is the sigmoid of its logit;
  - any other model embeds each text (its pooling: `EngineConfig.pooling_defaults`); the score is the cosine
    similarity of the two vectors.
Host-side functions over an engine-shaped object (`LLMEngine`, `DataParallelEngine`); the server's `/v1/score`
and `/v1/rerank` use the same ones (`pagedjax.serve.pooling`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pagedjax.config.fields import is_int
from pagedjax.engine.generate import embed_batch
from pagedjax.errors import InvalidRequest, UnsupportedFeature
from pagedjax.model.classifier import HEAD_POOLING, Classifier
from pagedjax.outputs import ScoringOutput, ScoringRequestOutput


def _one(x) -> bool:
    return isinstance(x, str | bytes) or (isinstance(x, Sequence) and len(x) > 0 and all(is_int(t) for t in x))


def pairs(text_1, text_2) -> list[tuple]:
    """(query, document) pairs as vLLM makes them: one `text_1` with each `text_2` (1 -> N), or `text_1[i]` with
    `text_2[i]` (N -> N). A text is a str or a list of token ids. InvalidRequest for no pair or unequal lists."""
    queries = [text_1] if _one(text_1) else list(text_1)
    documents = [text_2] if _one(text_2) else list(text_2)
    if not queries or not documents:
        raise InvalidRequest("no pair to score (text_1 and text_2 must not be empty)", param="text_2")
    if len(queries) == 1:
        queries = queries * len(documents)
    if len(queries) != len(documents):
        raise InvalidRequest(f"{len(queries)} queries for {len(documents)} documents (give one query, "
                             "or one per document)", param="text_1")
    return list(zip(queries, documents, strict=True))


def cross_encoder(engine) -> Classifier | None:
    """The engine's classifier when it is a cross-encoder (one label); None for an embedding model;
    UnsupportedFeature for a classifier of several labels (its probabilities are no relevance score)."""
    head = engine.classifier
    if head is not None and len(head.labels) != 1:
        raise UnsupportedFeature(f"this model classifies into {len(head.labels)} labels; a cross-encoder "
                                 "(one label) or an embedding model scores pairs", param="model",
                                 code="score_not_supported")
    return head


def pair_prompt(tokenizer, query, document) -> list[int]:
    """A cross-encoder's prompt of one pair: two texts through the tokenizer's pair template, two token-id lists
    one after the other. UnsupportedFeature for texts and a tokenizer without a pair template; InvalidRequest for
    a text with token ids."""
    if isinstance(query, str) and isinstance(document, str):
        encode = getattr(tokenizer, "encode_pair", None)
        if encode is None:
            raise UnsupportedFeature("this model's tokenizer has no pair template (a Hugging Face "
                                     "tokenizer.json has one): give token ids", param="text_1",
                                     code="tokenizer_required")
        return encode(query, document)
    if isinstance(query, str | bytes) or isinstance(document, str | bytes):
        raise InvalidRequest("a pair is two texts or two token-id lists, not one of each", param="text_2")
    return [int(t) for t in query] + [int(t) for t in document]


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-12))


def relevance_batch(engine, text_1, text_2, use_tqdm: bool, lora_request=None) -> list[ScoringRequestOutput]:
    """`relevance` over any engine-shaped object: one `ScoringRequestOutput` per pair, in order (see the module
    docstring). Each distinct text of an embedding model's pairs is embedded once."""
    scored = pairs(text_1, text_2)
    head = cross_encoder(engine)
    if head is not None:
        prompts = [pair_prompt(engine.tokenizer, q, d) for q, d in scored]
        outs = embed_batch(engine, prompts, HEAD_POOLING, use_tqdm, lora_request)
        return [ScoringRequestOutput(o.request_id, ScoringOutput(float(head.probs(np.asarray(o.outputs.embedding))[0])),
                                     o.prompt_token_ids, o.num_cached_tokens) for o in outs]
    key = lambda text: text if isinstance(text, str | bytes) else tuple(text)
    texts = list({key(t): t for pair in scored for t in pair}.values())
    outs = dict(zip(map(key, texts), embed_batch(engine, texts, None, use_tqdm, lora_request), strict=True))
    results = []
    for q, d in scored:
        a, b = outs[key(q)], outs[key(d)]
        results.append(ScoringRequestOutput(b.request_id, ScoringOutput(cosine(a.outputs.embedding,
                                                                               b.outputs.embedding)),
                                            a.prompt_token_ids + b.prompt_token_ids, b.num_cached_tokens))
    return results
