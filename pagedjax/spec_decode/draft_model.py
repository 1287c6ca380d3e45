"""Speculative decoding's draft model (`SpeculativeConfig(method="draft", draft_model=...)`): a second, smaller
model the engine loads like its own, whose greedy tokens are the proposals the target verifies.

    load_draft(config, target_spec, ...)  ->  the draft module (vocabulary checked), or None for another method
    DraftProposer(model, num_blocks, ...) ->  a `Proposer` running it over its own KV arrays in the target's blocks

Exactness: the draft proposes greedily (argmax), so its proposal distribution q is one-hot at the proposed token
x, and `Scheduler.update`'s acceptance (`pagedjax.core.step_result`: accept x when the target's own draw at that
position is x, otherwise emit that draw) is exactly rejection sampling: accept with min(1, p(x) / q(x)) = p(x), and on a
rejection the emitted token follows p without x, renormalised (the residual max(0, p - q)). So greedy and seeded
outputs stay token-identical to non-speculative decoding for ANY draft, and nothing about the draft (its weights,
its KV cache, a failed draft call) can change a token: only how many proposals are accepted. (A draft sampling
with a true q would need the residual resampled on the device: not done.)

The draft's KV: arrays of its layer / head shape with the target's `num_blocks` x `block_size`, addressed by the
target's block ids (`pagedjax.spec_decode.draft_kv` has the bookkeeping: what the draft computes when, and when its KV
stops being valid). The KV pool is sized with the draft's bytes per block included (`CacheConfig.
resolve_num_blocks`). Each draft call runs every speculating request of the step through the runner's jitted
ragged / decode programs (`pagedjax.runner.runner`), padded like the target's steps (`pagedjax.runner.inputs`).
"""

from __future__ import annotations

import logging

import numpy as np

from pagedjax.config import CacheConfig, ModelConfig, ModelSpec, SpeculativeConfig
from pagedjax.core.step_plan import StepPlan
from pagedjax.device.sampling import SamplingMetadata
from pagedjax.model.api import check_model
from pagedjax.model.layers.quant import check_tensor_parallel
from pagedjax.model.loading.loader import engine_model, load_for
from pagedjax.runner import weights
from pagedjax.runner.inputs import bucket, pad_step
from pagedjax.runner.runner import ModelRunner
from pagedjax.runner.shapes import StepShape
from pagedjax.spec_decode.draft_kv import DraftKV, draft_proposals
from pagedjax.spec_decode.proposer import ProposalAsk, StepSeen, check_speculative_config

logger = logging.getLogger(__name__)


def load_draft(config: SpeculativeConfig | None, target: ModelSpec, cache_config: CacheConfig, seed: int,
               parallel_config) -> object | None:
    """The draft model of `config` (None unless its method is "draft"): a folder loaded as `LLMEngine.
    from_pretrained` loads one, a `ModelConfig` with random weights from `seed`, or a model module of the public
    contract (`pagedjax.model.api`), checked. ValueError for a draft whose vocabulary differs from the target's, a
    sliding-window target (its released blocks would be the draft's to write), or whose heads do not split over the
    target's `tensor_parallel_size` (the draft runs on the target's devices, split as it is)."""
    if config is None:
        return None
    check_speculative_config(config)
    if config.method != "draft":
        return None
    draft = config.draft_model
    if isinstance(draft, str):
        try:
            cfg, state, _ = load_for(draft, None, None, None)
        except FileNotFoundError as e:  # say which model is missing: the target loaded
            raise FileNotFoundError(f"SpeculativeConfig.draft_model: {e}") from None
        model = engine_model(cfg, state, None, seed)
    elif isinstance(draft, ModelConfig):
        model = engine_model(draft, None, None, seed)
    else:
        model = draft
    try:
        spec = check_model(model, kv_dtype=cache_config.kv_dtype)
    except (TypeError, ValueError) as e:
        raise type(e)(f"SpeculativeConfig.draft_model: {e}") from None
    if spec.vocab_size != target.vocab_size:
        raise ValueError(f"SpeculativeConfig.draft_model has vocab_size {spec.vocab_size}, the target model "
                         f"{target.vocab_size}: a draft must share the target's vocabulary")
    if target.kv_window is not None:
        raise ValueError("SpeculativeConfig(method='draft'): the target model has a sliding window "
                         f"({target.kv_window}), whose released blocks the draft's catch-up would need")
    if parallel_config is not None:
        try:
            parallel_config.check_model(spec)
            check_tensor_parallel(model, parallel_config.tensor_parallel_size)
        except ValueError as e:
            raise ValueError(f"SpeculativeConfig.draft_model (on the target's devices): {e}") from None
    return model


