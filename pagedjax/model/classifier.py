"""A sequence classifier's head (`*ForSequenceClassification`: transformers' `score` linear over the last token's
final hidden state), applied on the host to a pooling request's vector: `Classifier`, and `load_classifier` of a
Hugging Face folder. Plain numpy.

Such a folder has no LM head: its transformer loads as the family's model with the embedding matrix standing in for
the head (`hf_config`: its logits feed nothing), and an engine holding a classifier serves pooling requests only
(`LLMEngine.classify`, `embed`): it refuses generation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagedjax.model.errors import ModelLoadError, read_json

HEAD = "score"  # transformers' name of the head's linear layer


def is_classifier(hf: dict) -> bool:
    """Whether a config.json's `architectures` name a sequence classifier (`Qwen3ForSequenceClassification`, ...)."""
    archs = hf.get("architectures")
    return isinstance(archs, list) and len(archs) == 1 and isinstance(archs[0], str) and \
        archs[0].endswith("ForSequenceClassification")


@dataclass(frozen=True)
class Classifier:
    """`weight` float32 [num_labels, hidden], `bias` float32 [num_labels] or None, `labels` each label's name."""

    weight: np.ndarray
    bias: np.ndarray | None
    labels: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.weight.ndim != 2 or len(self.labels) != self.weight.shape[0]:
            raise ValueError(f"Classifier: weight {self.weight.shape} for {len(self.labels)} labels")
        if self.bias is not None and self.bias.shape != (self.weight.shape[0],):
            raise ValueError(f"Classifier: bias {self.bias.shape} for weight {self.weight.shape}")

    @property
    def hidden_size(self) -> int:
        return self.weight.shape[1]

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """float64 [num_labels] of one final hidden state [hidden]."""
        out = self.weight.astype(np.float64) @ np.asarray(hidden, np.float64)
        return out if self.bias is None else out + self.bias

    def probs(self, hidden: np.ndarray) -> np.ndarray:
        """The labels' probabilities: softmax over the logits, or for one label (a cross-encoder's relevance) its
        sigmoid, as vLLM's classify gives them."""
        z = self.logits(hidden)
        if len(z) == 1:
            return 1.0 / (1.0 + np.exp(-z))
        e = np.exp(z - z.max())
        return e / e.sum()


def load_classifier(path) -> Classifier | None:
    """The head of a Hugging Face sequence-classifier folder (`score.weight`, `score.bias` if any, `id2label`), as
    float32; None for any other folder. ModelLoadError naming the file for a head that is missing or of the wrong
    shape, or labels that do not match it."""
    from pagedjax.model.loading.hf_loader import read_stored, safetensors_files, tensor_headers

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
