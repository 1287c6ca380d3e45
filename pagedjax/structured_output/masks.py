"""A step's allowed-token masks as arrays: bit t of word t // 32 of a row set = token t allowed.

Per step, each constrained request that samples a token gets a row of the bitmask (unconstrained rows are all
ones), and the sampler sets the logits of disallowed tokens to -inf before anything else (penalties, temperature,
top-k / top-p / min-p, log-probabilities), as vLLM does. The rows are filled in one call of llguidance's executor
(its threads, without the GIL).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

MASK_BITS = 32  # tokens per int32 word of a mask row


def mask_words(vocab_size: int) -> int:
    """int32 words per mask row."""
    return -(-vocab_size // MASK_BITS)


def token_masks(matchers: Sequence, vocab_size: int) -> np.ndarray | None:
    """The step's allowed-token bitmask int32 `[S, mask_words]` of one llguidance matcher per row (None: the row
    is unconstrained, or samples nothing: all ones), or None when no row has a matcher (the step then has no mask
    at all). The matchers are distinct (a fork copies its own)."""
    from llguidance.numpy import fill_next_token_bitmask_par

    rows = [(m, i) for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return None
    masks = np.full((len(matchers), mask_words(vocab_size)), -1, np.int32)
    fill_next_token_bitmask_par(_executor(), rows, masks)
    return masks


@functools.cache
def _executor():
    """The process's llguidance executor (threads: 80 % of the CPUs, up to 32), made on first use."""
    import llguidance

    return llguidance.LLExecutor()
