"""A model's classifier (`pagedjax.model.classifier.Classifier`): a Hugging Face sequence classifier's head
(`score.weight`, `score.bias`, `id2label`), or a causal LM's two tokens' LM-head rows (`token_classifier`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pagedjax.model.classifier import HEAD, Classifier, is_classifier
from pagedjax.model.errors import ModelLoadError, read_json
from pagedjax.model.loading.hf_loader import read_stored, safetensors_files, tensor_headers


def load_classifier(path) -> Classifier | None:
    """The head of a Hugging Face sequence-classifier folder (`score.weight`, `score.bias` if any, `id2label`), as
    float32; None for any other folder. ModelLoadError naming the file for a head that is missing or of the wrong
    shape, or labels that do not match it."""
    if path is None or not (Path(path) / "config.json").is_file():
        return None
    config = Path(path) / "config.json"
    hf = read_json(config)
    if not is_classifier(hf):
        return None
    where = {name: (file, shape) for file, name, shape, _ in tensor_headers(safetensors_files(path))}
    if f"{HEAD}.weight" not in where:
        raise ModelLoadError(config, f"{hf['architectures'][0]}: no {HEAD}.weight tensor (the classifier's head)")
    file, shape = where[f"{HEAD}.weight"]
    if len(shape) != 2 or shape[1] != hf.get("hidden_size"):
        raise ModelLoadError(file, f"{HEAD}.weight has shape {list(shape)}, not [num_labels, hidden_size "
                                   f"{hf.get('hidden_size')}]")
    weight = read_stored(file, f"{HEAD}.weight").astype(np.float32)
    bias = None
    if f"{HEAD}.bias" in where:
        bias = read_stored(where[f"{HEAD}.bias"][0], f"{HEAD}.bias").astype(np.float32)
    id2label = hf.get("id2label") or {str(i): f"LABEL_{i}" for i in range(shape[0])}
    try:
        labels = tuple(str(id2label[str(i)]) for i in range(shape[0]))
    except (KeyError, TypeError):
        raise ModelLoadError(config, f"id2label {json.dumps(id2label)[:200]} does not name labels 0..{shape[0] - 1} "
                                     f"of the {shape[0]}-row head") from None
    try:
        return Classifier(weight, bias, labels)
    except ValueError as e:
        raise ModelLoadError(file, str(e)) from None


def token_classifier(model_config, params, tokenizer, tokens) -> Classifier:
    """The one-label classifier of a built-in causal LM judged by two tokens (`Classifier.from_token_rows`): their
    rows of its float LM head (the tied embedding, or `lm_head`). ValueError naming what is missing: a tokenizer
    that knows both tokens (each one token), a float head, a head without a logit soft-cap."""
    if not (isinstance(tokens, tuple | list) and len(tokens) == 2 and all(isinstance(t, str) for t in tokens)):
        raise ValueError(f"classifier_from_tokens: two token strings (negative, positive), got {tokens!r}")
    if model_config is None or params is None:
        raise ValueError("classifier_from_tokens needs a built-in model (a Hugging Face folder of a Llama-family "
                         "model_type)")
    if model_config.final_logit_softcapping is not None:
        raise ValueError("classifier_from_tokens: this model soft-caps its logits; two tokens' probability is then "
                         "no linear head")
    lookup = getattr(tokenizer, "token_to_id", None)
    ids = [lookup(t) if lookup is not None else None for t in tokens]
    if None in ids:
        raise ValueError(f"classifier_from_tokens: the tokenizer has no single token {tokens[ids.index(None)]!r}")
    if model_config.tie_word_embeddings:
        table = params["embed_tokens"]["embedding"]
        rows = np.stack([np.asarray(table[i], np.float64) for i in ids])
    else:
        head = params["lm_head"]
        if "kernel" not in head:
            raise ValueError("classifier_from_tokens: the LM head is quantized; load the model in float")
        rows = np.stack([np.asarray(head["kernel"][:, i], np.float64) for i in ids])
    return Classifier.from_token_rows(rows, tuple(tokens))


def engine_classifier(path, model_config, params, tokenizer, tokens=None) -> Classifier | None:
    """An engine's classifier: the folder `path`'s sequence-classifier head (`load_classifier`), or with `tokens`
    (negative, positive) the model's LM-head rows of them (`token_classifier`); None for neither. ValueError for
    both, and as those refuse."""
    head = load_classifier(path)
    if tokens is None:
        return head
    if head is not None:
        raise ValueError("classifier_from_tokens for a folder that has a classifier's head already")
    return token_classifier(model_config, params, tokenizer, tuple(tokens))
