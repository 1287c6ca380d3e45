"""A Hugging Face sequence classifier's head (`score.weight`, `score.bias`, `id2label`) as a `Classifier`
(`pagedjax.model.classifier`)."""

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
