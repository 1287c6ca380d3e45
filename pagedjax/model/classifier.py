"""A sequence classifier's head (`*ForSequenceClassification`: transformers' `score` linear over the last token's
final hidden state), applied on the host to a pooling request's vector: `Classifier` (a Hugging Face folder's:
`pagedjax.model.loading.hf_classifier`). Plain numpy.

Such a folder has no LM head: its transformer loads as the family's model with the embedding matrix standing in for
the head (`hf_config`: its logits feed nothing), and an engine holding a classifier serves pooling requests only
(`LLMEngine.classify`, `embed`, `relevance`): it refuses generation. A causal LM judged by two tokens' logits (a
Qwen3-Reranker: "no" / "yes" after its prompt) is such a classifier too, of one label (`from_token_rows`:
`from_pretrained(..., classifier_from_tokens=("no", "yes"))`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedjax.pooling_params import PoolingParams

HEAD = "score"  # transformers' name of the head's linear layer
HEAD_POOLING = PoolingParams("last", normalize=False)  # what the head reads: the last token's final hidden state


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

    @classmethod
    def from_token_rows(cls, rows: np.ndarray, tokens: tuple[str, str]) -> Classifier:
        """A causal LM read as a two-token judge (a Qwen3-Reranker's "no" / "yes"): `rows` float [2, hidden], its LM
        head's rows of the two tokens, negative first. The probability of the second, softmax over the two logits,
        is the sigmoid of their difference: a one-label head of `rows[1] - rows[0]`, named after the second token."""
        rows = np.asarray(rows, np.float64)
        if rows.shape[0] != 2:
            raise ValueError(f"Classifier.from_token_rows: two rows (negative, positive), got {rows.shape}")
        return cls((rows[1] - rows[0])[None].astype(np.float32), None, (tokens[1],))

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
