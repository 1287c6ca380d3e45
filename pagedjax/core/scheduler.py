"""Continuous batching: which requests advance by how many tokens each step (policy only; the arrays a
step runs on are built by `pagedjax.core.step_plan`).

Plain Python + numpy, no JAX. One rule, no prefill/decode phases: a request's tokens are its prompt plus
its outputs; `num_computed_tokens` counts those whose KV is in the cache; every step the scheduler closes
the gap `num_tokens - num_computed_tokens` of as many requests as the token budget
(`max_num_batched_tokens`) and `max_num_seqs` allow. A decode is a gap of 1 (the last sampled token); a
prompt longer than the remaining budget is split into chunks across steps (chunked prefill).

Order within a step: running requests first, in admission order, then waiting ones, first come first
served. When a running request cannot get blocks, the most recently admitted running request is
preempted (by recompute: it releases every block, `num_computed_tokens` drops to 0, its outputs are kept,
and it goes to the front of the waiting queue; its released blocks stay findable in the prefix cache).
No waiting request is admitted in a step that preempted.

Images (a vision-language model): a request's chunk encodes the images whose placeholder tokens it reaches and
whose features are not cached (`pagedjax.core.encoder_cache`), within the step's `max_num_encoder_tokens`; a chunk
whose next image does not fit that budget (or the encoder cache) stops before the image, which waits for a later
step. With bidirectional image attention (Gemma 3: an image's tokens attend to each other both ways), a chunk
never ends inside an image: its tokens are computed in one step.

LoRA (`max_loras`): running requests use at most `max_loras` distinct adapters (`adapter_id`), so every step,
a fused decode of all of them included, fits the device's adapter slots. A waiting request of an adapter no
running request uses, while that many are in use, is skipped (it waits; later requests of adapters in use may
pass it); once nothing runs, the queue's head is admitted whatever its adapter.

Why every request finishes (no starvation, no livelock): the oldest running request is never preempted
by anyone but itself, and it can always get its blocks by preempting the others, because `add_request`
rejects a request that could not fit in the whole pool; so it advances by >= 1 token every step and
finishes, after which the next oldest takes its place. An idle waiting queue head is admitted as soon as
nothing runs.

Several samples of one prompt (best_of / n > 1): the prompt but its last token is prefilled once by a
`prefill_only` request; when that is done it is forked into the samples (`KVCacheManager.fork`: shared blocks,
copy-on-write of the partial last one), each of which then computes the last prompt token and samples with
its own seed. Samples beyond `max_num_seqs` wait (and recompute, through the prefix cache). Beam search forks
running requests itself (`fork`, with `hold`: a held request pauses after each token until `resume`). A fork
shares its source's blocks only through the pool's refcounts (`KVCacheManager.fork`); a shared block, the
partial last one included, is copied before its first write (copy-on-write, `StepPlan.block_copies`), so no
request ever writes into a block another one reads.

A step that fails on device (`fail_step`) fails its request if it ran alone; otherwise its requests are
preempted and marked suspect, and each suspect runs alone in its next step, so a request that breaks
steps fails by itself and the others lose nothing (recompute is exact). Nothing a failed step computed is
trusted; a device that lost its KV cache (`drop_computed_kv`) costs every running request a recompute, and the
prefix cache forgets every block, so no KV the device lost is ever read.

Life of a step, whatever its kind: `plan = schedule(decode_steps=n)` -> the engine runs `plan` -> `update(plan,
result)` (a `StepResult`: ragged sampled tokens per sequence; `pagedjax.core.step_result` states the one rule
that applies a plain step, a speculative verify step and a fused decode alike). A plan is a fused decode of up
to n steps (`StepPlan.fused`) when every running request is a pure decode that can fuse and the pool can lend the
blocks; speculative decoding's proposals come in between steps (`set_draft_tokens`) and ride in the next plan.

Fused decode invariant: at most one fused decode is in flight (`schedule` refuses to plan past one), and while
one is, nothing else plans a step, forks or fails requests, so the requests and blocks the device works on are
the ones the plan saw. The blocks lent to it are held by no request until `update` reconciles it (each request
adopts the blocks its table row took, up to what its new length needs, and every other lent block comes back)
or `cancel` drops it (every lent block comes back and no request changes).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pagedjax.config import CacheConfig, SchedulerConfig
from pagedjax.core.disk_tier import DiskTier
from pagedjax.core.encoder_cache import EncoderCacheManager
from pagedjax.core.images import ImageInput, check_images, overlapping
from pagedjax.core.invariants import check_scheduler_invariants
from pagedjax.core.kv_cache_manager import KVCacheManager, cdiv
from pagedjax.core.memory_stats import KVMemoryStats, kv_memory_stats
from pagedjax.core.request import Request, RequestStatus, SampleGroup, make_sample, sample_id
from pagedjax.core.step_plan import (
    FusedDecode,
    StepPlan,
    build_step_plan,
    claim_lent_blocks,
    lent_stacks,
    unclaimed_lent_blocks,
)
from pagedjax.core.step_result import StepResult, emitted_tokens
from pagedjax.errors import ContextLengthExceeded, InvalidRequest, UnsupportedFeature


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of the scheduler: its queues, the prefix cache, and the pool's memory."""

    num_waiting: int
    num_running: int
    prefix_cache_queries: int  # prompt tokens of first-time admissions
    prefix_cache_hits: int  # of those, tokens found in the cache
    num_evictions: int  # cached blocks reused for other content
    num_preemptions: int
    num_steps: int  # plans made
    memory: KVMemoryStats
    # Host tiers (`CacheConfig.kv_host_memory_bytes`; zeros without): prefix-hit tokens loaded from them, blocks
    # stored and loaded by steps that ran, their slots and the keys they hold
    host_hit_tokens: int = 0
    host_blocks_stored: int = 0
    host_blocks_loaded: int = 0
    host_slots: int = 0
    host_blocks: int = 0
    # Disk tiers (`CacheConfig.kv_disk_dir`; zeros without): blocks read from files into host slots by steps that
    # ran, blocks written (each block the host tier stores), files found bad (corrupt, truncated, foreign: removed,
    # a miss), and the files they hold
    disk_blocks_read: int = 0
    disk_blocks_written: int = 0
    disk_files_bad: int = 0
    disk_blocks: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class Scheduler:
    """Waiting and running queues, the token budget, preemption, forks, fused-decode lending, failure isolation
    and the KV cache manager: the one owner of the host's request state.

    Invariants: a request is in exactly one of `waiting` (FIFO; holds no blocks), `running` (admission
    order; between steps holds `cdiv(num_computed_tokens, block_size)` blocks, or as many as its pending
    proposals need past its last token) or neither (finished / aborted, and forgotten). `len(running) <=
    max_num_seqs`; a step never schedules more than `max_num_batched_tokens` tokens.
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int, *,
                 sliding_window: int | None = None, group_windows: Sequence[int | None] | None = None,
                 group_pools: Sequence[int] | None = None, extra_pools: Sequence[int] = (),
                 pool_block_sizes: Sequence[int] = (), max_loras: int | None = None, images: int | None = None,
                 bidirectional_images: bool = False, host_tier_blocks: Sequence[int] = (),
                 disk_tiers: Sequence[DiskTier | None] = (), drop_last_hit_block: bool = False,
                 whole_prompts: bool = False) -> None:
        """`sliding_window`: the window of a model of one KV cache group (no layer reads positions older than
        p - window from position p; None: every layer reads everything), `group_windows` one per group of a model
        of several (`ModelSpec.kv_layout.windows`): running requests release a window group's blocks that fell
        out of its window after each step; `group_pools`, `extra_pools` and `pool_block_sizes`: the groups' block
        pools, the sizes of pools past the first and every pool's block size (`KVCacheManager`: a recurrent state's
        snapshots). `max_loras`: the most distinct
        adapters running requests may use (None: no limit; see the module's docstring). `images`: requests may carry
        images of this many placeholder tokens each (`scheduler_config`'s encoder budgets resolved:
        `SchedulerConfig.resolve_images`), whose tokens attend to each other both ways where
        `bidirectional_images`. `host_tier_blocks`: host tier slots per pool, `disk_tiers` the disk tier under each,
        `drop_last_hit_block`: prefix hits end a block early (`KVCacheManager`: an MTP head speculates).
        `whole_prompts`: every prompt runs in one step and takes no prefix-cache hits, nor leaves any (a
        bidirectional model's: its tokens attend to those after them, so neither a chunk nor a cached block holds
        what the whole prompt would have computed); a prompt longer than one step can hold is refused."""
        if scheduler_config.max_model_len is None:
            raise ValueError("SchedulerConfig.max_model_len is None: resolve it first "
                             "(SchedulerConfig.resolve(max_position_embeddings))")
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.max_model_len = scheduler_config.max_model_len
        self.whole_prompts = whole_prompts
        if whole_prompts and cache_config.enable_prefix_caching:
            cache_config = dataclasses.replace(cache_config, enable_prefix_caching=False)
        self.kv_cache_manager = KVCacheManager.from_config(cache_config, num_blocks, sliding_window=sliding_window,
                                                           group_windows=group_windows, group_pools=group_pools,
                                                           extra_pools=extra_pools,
                                                           pool_block_sizes=pool_block_sizes,
                                                           host_tier_blocks=host_tier_blocks, disk_tiers=disk_tiers,
                                                           drop_last_hit_block=drop_last_hit_block)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, SampleGroup] = {}  # multi-sample requests by the caller's id
        self.max_loras = max_loras
        self.encoder_cache: EncoderCacheManager | None = None
        self.tokens_per_image = images
        if images is not None:
            if scheduler_config.encoder_cache_tokens is None or scheduler_config.max_num_encoder_tokens is None:
                raise ValueError("SchedulerConfig's image budgets are None: resolve them first "
                                 "(SchedulerConfig.resolve_images(tokens_per_image))")
            self.encoder_cache = EncoderCacheManager(scheduler_config.encoder_cache_tokens // images)
        self.bidirectional_images = bidirectional_images
        self._step_encodes: list[ImageInput] = []  # images the step being planned encodes
        self.num_preemptions = 0
        self.num_steps = 0
        self._pending_fused: StepPlan | None = None  # a fused decode not yet reconciled
        self._chunk_caps: dict[int, int] = {}  # `max_chunk` by tokens of KV

    # -- requests --------------------------------------------------------------------------------------

    def max_kv_tokens(self, request: Request) -> int:
        """The most tokens whose KV this request can ever need at once: it stops when it reaches
        max_tokens outputs (None: the rest of the context) or max_model_len tokens, and its last sampled token is
        never fed back."""
        p, max_tokens = request.num_prompt_tokens, request.sampling_params.max_tokens
        return max(p, min(p + (self.max_model_len if max_tokens is None else max_tokens), self.max_model_len) - 1)

    def max_new_tokens_left(self, request: Request) -> int:
        """How many more tokens an unfinished request may still generate (>= 1): up to max_tokens
        outputs, and until it has max_model_len tokens (a prompt of exactly max_model_len tokens still
        gets one)."""
        max_tokens = request.sampling_params.max_tokens
        left = self.max_model_len - request.num_tokens
        return max(1, left if max_tokens is None else min(max_tokens - request.num_output_tokens, left))

    def check_request(self, request: Request) -> None:
        """Raise if `add_request` would refuse `request` (`pagedjax.errors`): InvalidRequest for an empty prompt
        or a duplicate request id, ContextLengthExceeded for a prompt longer than max_model_len or a request that
        could not fit even in an empty pool (`KVCacheManager.max_blocks_held`: with a sliding window, what its
        window and one step's chunk hold at once), InvalidRequest (param "images") for images the model does not
        place; ValueError for a request that is not fresh (the caller's bug, not the request's). Changes nothing."""
        rid = request.request_id
        if rid in self.requests or rid in self.groups or any(rid in g.sample_ids for g in self.groups.values()):
            raise InvalidRequest(f"duplicate request id {rid!r}", param="request_id", code="duplicate_request_id")
        if request.sampling_params.num_samples > 1:
            taken = [i for i in (sample_id(rid, j) for j in range(request.sampling_params.num_samples))
                     if i in self.requests]
            if taken:
                raise InvalidRequest(f"request {rid!r}: the ids of its samples {taken[:3]} are in use",
                                     param="request_id", code="duplicate_request_id")
        if request.num_prompt_tokens == 0:
            raise InvalidRequest(f"request {rid!r}: empty prompt", param="prompt")
        if request.num_prompt_tokens > self.max_model_len:
            raise ContextLengthExceeded(f"request {rid!r}: prompt of {request.num_prompt_tokens} tokens is longer "
                                        f"than max_model_len={self.max_model_len}", param="prompt")
        if (request.status is not RequestStatus.WAITING or request.num_computed_tokens
                or request.output_token_ids):
            raise ValueError(f"request {rid!r}: not a fresh request (status {request.status.value}, "
                             f"{request.num_computed_tokens} computed, {request.num_output_tokens} outputs)")
        if request.images:
            self._check_images(request)
        kv = self.kv_cache_manager
        num_kv_tokens = self.max_kv_tokens(request)
        if self.whole_prompts:
            self._check_whole_prompt(request, num_kv_tokens)
        chunk = self.max_chunk(num_kv_tokens)
        if chunk == 0:  # not even its least steps keep what it holds within the pools
            # the least step: one token, or without chunked prefill the budget (a whole prompt in one step)
            least = 1 if self.scheduler_config.enable_chunked_prefill else self.scheduler_config.max_num_batched_tokens
            p = next(p for p, pool in enumerate(kv.pools)
                     if kv.max_blocks_held(num_kv_tokens, least, p) > pool.num_blocks)
            need = kv.max_blocks_held(num_kv_tokens, least, p)
            windows = sorted({w for w, gp in zip(kv.group_windows, kv.group_pools, strict=True)
                              if w is not None and gp == p})
            groups = f" in its {kv.num_groups} KV cache groups" if kv.num_groups > 1 else ""
            step = "a step of one token" if least == 1 else f"a step of {least} tokens (chunked prefill off)"
            why = "" if not windows else (f" at once (its {'/'.join(map(str, windows))}-token sliding window"
                                          f"{'s' * (len(windows) > 1)} and {step})")
            pool = "" if len(kv.pools) == 1 else f" of pool {p}"
            raise ContextLengthExceeded(f"request {rid!r}: its prompt and max_tokens may need {need} blocks{pool} "
                                        f"of {kv.pool_block_size(p)} tokens{groups}{why}, more than the whole pool of "
                                        f"{kv.pools[p].num_blocks} blocks", param="max_tokens")
        if request.images and self.bidirectional_images and chunk < self.tokens_per_image:
            raise InvalidRequest(f"request {rid!r}: an image's {self.tokens_per_image} tokens attend to each other, "
                                 f"so they run in one step, but a step of its tokens may hold at most {chunk} tokens "
                                 f"in the pool of {kv.num_blocks} blocks", param="images")

    def _check_whole_prompt(self, request: Request, num_kv_tokens: int) -> None:
        """ContextLengthExceeded for a prompt that runs in one step (`whole_prompts`) but does not fit one: more
        tokens than the step budget, or more blocks than a pool has (its step holds every block of its tokens in each
        KV cache group: a window releases nothing before the step's first query)."""
        rid, n, kv = request.request_id, request.num_prompt_tokens, self.kv_cache_manager
        why = f"request {rid!r}: this model's attention goes both ways, so its prompt of {n} tokens runs in one step"
        budget = self.scheduler_config.max_num_batched_tokens
        if n > budget:
            raise ContextLengthExceeded(f"{why}, which holds at most {budget} tokens (max_num_batched_tokens)",
                                        param="prompt")
        for p, pool in enumerate(kv.pools):
            need = kv.max_blocks_held(num_kv_tokens, n, p)
            if need > pool.num_blocks:
                groups = f" in its {kv.num_groups} KV cache groups" if kv.num_groups > 1 else ""
                raise ContextLengthExceeded(f"{why}, holding {need} blocks of {kv.pool_block_size(p)} tokens{groups} "
                                            f"at once, more than the pool of {pool.num_blocks} blocks",
                                            param="prompt")

    def max_chunk(self, num_kv_tokens: int) -> int:
        """The most tokens one step may compute of a request reaching `num_kv_tokens` tokens of KV: the token
        budget, or fewer where the pool could not hold what a step of that many holds at once on top of the sliding
        windows (`KVCacheManager.max_blocks_held`: a window model in a small pool prefills, or recomputes after a
        preemption, in smaller chunks instead of being refused); 0 when not even one token fits (without chunked
        prefill a step computes a whole prompt: the budget, or 0)."""
        budget = self.scheduler_config.max_num_batched_tokens
        cap = self._chunk_caps.get(num_kv_tokens)
        if cap is None:
            fits = lambda c: self.kv_cache_manager.fits(num_kv_tokens, c)
            if fits(budget) or not self.scheduler_config.enable_chunked_prefill:
                cap = budget if fits(budget) else 0
            else:  # the blocks held grow with the step's size: the largest that fits
                lo, hi = 0, budget  # fits(lo) (0: none), not fits(hi)
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    lo, hi = (mid, hi) if fits(mid) else (lo, mid)
                cap = lo
            self._chunk_caps[num_kv_tokens] = cap
        return cap

    def _check_images(self, request: Request) -> None:
        rid = request.request_id
        if self.encoder_cache is None:
            raise UnsupportedFeature(f"request {rid!r}: this model takes no images", param="images",
                                     code="images_not_supported")
        check_images(request.images, request.num_prompt_tokens)
        cfg = self.scheduler_config
        for i, im in enumerate(request.images):
            if im.length != self.tokens_per_image:
                raise InvalidRequest(f"request {rid!r}: image {i} has {im.length} placeholder tokens; this model's "
                                     f"images take {self.tokens_per_image}", param="images")
            if self.bidirectional_images and im.length > cfg.max_num_batched_tokens:
                raise InvalidRequest(f"request {rid!r}: image {i}'s {im.length} tokens attend to each other, so they "
                                     f"run in one step, but max_num_batched_tokens is {cfg.max_num_batched_tokens}",
                                     param="images")
        last = request.images[-1]
        if (self.bidirectional_images and request.sampling_params.num_samples > 1
                and last.offset < request.num_prompt_tokens - 1 < last.end):
            # its samples fork after the prompt's last token but one, which would split the image's tokens
            raise InvalidRequest(f"request {rid!r}: n / best_of > 1 with a prompt that ends inside an image's tokens",
                                 param="n")

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt + output) one request can hold: `max_model_len`, or fewer when the pool could
        not hold their KV (its last sampled token needs none; a windowed model needs only its window's and, in a
        small pool, computes it in small steps: `max_chunk`)."""
        cfg = self.scheduler_config
        # In steps of one token (`max_chunk`); without chunked prefill a step computes a whole prompt.
        chunk = 1 if cfg.enable_chunked_prefill else cfg.max_num_batched_tokens
        tokens = self.kv_cache_manager.max_kv_tokens_held(chunk, self.max_model_len - 1)
        return min(self.max_model_len, tokens + 1)

    def add_request(self, request: Request) -> None:
        """Queue a new request (ValueError if `check_request` refuses it). A multi-sample request is queued as
        its prefill: its prompt but the last token, computed once by a `prefill_only` request, which is then
        forked into the samples (`_spawn_samples`); a one-token prompt is queued as its samples at once."""
        self.check_request(request)
        k = request.sampling_params.num_samples
        if k == 1:
            self._register(request)
            self.waiting.append(request)
            return
        group = self.groups[request.request_id] = SampleGroup(request)
        if request.num_prompt_tokens == 1:
            group.samples = [make_sample(group, i) for i in range(k)]
            for sample in group.samples:
                self._register(sample)
                self.waiting.append(sample)
            return
        params = request.sampling_params
        prefill = Request(request_id=request.request_id, prompt_token_ids=request.prompt_token_ids[:-1],
                          sampling_params=params, eos_token_ids=request.eos_token_ids,
                          cache_salt=request.cache_salt, adapter_id=request.adapter_id, images=request.images,
                          group=group,
                          prefill_only=True, constrained=request.constrained,
                          prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        self._register(prefill)
        self.waiting.append(prefill)

    def _register(self, request: Request) -> None:
        self.requests[request.request_id] = request

    def _spawn_samples(self, prefill: Request) -> None:
        """A multi-sample request's prefill is done: fork it into its samples, which take its place in the
        running queue (those beyond max_num_seqs wait, at the front of the queue), and drop it."""
        group = prefill.group
        assert group is not None
        kv = self.kv_cache_manager
        group.samples = [make_sample(group, i) for i in range(group.request.sampling_params.num_samples)]
        group.prompt_logprobs = prefill.prompt_logprobs
        room = self.scheduler_config.max_num_seqs - len(self.running) + 1
        placed = group.samples[:room]
        for sample in placed:
            kv.fork(prefill, sample)
            sample.num_computed_tokens = prefill.num_computed_tokens
            sample.num_cached_tokens = prefill.num_cached_tokens
            sample.status = RequestStatus.RUNNING
        i = self.running.index(prefill)
        self.running[i:i + 1] = placed
        self.waiting.extendleft(reversed(group.samples[room:]))
        kv.free(prefill)
        self._release_images(prefill)
        del self.requests[prefill.request_id]
        prefill.status = RequestStatus.FINISHED_STOPPED  # done; never reported (the group is)
        for sample in group.samples:
            self._register(sample)

    def fork(self, source_id: str, child: Request) -> None:
        """Start `child` (fresh, same prompt) as a fork of the running request `source_id` between steps (beam
        search): it shares the source's blocks and continues from its computed tokens, which must be the
        child's first tokens. ValueError if the source is not running or max_num_seqs is reached."""
        self._check_no_pending_fused()
        source = self.requests.get(source_id)
        if source is None or source.status is not RequestStatus.RUNNING:
            raise ValueError(f"request {source_id!r} is not running; only a running request can be forked")
        if len(self.running) >= self.scheduler_config.max_num_seqs:
            raise ValueError(f"cannot fork {source_id!r}: max_num_seqs={self.scheduler_config.max_num_seqs} "
                             "requests are running")
        if child.request_id in self.requests or child.request_id in self.groups:
            raise ValueError(f"duplicate request id {child.request_id!r}")
        if ((child.adapter_id, child.cache_salt, [im.content_hash for im in child.images])
                != (source.adapter_id, source.cache_salt, [im.content_hash for im in source.images])):
            raise ValueError(f"a fork of {source_id!r} must keep its adapter_id, cache_salt and images (its blocks' "
                             "hash keys)")
        self.kv_cache_manager.fork(source, child)
        child.num_computed_tokens = source.num_computed_tokens
        child.num_cached_tokens = max(source.num_cached_tokens, 0)
        child.status = RequestStatus.RUNNING
        self._register(child)
        self.running.append(child)

    def replace_last_token(self, request_id: str, token: int) -> None:
        """Replace the last output token of a paused request whose KV is not computed yet (beam search keeps the
        beam but continues it with another token)."""
        request = self.requests.get(request_id)
        if request is None or not request.paused or not request.output_token_ids:
            raise ValueError(f"request {request_id!r} is not a paused request with outputs")
        assert request.num_computed_tokens < request.num_tokens  # a paused request's last token is never computed
        request.output_token_ids[-1] = int(token)
        del request.block_hashes[(request.num_tokens - 1) // self.block_size:]  # a hash over the old token

    def resume(self, request_id: str) -> None:
        """Let a paused (held) request be scheduled again."""
        request = self.requests.get(request_id)
        if request is None:
            raise ValueError(f"unknown request {request_id!r}")
        request.paused = False

    def stop_at(self, request: Request, num_output_tokens: int, stop_str: str) -> None:
        """End `request` (one the last step advanced) at a stop string whose text its `num_output_tokens`-th
        output token completed (the engine's output processor finds it): later tokens and their log-probabilities
        are dropped, and an unfinished request is finished now, freeing its blocks. One the same step finished
        (max_tokens, EOS) gets the stop string as its reason: it came first."""
        del request.output_token_ids[num_output_tokens:], request.output_logprobs[num_output_tokens:]
        if request.logprobs is not None:
            del request.logprobs[num_output_tokens:]
        request.stop_str = stop_str
        if self.requests.get(request.request_id) is request:
            self._finish_early(request, RequestStatus.FINISHED_STOPPED)
        request.status = RequestStatus.FINISHED_STOPPED

    def get_request(self, request_id: str) -> Request | None:
        """A waiting or running request (finished and aborted ones are forgotten)."""
        return self.requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def abort(self, request_id: str) -> Request | None:
        """Stop a request at any point, freeing everything it holds (for a multi-sample request, every
        sample). Returns it, or None if unknown."""
        group = self.groups.pop(request_id, None)
        if group is not None:
            group.request.status = RequestStatus.FINISHED_ABORTED
            members = [self.requests.get(request_id)] + [self.requests.get(i) for i in group.sample_ids]
            for member in members:
                if member is not None and member.group is group:
                    self._finish_early(member, RequestStatus.FINISHED_ABORTED)
            return group.request
        request = self.requests.get(request_id)
        if request is not None:
            self._finish_early(request, RequestStatus.FINISHED_ABORTED)
        return request

    def _finish_early(self, request: Request, status: RequestStatus) -> None:
        """Take a waiting or running request out of the queues, free its blocks, and forget it."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv_cache_manager.free(request)
        self._release_images(request)
        request.draft_token_ids.clear()
        del self.requests[request.request_id]
        request.status = status
        self._forget_finished_group(request)

    def _forget_finished_group(self, request: Request) -> None:
        """A member of a multi-sample request left: the group ends when its prefill fails or is aborted (with
        that status), or when its last sample finishes."""
        group = request.group
        if group is None or self.groups.get(group.request.request_id) is not group:
            return
        if request.prefill_only:
            group.request.status, group.request.error = request.status, request.error
        elif not group.finished:
            return
        del self.groups[group.request.request_id]

    # -- failures --------------------------------------------------------------------------------------

    def fail_request(self, request: Request, error: str) -> None:
        """End an unfinished request (one the last step advanced) with FINISHED_ERROR and `error`: its own
        failure, found by the engine after the step (its structured-output constraint refused a token)."""
        request.error = error
        if self.requests.get(request.request_id) is request:
            self._finish_early(request, RequestStatus.FINISHED_ERROR)

    def fail_step(self, request_ids: Sequence[str], error: str) -> list[Request]:
        """The step that ran `request_ids` failed before its results reached `update` (a fused decode in
        flight must be cancelled first). Nothing the step computed is trusted:

          - a step of one request fails it: FINISHED_ERROR, `request.error = error`, blocks freed;
          - a step of several requests preempts each of them (recompute: exact) and marks it `suspect`,
            so that it runs alone in its next step; the request that breaks a step then fails alone, and
            the others go on (a suspect's flag is cleared by its next successful step).

        Requests aborted or finished since are skipped. Returns the requests that failed.
        """
        self._check_no_pending_fused()
        live = [self.requests[rid] for rid in request_ids if rid in self.requests]
        if len(request_ids) == 1 and live:
            request = live[0]
            request.error = error
            self._finish_early(request, RequestStatus.FINISHED_ERROR)
            return [request]
        for request in live:
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
                self._preempt(request)
            request.suspect = True
        return []

    def drop_computed_kv(self) -> None:
        """The device lost the KV cache (e.g. a failed step after the cache was donated): every running
        request is preempted (recomputed later) and the prefix cache forgets every block."""
        self._check_no_pending_fused()
        if self.encoder_cache is not None:
            self.encoder_cache.clear()
        while self.running:
            self._preempt(self.running.pop())  # newest first: the oldest ends at the front of the queue
        if not self.kv_cache_manager.reset_prefix_cache():
            raise RuntimeError("blocks are still in use after preempting every request (a bug)")

    def preempt(self, request_id: str) -> bool:
        """Preempt a running request now (by recompute). Returns False if it is not running."""
        request = self.requests.get(request_id)
        if request is None or request.status is not RequestStatus.RUNNING:
            return False
        self.running.remove(request)
        self._preempt(request)
        return True

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self._release_images(request)
        request.num_computed_tokens = 0
        request.draft_token_ids.clear()
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; refused (False) while any block is in use."""
        return self.kv_cache_manager.reset_prefix_cache()

    # -- speculative proposals -------------------------------------------------------------------------

    def reserve_draft_slots(self, request: Request, cap: int) -> tuple[int, tuple[int, ...], tuple[int, ...]] | None:
        """Between steps, let a decoding request's blocks cover `1 + c` more tokens for the largest `c <= cap`
        the free blocks allow (speculation never preempts nor waits); returns `(c, its blocks in logical order,
        their allocation counts)` (`draft_blocks`), or None when not even one proposal fits. A proposer that writes
        KV at the proposals' positions (a draft model) writes into these; `set_draft_tokens` returns what its
        proposal does not need."""
        self._check_no_pending_fused()
        kv = self.kv_cache_manager
        while cap and kv.allocate_slots(request, 1 + cap) is None:
            cap -= 1
        if not cap:
            return None
        return cap, *self.draft_blocks(request)

    def draft_blocks(self, request: Request) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A running request's blocks of the `draft_group` (logical order) and how many times each was allocated
        (`BlockPool.allocations`): a draft model's KV written into a block is still there while both are the same
        (a reserved block given back unused and taken again, by anyone, has a higher count)."""
        kv = self.kv_cache_manager
        ids = tuple(kv.per_group(kv.get_block_ids(request.request_id))[self.draft_group])
        pool = kv.pools[kv.group_pools[self.draft_group]]
        return ids, tuple(pool.allocations(b) for b in ids)

    @property
    def draft_group(self) -> int:
        """The KV cache group whose block ids a draft model's KV is addressed by: the first that keeps every block
        (0 for a model of window groups only, for which the engine refuses a draft model: an n-gram proposer writes
        no KV)."""
        windows = self.kv_cache_manager.group_windows
        return windows.index(None) if None in windows else 0

    def set_draft_tokens(self, request: Request, tokens: Sequence[int]) -> None:
        """Proposed tokens to follow a running decoding request's last token, verified by its next step (each
        costs a position of that step's token budget; those the budget or the pool cannot take are dropped
        then). Blocks past what `1 + len(tokens)` more tokens need go back (`reserve_draft_slots` may have
        taken more); with no proposal, every block past its computed tokens."""
        self._check_no_pending_fused()
        tokens = [int(t) for t in tokens]
        if tokens and request.num_tokens - request.num_computed_tokens != 1:
            raise ValueError(f"request {request.request_id!r}: proposals follow a decoding request's last token")
        if len(tokens) >= self.max_new_tokens_left(request) and tokens:
            raise ValueError(f"request {request.request_id!r}: {len(tokens)} proposals, at most "
                             f"{self.max_new_tokens_left(request) - 1} may still be verified")
        request.draft_token_ids[:] = tokens
        self.kv_cache_manager.release_past_computed(request, 1 + len(tokens) if tokens else 0)

    def _drop_drafts(self, request: Request, keep: int | None = None) -> None:
        """Drop a running request's pending proposals: all of them and the blocks past its computed tokens when it
        does not run this step (`keep` None), or all but `keep` and the blocks past `1 + keep` more tokens when it
        does."""
        if keep is None:
            request.draft_token_ids.clear()
            self.kv_cache_manager.release_past_computed(request)
        elif len(request.draft_token_ids) > keep:
            del request.draft_token_ids[keep:]
            self.kv_cache_manager.release_past_computed(request, 1 + keep)

    @property
    def has_draft_tokens(self) -> bool:
        return any(r.draft_token_ids for r in self.running)

    # -- scheduling ------------------------------------------------------------------------------------

    def schedule(self, *, decode_steps: int = 1) -> StepPlan:
        """Plan one step: a fused decode of up to `decode_steps` steps when that is possible (`schedule_fused_decode`);
        otherwise running requests first (with their proposals, as far as the budget allows; preempting the
        newest when blocks run out, after dropping every proposal), then waiting ones while the token budget,
        max_num_seqs and the pool allow."""
        self._check_no_pending_fused()
        if decode_steps > 1 and (plan := self.schedule_fused_decode(decode_steps)) is not None:
            return plan
        if self.waiting and self.waiting[0].suspect:
            return self._schedule_alone(self.waiting.popleft())
        cfg = self.scheduler_config
        kv = self.kv_cache_manager
        chunked = cfg.enable_chunked_prefill and not self.whole_prompts
        budget = cfg.max_num_batched_tokens
        running = self.running
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        self._step_encodes = []
        encoder_budget = cfg.max_num_encoder_tokens or 0

        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            if request.paused:
                i += 1
                continue
            gap = request.num_tokens - request.num_computed_tokens
            assert gap > 0, f"running request {request.request_id!r} has nothing to compute"
            room = min(budget, self.max_chunk(self.max_kv_tokens(request)))
            self._drop_drafts(request, max(0, room - gap))  # proposals only where the budget has room
            n = min(gap + len(request.draft_token_ids), room)
            if request.images:
                n = self._image_cut(request, request.num_computed_tokens, n, encoder_budget)
            if n == 0 or (n < gap and not chunked):
                i += 1
                continue
            new_blocks = kv.allocate_slots(request, n)
            if new_blocks is None and self.has_draft_tokens:  # proposals never cost a preemption: drop them all
                for k, (r, m) in enumerate(scheduled):  # those scheduled already run their last token alone
                    budget += len(r.draft_token_ids)
                    scheduled[k] = (r, m - len(r.draft_token_ids))
                    self._drop_drafts(r, 0)
                self._drop_drafts(request, 0)
                for r in running[i + 1:]:
                    self._drop_drafts(r)
                n = min(gap, room)
                new_blocks = kv.allocate_slots(request, n)
            while new_blocks is None:
                victim = running.pop()  # the most recently admitted
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
                new_blocks = kv.allocate_slots(request, n)
            if new_blocks is None:
                break  # it preempted itself; it was the last running request
            if request.images:
                encoder_budget -= self._claim_images(request, request.num_computed_tokens, n)
            scheduled.append((request, n))
            budget -= n
            i += 1
        for request in running[i:]:  # not reached this step: its proposals would go stale
            self._drop_drafts(request)

        if not preempted:
            # Full blocks that running requests are computing, not yet published: a waiting request whose
            # next missing block is one of them waits a step and then hits it, rather than computing the
            # same prefix again in this step (requests sharing a prefix that arrive together).
            in_flight = ({h for r in running for h in kv.unpublished_block_hashes(r)}
                         if kv.enable_caching and self.waiting else set())
            admitted: set[str] = set()
            skipped = False
            adapters = self._running_adapters()
            for request in self.waiting:
                if budget <= 0 or len(running) >= cfg.max_num_seqs or request.suspect:
                    break
                if request.paused:  # a held request preempted while paused waits for `resume`
                    skipped = True
                    continue
                if not self._adapter_fits(request, adapters):
                    skipped = True
                    continue
                hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
                if in_flight and kv.next_block_hash(request, num_hit_tokens // self.block_size) in in_flight:
                    skipped = True
                    continue
                gap = request.num_tokens - num_hit_tokens
                n = min(gap, budget, self.max_chunk(self.max_kv_tokens(request)))
                if request.images:
                    n = self._image_cut(request, num_hit_tokens, n, encoder_budget)
                    if n == 0:  # its next image waits for a step with room in the encoder budget
                        skipped = True
                        continue
                if n < gap and not chunked:
                    break
                if kv.allocate_slots(request, n, hit_blocks) is None:
                    break
                if request.images:
                    encoder_budget -= self._claim_images(request, num_hit_tokens, n)
                admitted.add(request.request_id)
                adapters.add(request.adapter_id)
                self._admit(request, num_hit_tokens)
                scheduled.append((request, n))
                budget -= n
                if kv.enable_caching:
                    in_flight.update(kv.unpublished_block_hashes(request))
            if skipped:
                self.waiting = deque(r for r in self.waiting if r.request_id not in admitted)
            else:  # the admitted requests are a prefix of the queue
                for _ in range(len(admitted)):
                    self.waiting.popleft()

        self.num_steps += 1
        drafts = {r.request_id: r.draft_token_ids for r, _ in scheduled if r.draft_token_ids}
        return self._plan(scheduled, preempted_request_ids=[r.request_id for r in preempted],
                          draft_token_ids=drafts or None)

    def _image_cut(self, request: Request, start: int, n: int, encoder_budget: int) -> int:
        """How many of the `n` tokens from position `start` the request may run in this step for its images (see the
        module's docstring): up to the first image whose features are not cached and do not fit the step's
        remaining `encoder_budget` (feature rows) or the encoder cache, and, with bidirectional image attention,
        never ending inside an image. Changes nothing."""
        end = start + n
        if self.bidirectional_images:
            for im in overlapping(request.images, start, end):
                if end < im.end:  # it would end inside this image: stop before it (or, started inside, not run)
                    end = max(start, im.offset)
                    break
        cache = self.encoder_cache
        planned = {im.content_hash for im in self._step_encodes}
        reused: set[str] = set()  # cached images this chunk needs: they must stay
        new = 0
        for im in overlapping(request.images, start, end):
            if cache.is_cached(im.content_hash):
                reused.add(im.content_hash)
                if cache.can_add(new, keep=reused):
                    continue
            elif im.content_hash in planned:
                continue
            elif (new + 1) * im.length <= encoder_budget and cache.can_add(new + 1, keep=reused):
                new += 1
                planned.add(im.content_hash)
                continue
            end = max(start, im.offset)
            break
        return end - start

    def _claim_images(self, request: Request, start: int, n: int) -> int:
        """The request's images met by its `n` tokens from `start` (as `_image_cut` allowed) are needed by it; those
        not cached are encoded in this step. Returns the feature rows this adds to the step's encoding."""
        cache = self.encoder_cache
        rows = 0
        for im in overlapping(request.images, start, start + n):
            if cache.is_cached(im.content_hash):
                cache.reference(im.content_hash, request.request_id)
            else:
                cache.add(im.content_hash, request.request_id)
                self._step_encodes.append(im)
                rows += im.length
        return rows

    def _release_images(self, request: Request, *, keep_started: bool = False) -> None:
        """The request no longer needs the features of its images (`keep_started`: but those its computed tokens
        end inside, whose remaining placeholders a later step computes; an image further ahead is encoded again
        if it was dropped meanwhile, so that holding it never blocks the images before it)."""
        if self.encoder_cache is None or not request.images:
            return
        n = request.num_computed_tokens
        inside = {im.content_hash for im in request.images if im.offset < n < im.end} if keep_started else set()
        self.encoder_cache.release(request.request_id, {im.content_hash for im in request.images} - inside)

    def _running_adapters(self) -> set[str | None]:
        return {r.adapter_id for r in self.running}

    def _adapter_fits(self, request: Request, adapters: set[str | None]) -> bool:
        """Whether `request` may run beside requests of `adapters` (None among them: the base model) under the
        `max_loras` rule (see the module's docstring)."""
        if self.max_loras is None or request.adapter_id is None or request.adapter_id in adapters:
            return True
        return len(adapters - {None}) < self.max_loras

    def _schedule_alone(self, request: Request) -> StepPlan:
        """A step of `request` alone (a suspect, see `fail_step`): running requests wait one step, and the
        newest are preempted if the pool cannot hold its next chunk otherwise."""
        kv = self.kv_cache_manager
        for r in self.running:
            self._drop_drafts(r)
        hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
        cfg = self.scheduler_config
        n = min(request.num_tokens - num_hit_tokens, self.max_chunk(self.max_kv_tokens(request)))
        preempted: list[Request] = []
        self._step_encodes = []
        while len(self.running) >= cfg.max_num_seqs or (
                self.running and not self._adapter_fits(request, self._running_adapters())) or (
                request.images and self.running
                and self._image_cut(request, num_hit_tokens, n, cfg.max_num_encoder_tokens) == 0):
            preempted.append(self.running.pop())  # (the running requests' images pin the encoder cache)
            self._preempt(preempted[-1])
        if request.images:
            n = self._image_cut(request, num_hit_tokens, n, cfg.max_num_encoder_tokens)
            assert n > 0, "an image that fits no idle encoder cache was admitted (a bug)"
        while kv.allocate_slots(request, n, hit_blocks) is None:
            if not self.running:
                raise RuntimeError(f"request {request.request_id!r} does not fit an idle pool (a bug)")
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
        if request.images:
            self._claim_images(request, num_hit_tokens, n)
        self._admit(request, num_hit_tokens)
        self.num_steps += 1
        return self._plan([(request, n)], preempted_request_ids=[r.request_id for r in preempted])

    def schedule_fused_decode(self, num_steps: int) -> StepPlan | None:
        """A fused decode of up to `num_steps` decode steps of every running request, run on device in one go
        (the plan `schedule(decode_steps=num_steps)` makes when it can): only when num_steps > 1, nothing waits,
        every running request is a pure decode (a gap of exactly 1) without proposals that can fuse, they fit the
        token budget, and the pool can lend the blocks they may need. Otherwise None, nothing changed."""
        self._check_no_pending_fused()
        if (num_steps < 2 or self.waiting or not self.running
                or len(self.running) > self.scheduler_config.max_num_batched_tokens):
            return None
        kv = self.kv_cache_manager
        bs = self.block_size
        max_new: list[int] = []
        num_to_lend = [0] * kv.num_groups
        width = 0
        for r in self.running:
            # A held request (beam search) runs one token at a time; a fork's first write into its shared
            # block needs a copy-on-write, which only a plain step makes (one step, then fused again); a
            # constrained request (structured output) needs its token mask from the host before every token,
            # and proposals are verified by a plain step.
            if (r.num_tokens - r.num_computed_tokens != 1 or r.hold or r.prefill_only or kv.needs_copy(r)
                    or r.constrained or r.draft_token_ids):
                return None
            m = min(num_steps, self.max_new_tokens_left(r))
            max_new.append(m)
            more = kv.per_group(kv.blocks_to_cover(r, r.num_computed_tokens + m))
            num_to_lend = [a + b for a, b in zip(num_to_lend, more, strict=True)]
            width = max(width, cdiv(r.num_tokens + num_steps - 1, bs))
        lent = kv.lend_blocks(kv.from_groups(num_to_lend))
        if lent is None:
            return None
        plan = self._plan([(r, 1) for r in self.running], min_width=width, allow_missing_blocks=True)
        assert plan.request_ids == [r.request_id for r in self.running]
        plan.fused = FusedDecode(lent_block_ids=lent_stacks(lent, kv.num_groups),
                                 max_new_tokens=np.array(max_new, dtype=np.int32), num_steps=num_steps,
                                 block_sizes=kv.group_block_sizes, seq_lens=(plan.kv_lens - 1).astype(np.int32))
        self.num_steps += 1
        self._pending_fused = plan
        return plan

    def _check_no_pending_fused(self) -> None:
        """RuntimeError while a fused decode is in flight (called by everything that changes the queues)."""
        if self._pending_fused is not None:
            raise RuntimeError("a fused decode is in flight: apply its result (update) or cancel it before "
                               "scheduling again")

    def cancel(self, plan: StepPlan) -> None:
        """Forget a plan that did not run (its device step failed, or was interrupted) before `fail_step`: a fused
        decode's lent blocks come back and no request changes (valid because the device writes only into lent
        blocks and the unfilled tails of blocks the requests hold). The encoder cache forgets every image: the
        step's may not have been encoded, and a failed encode may have lost the feature array
        (`pagedjax.runner.images`)."""
        if self.encoder_cache is not None:
            self.encoder_cache.clear()
        if plan.tier_moves is not None:
            self.kv_cache_manager.discard_tier_moves()
        if plan.fused is None:
            return
        if plan is not self._pending_fused:
            raise RuntimeError("this fused decode plan is not the one in flight")
        kv = self.kv_cache_manager
        kv.return_lent_blocks(unclaimed_lent_blocks(plan, [set() for _ in kv.pools], kv.group_pools))
        self._pending_fused = None

    def _admit(self, request: Request, num_hit_tokens: int) -> None:
        """A waiting request (its blocks allocated) starts running after its `num_hit_tokens` cached tokens."""
        request.num_computed_tokens = num_hit_tokens
        if request.num_cached_tokens < 0:  # first admission: the only one counted as a lookup
            request.num_cached_tokens = num_hit_tokens
            self.kv_cache_manager.record_prefix_lookup(request.num_tokens, num_hit_tokens)
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _plan(self, scheduled: list[tuple[Request, int]], **kwargs) -> StepPlan:
        kv = self.kv_cache_manager
        block_ids = {r.request_id: kv.get_block_ids(r.request_id) for r, _ in scheduled}
        cache = self.encoder_cache
        plan = build_step_plan(scheduled, block_ids, kv.group_block_sizes, block_copies=kv.take_block_copies(),
                               image_slots=None if cache is None else cache.slot_of, num_groups=kv.num_groups,
                               num_pools=len(kv.pools),
                               **kwargs)
        if scheduled:  # an empty plan does not run: its moves (none, or evictions of no one's) wait for the next
            plan.tier_moves = kv.take_tier_moves()
        if cache is not None:
            plan.encode_images = [(im, cache.slot_of(im.content_hash)) for im in self._step_encodes]
            self._step_encodes = []
        return plan

    # -- results ---------------------------------------------------------------------------------------

    def update(self, plan: StepPlan, result: StepResult | np.ndarray) -> list[Request]:
        """Apply a step's result, whatever its kind (`pagedjax.core.step_result` states the rule): each scheduled
        request's computed tokens advance, it appends the tokens it emitted (cut at the first that finishes it: a
        stop id, max_tokens or max_model_len), requests that finished are freed, and blocks that became full are
        hashed. Blocks past a request's computed tokens (rejected proposals' positions) go back; a fused decode's
        requests adopt the lent blocks their tables took and the rest come back. Requests aborted or preempted since
        the plan was made are skipped. Everything is validated before anything changes (RuntimeError for a stale
        plan or device tables that disagree with the host's).

        `result`: a `StepResult`, or for a ragged plan the sampled token of each of its rows (`StepResult.
        from_rows`). Returns the requests that finished in this step."""
        if plan.fused is not None and plan is not self._pending_fused:
            raise RuntimeError("this fused decode plan is not the one in flight")
        if not isinstance(result, StepResult):
            if plan.fused is not None:
                raise TypeError("a fused decode's result is a StepResult (StepResult.from_fused)")
            result = StepResult.from_rows(plan, result)
        n = plan.num_seqs
        if result.num_seqs != n:
            raise ValueError(f"a result of {result.num_seqs} sequences for a plan of {n}")
        kv = self.kv_cache_manager
        q_lens = plan.q_lens.tolist()
        kv_lens = plan.kv_lens.tolist()
        emits = plan.emits_token.tolist()
        drafts = [0] * n if plan.num_drafts is None else plan.num_drafts.tolist()
        cu = plan.cu_q_lens.tolist()
        # 1. what each live sequence emits and computes, validated; nothing changes yet
        outcomes: list[tuple[Request, list[int], int, RequestStatus | None, bool]] = []
        claimed: list[set[int]] = [set() for _ in kv.pools]  # per pool: block ids are a pool's own
        adopted: dict[str, list[int]] = {}
        for i, rid in enumerate(plan.request_ids):
            request = self.requests.get(rid)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted or preempted since the plan: whatever it computed goes unused
            if request.num_computed_tokens + q_lens[i] != kv_lens[i]:
                raise RuntimeError(f"stale plan for request {rid!r}: it has {request.num_computed_tokens} "
                                   f"computed tokens, the plan ends at {kv_lens[i]}")
            emitted: list[int] = []
            status = None
            if emits[i] and request.pooling is not None:
                status = RequestStatus.FINISHED_STOPPED  # a pooling request samples nothing: its prompt is done
            elif emits[i] and not request.prefill_only:
                d = drafts[i]
                emitted = emitted_tokens(plan.token_ids[cu[i + 1] - d:cu[i + 1]].tolist() if d else (),
                                         result.rows(i))
                n_out, n_tok = request.num_output_tokens, request.num_tokens
                for j, token in enumerate(emitted):
                    status = request.finish_status(token, n_out + j + 1, n_tok + j + 1, self.max_model_len)
                    if status is not None:
                        del emitted[j + 1:]
                        break
            # each emitted token came from its predecessor fed back (the first from the last known token), so
            # those predecessors' KV is computed: the tokens before the last known one, plus one per emitted token
            computed = kv_lens[i] - drafts[i] - 1 + len(emitted) if emits[i] and not request.prefill_only \
                and request.pooling is None else kv_lens[i]
            if plan.fused is not None:
                adopted[rid] = claim_lent_blocks(plan, result.block_tables, i, rid, kv.get_block_ids(rid), computed,
                                                 claimed, kv.group_pools)
            outcomes.append((request, emitted, computed, status, emits[i] and request.prefill_only))
        # 2. apply
        kv.commit_tier_moves(plan.tier_moves)  # the step ran: the blocks it stored are in the host tiers
        finished: list[Request] = []
        prefilled: list[Request] = []
        for request, emitted, computed, status, prefill_done in outcomes:
            request.num_computed_tokens = computed
            request.suspect = False
            request.draft_token_ids.clear()
            if prefill_done:
                prefilled.append(request)
            if emitted:
                request.output_token_ids.extend(emitted)
                request.paused = request.hold
            if request.request_id in adopted:
                kv.adopt_blocks(request, adopted[request.request_id])
            kv.cache_blocks(request)
            if status is not None:
                request.status = status
                finished.append(request)
            else:
                kv.release_past_computed(request)
                kv.release_out_of_window(request)
                self._release_images(request, keep_started=True)
        if plan.fused is not None:
            kv.return_lent_blocks(unclaimed_lent_blocks(plan, claimed, kv.group_pools))
            self._pending_fused = None
        if finished:
            self.running = [r for r in self.running if not r.is_finished]
            for request in finished:
                kv.free(request)
                self._release_images(request)
                del self.requests[request.request_id]
                self._forget_finished_group(request)
        for request in prefilled:
            self._spawn_samples(request)
        return finished

    # -- invariants ------------------------------------------------------------------------------------

    def check_invariants(self, *, mid_step: bool = False) -> None:
        """Raise RuntimeError naming the first broken invariant (see `pagedjax.core.invariants`)."""
        check_scheduler_invariants(self.kv_cache_manager, running=self.running, waiting=self.waiting,
                                   requests=self.requests, max_num_seqs=self.scheduler_config.max_num_seqs,
                                   encoder_cache=self.encoder_cache, mid_step=mid_step)

    # -- stats -----------------------------------------------------------------------------------------

    def stats(self, *, detailed: bool = False) -> SchedulerStats:
        """A snapshot; O(running requests). `detailed` adds the free-block scatter (O(num_blocks))."""
        kv = self.kv_cache_manager
        tiers = [t for t in kv.tiers if t is not None]
        disks = [t.disk for t in tiers if t.disk is not None]
        return SchedulerStats(
            num_waiting=len(self.waiting), num_running=len(self.running),
            prefix_cache_queries=kv.prefix_cache_queries, prefix_cache_hits=kv.prefix_cache_hits,
            num_evictions=kv.block_pool.num_evictions, num_preemptions=self.num_preemptions,
            num_steps=self.num_steps, memory=kv_memory_stats(kv, self.running, with_free_runs=detailed),
            host_hit_tokens=kv.host_hit_tokens, host_blocks_stored=sum(t.num_stored for t in tiers),
            host_blocks_loaded=sum(t.num_loaded for t in tiers), host_slots=sum(t.capacity for t in tiers),
            host_blocks=sum(len(t) for t in tiers), disk_blocks_read=sum(t.num_filled for t in tiers),
            disk_blocks_written=sum(d.num_written for d in disks), disk_files_bad=sum(d.num_bad for d in disks),
            disk_blocks=sum(len(d) for d in disks))