class DraftProposer:
    """The draft model's `Proposer`: `cap` greedy tokens per ask, all the step's asks batched in each draft call
    (`pagedjax.spec_decode.draft_kv.draft_proposals`). A draft call that raises costs the step its proposals only
    (logged, counted in `num_failed_calls`; the draft's KV is then considered lost: `epoch`)."""

    def __init__(self, model, num_blocks: int, cache_config: CacheConfig, max_tokens: int, *, backend: str,
                 max_programs: int, compile_in_background: bool, mesh=None):
        # On the target's mesh (None: one device), split as the target is: its KV heads share the target's blocks.
        self.runner = ModelRunner(model, num_blocks, cache_config.block_size,
                                  kv_dtype=cache_config.kv_array_dtype(model.spec), backend=backend, mesh=mesh,
                                  max_programs=max_programs, compile_in_background=compile_in_background)
        self.block_size = cache_config.block_size
        self.max_tokens = max_tokens  # tokens per draft call (the engine's max_num_batched_tokens)
        self.epoch = 0  # bumped when the draft's KV arrays are lost: every request's draft KV is recomputed
        self.num_failed_calls = 0
        self._states: dict[str, DraftKV] = {}  # how far each request's draft KV is valid, by request id

    def forget(self, live_request_ids) -> None:
        for rid in [rid for rid in self._states if rid not in live_request_ids]:
            del self._states[rid]

    def _widest_step(self, max_seqs: int, max_blocks: int) -> StepShape:
        return StepShape("step", bucket(self.max_tokens, 16), (bucket(max_seqs), bucket(max_blocks, 2)), False, False,
                         None, None, False, None, 0)

    def warmup(self, max_seqs: int, max_blocks: int) -> None:
        """Compile and hold the draft's ragged step at the largest token, sequence and block-table buckets its calls
        reach (`max_tokens`, `max_seqs`, `max_blocks` per sequence), with no optional part (a draft step has none):
        with `compile_in_background` it stands in for every draft call whose own program is not compiled yet
        (`LLMEngine.warmup`)."""
        self.runner.warmup([self._widest_step(max_seqs, max_blocks)])

    def start_warmup(self, max_seqs: int, max_blocks: int):
        """`warmup`'s program compiled in the background (`LLMEngine.start_warmup`); its future of seconds."""
        return self.runner.warm_in_background([self._widest_step(max_seqs, max_blocks)])

    def close(self) -> None:
        """Cancel the draft runner's background compiles still waiting (`LLMEngine.close`)."""
        self.runner.close()

    def sleep(self) -> int:
        """Release the draft's KV arrays (with the target's: `LLMEngine.sleep`); every request's draft KV is then
        recomputed (`epoch`). Returns the bytes freed on each device (0 if already asleep)."""
        if self.runner.asleep:
            return 0
        self.epoch += 1
        return weights.release_kv(self.runner)

    def wake(self) -> None:
        weights.wake(self.runner)

    def propose(self, asks: list[ProposalAsk], step: StepSeen | None) -> list[list[int]]:
        try:
            return draft_proposals(asks, self._run, self._states, block_size=self.block_size,
                                   max_tokens=self.max_tokens, epoch=self.epoch)
        except Exception as exc:  # the proposals only: the target's step goes on without them
            self.num_failed_calls += 1
            self.epoch += 1
            if self.runner.kv_cache_lost:
                self.runner.reset_kv_cache()
            logger.error("draft model call failed, no proposals this step: %s: %s", type(exc).__name__, exc,
                         exc_info=exc)
            return [[] for _ in asks]

    def _run(self, plan: StepPlan) -> np.ndarray:
        """The draft's greedy token after each sequence's last token of `plan`, i32[num_seqs]."""
        n = plan.num_seqs
        greedy = SamplingMetadata.from_lists([0.0] * n, [0] * n, [1.0] * n, [0] * n, [0] * n)
        # The sampled rows given (one per sequence, its last token): the tokens are then padded to `inputs.
        # fine_bucket`, not a power of two from 16 as a prefill chunk's are (a catch-up is mostly a token or two per
        # sequence).
        inputs = pad_step(token_ids=plan.token_ids, positions=plan.positions, slot_mapping=plan.slot_mapping,
                          block_tables=plan.block_tables, kv_lens=plan.kv_lens, cu_q_lens=plan.cu_q_lens,
                          sampling=greedy, logits_indices=plan.cu_q_lens[1:] - 1)
        return np.asarray(self.runner.execute(inputs).tokens[:n])
