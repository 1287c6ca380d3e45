"""A step's inputs, in one place: scheduled requests -> padded, device-ready arrays.

The scheduler's plans (`core.step_plan`) say which tokens run where in the paged cache; this module adds what
the requests ask of the step (sampling, penalties, log-probabilities, prompt log-probabilities) and pads the
whole to bucket sizes, so that a long run compiles a handful of programs. Plain numpy: nothing here runs on a
device, and nothing reads the model.

  step_inputs(plan, requests, ...)   every kind of step: a ragged step (prefill chunks and decodes together; a
                                     verifying step samples one row per verified position), or a fused decode
                                     (several decode steps in one device call)
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from pagedjax.config.multimodal import ImageSpec
from pagedjax.core.request import Request
from pagedjax.core.step_plan import StepPlan, first_rows
from pagedjax.device.attention import AttentionMetadata
from pagedjax.device.sampling import PenaltyMetadata, SamplingMetadata
from pagedjax.sampling_params import MAX_LOGPROBS


# ------------------------------------------------------------------------------- what the requests ask of a step
def request_seed(r: Request, engine_seed: int) -> int:
    """The request's own seed, or for an unseeded request one reproducible per engine seed and request id
    (engine_seed < 2**32: the result fits 64 bits)."""
    if r.sampling_params.seed is not None:
        return r.sampling_params.seed
    return (engine_seed << 32) ^ zlib.crc32(r.request_id.encode())


def sampling_metadata(requests: list[Request], engine_seed: int) -> SamplingMetadata:
    """One row per request: temperature, top-k/p, min-p, its seed and how many tokens it has sampled."""
    return SamplingMetadata.from_lists(
        [r.sampling_params.temperature for r in requests],
        [r.sampling_params.top_k for r in requests],
        [r.sampling_params.top_p for r in requests],
        [request_seed(r, engine_seed) for r in requests],
        [r.num_output_tokens for r in requests],
        min_p=[r.sampling_params.min_p for r in requests],
    )


def penalty_metadata(requests: list[Request], vocab_size: int) -> PenaltyMetadata | None:
    """Penalty inputs when a request of the step uses penalties or min_tokens (None otherwise)."""
    if not any(r.sampling_params.has_penalties for r in requests):
        return None
    n = len(requests)
    counts = np.zeros((n, vocab_size), np.int32)
    prompt_mask = np.zeros((n, vocab_size), bool)
    stops = [sorted(r.stop_ids) for r in requests]
    stop_ids = np.full((n, stop_id_width(max(map(len, stops), default=1))), -1, np.int32)
    for i, r in enumerate(requests):
        if r.output_token_ids:
            counts[i] = np.bincount(r.output_token_ids, minlength=vocab_size)
        prompt_mask[i, r.prompt_token_ids] = True
        stop_ids[i, : len(stops[i])] = stops[i]
    sp = [r.sampling_params for r in requests]
    return PenaltyMetadata(
        presence=np.array([p.presence_penalty for p in sp], np.float32),
        frequency=np.array([p.frequency_penalty for p in sp], np.float32),
        repetition=np.array([p.repetition_penalty for p in sp], np.float32),
        min_tokens=np.array([p.min_tokens for p in sp], np.int32),
        output_counts=counts, prompt_mask=prompt_mask, stop_ids=stop_ids)


def num_top_logprobs(requests: list[Request]) -> int | None:
    """Top alternatives the step must return per sampled token; None when no request of it needs
    log-probabilities (the step then computes none)."""
    wanted = [r.sampling_params.logprobs or 0 for r in requests if r.wants_logprobs]
    return max(wanted) if wanted else None


def prompt_targets(plan: StepPlan, requests: list[Request]) -> tuple[np.ndarray | None, int]:
    """For requests collecting prompt log-probabilities: the prompt token after each position of this step
    whose log-probability is still missing (-1 elsewhere), and the top count wanted."""
    targets = None
    num_top = 0
    starts = (plan.kv_lens - plan.q_lens).tolist()
    for i, r in enumerate(requests):
        lps = r.prompt_logprobs
        prompt = r.group.request.prompt_token_ids if r.prefill_only else r.prompt_token_ids
        if lps is None or len(lps) >= len(prompt):
            continue
        if targets is None:
            targets = np.full((plan.num_tokens,), -1, np.int32)
        first, last = max(starts[i], len(lps) - 1), min(int(plan.kv_lens[i]), len(prompt) - 1)
        if first < last:
            at = int(plan.cu_q_lens[i]) + first - starts[i]
            targets[at:at + last - first] = prompt[first + 1:last + 1]
        num_top = max(num_top, r.sampling_params.prompt_logprobs or 0)
    return targets, num_top


def pool_rows(plan: StepPlan, requests: list[Request]) -> np.ndarray | None:
    """For pooling requests (`Request.pooling`): i32[T] the sequence of the plan whose pooled sum each token of this
    step adds its hidden state to (-1: none), at the prompt positions its pooling takes that are not pooled yet
    (`Request.pooled_upto`): every one for "mean", position 0 for "cls", the last for "last". None when no token
    of the step is pooled."""
    rows = None
    starts = (plan.kv_lens - plan.q_lens).tolist()
    for i, r in enumerate(requests):
        if r.pooling is None:
            continue
        n = r.num_prompt_tokens
        lo, hi = {"mean": (0, n), "cls": (0, 1), "last": (n - 1, n)}[r.pooling.pooling]
        lo, hi = max(lo, r.pooled_upto, starts[i]), min(hi, int(plan.kv_lens[i]))
        if lo < hi:
            if rows is None:
                rows = np.full((plan.num_tokens,), -1, np.int32)
            at = int(plan.cu_q_lens[i]) + lo - starts[i]
            rows[at:at + hi - lo] = i
    return rows


def step_inputs(plan: StepPlan, requests: list[Request], *, vocab_size: int, engine_seed: int,
                token_mask: np.ndarray | None = None,  # i32[S, W]: allowed-token bitmask rows, None: no mask
                lora_slots: list[int] | None = None,  # each request's adapter slot (0: none); None: no adapters
                images: ImageSpec | None = None,  # the model's, if it takes images
                bidirectional: bool = False,  # the model's attention goes both ways (`ModelSpec.bidirectional`)
                ) -> StepInputs | FusedDecodeInputs:
    """The padded device inputs of any plan from `Scheduler.schedule()`; `requests` in the plan's order.

    A fused decode (`plan.fused`) runs on the loop program; a ragged plan on the step program, where a sequence
    verifying proposals (`plan.num_drafts`) samples one row per verified position (`plan.logits_indices`), row j
    drawn as its request's output number `num_output_tokens + j` (the seed's key a non-speculative step would use
    there) with the sequence's own penalties and mask. `lora_slots` becomes each token's slot (each fused decode
    row's). A step of image placeholders (`plan.image_segments`) gets each token's row of the encoder cache's
    feature array and, for a model whose images attend both ways, each token's `attend_until` (`image_rows`); a
    bidirectional model's ragged step, each token's prompt's last position (its sequence's kv_len - 1: prompts run
    whole, `Scheduler`'s `whole_prompts`)."""
    sampling = sampling_metadata(requests, engine_seed)
    penalties = penalty_metadata(requests, vocab_size)
    if plan.fused is not None:
        fused = plan.fused
        return pad_fused_decode(tokens=plan.token_ids, block_tables=plan.block_tables, seq_lens=fused.seq_lens,
                                lent_blocks=fused.lent_block_ids, sampling=sampling,
                                stop_ids=[sorted(r.stop_ids) for r in requests], max_new=fused.max_new_tokens,
                                num_steps=fused.num_steps, block_size=min(fused.block_sizes), penalties=penalties,
                                num_top_logprobs=num_top_logprobs(requests), lora_slots=lora_slots)
    logits_indices = None
    if plan.num_drafts is not None:
        first = first_rows(plan)
        seq_of_row = np.repeat(np.arange(plan.num_seqs), np.diff(first))  # i32[R]
        offset = np.arange(len(seq_of_row), dtype=np.int32) - first[seq_of_row]  # i32[R]: j within its sequence
        sampling = SamplingMetadata(*(np.asarray(a)[seq_of_row] for a in sampling))
        sampling = sampling._replace(step=sampling.step + offset)
        if penalties is not None:
            penalties = PenaltyMetadata(*(a[seq_of_row] for a in penalties))
        if token_mask is not None:
            token_mask = token_mask[seq_of_row]
        logits_indices = plan.logits_indices
    targets, num_prompt_top = prompt_targets(plan, requests)
    image_index, attend_until = image_rows(plan, images)
    if bidirectional and plan.num_tokens > plan.num_seqs:  # a decode-only step's token is its prompt's last
        attend_until = np.repeat(plan.kv_lens - 1, np.diff(plan.cu_q_lens)).astype(np.int32)
    # A step in which no sequence emits a token (prefill chunks before a prompt's last, pooling requests) needs no
    # logits: the LM head (vocabulary x hidden weights read for each row) and sampling are left out of it.
    samples = any(e and r.pooling is None and not r.prefill_only
                  for e, r in zip(plan.emits_token.tolist(), requests, strict=True))
    if not samples:
        penalties, token_mask = None, None
    return pad_step(token_ids=plan.token_ids, positions=plan.positions, slot_mapping=plan.slot_mapping,
                    block_tables=plan.block_tables, kv_lens=plan.kv_lens, cu_q_lens=plan.cu_q_lens,
                    sampling=sampling, block_copies=plan.block_copies, penalties=penalties, prompt_targets=targets,
                    num_top_logprobs=num_top_logprobs(requests) if samples else None,
                    num_prompt_top_logprobs=num_prompt_top, samples=samples,
                    token_mask=token_mask, logits_indices=logits_indices,
                    lora_slots=None if lora_slots is None else np.repeat(np.asarray(lora_slots, np.int32),
                                                                         plan.q_lens),
                    image_index=image_index, attend_until=attend_until, pool_rows=pool_rows(plan, requests))


def image_rows(plan: StepPlan, images: ImageSpec | None) -> tuple[np.ndarray | None, np.ndarray | None]:
    """For a step of image placeholders: i32[T] each token's row of the encoder cache's feature array (slot *
    tokens_per_image + row; -1: none), and for a model whose images attend both ways, i32[T] each token's
    `attend_until` (an image token's last placeholder position, every other token's own position). (None, None)
    for a step of none."""
    if not plan.image_segments:
        return None, None
    index = np.full(plan.num_tokens, -1, np.int32)
    until = plan.positions.copy() if images.bidirectional else None
    for seg in plan.image_segments:
        first = seg.slot * images.tokens_per_image + seg.row
        index[seg.token:seg.token + seg.count] = np.arange(first, first + seg.count, dtype=np.int32)
        if until is not None:
            until[seg.token:seg.token + seg.count] = seg.last_position
    return index, until


# ------------------------------------------------------------------------------------------------ padding
# Each size of a step's optional parts is a program to compile (and a stall, if compiled when first needed), so
# they come in few sizes (`shapes` derives the bound on programs from these): top log-probabilities 0-5 -> 5
# (OpenAI's completions API allows 5), 6-20 -> 20 (`MAX_LOGPROBS`); stop-id columns (EOS and stop ids) 1-8 -> 8,
# 9-512 -> 512 (the server's 256 stop_token_ids plus EOS ids), more (the Python API has no limit) to a power of
# two. A few more columns or alternatives cost next to nothing beside the vocabulary-wide work around them.
TOP_LOGPROBS_SIZES = (5, MAX_LOGPROBS)
STOP_ID_WIDTHS = (8, 512)


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum)."""
    n = max(int(n), minimum, 1)
    return 1 << (n - 1).bit_length()


def fine_bucket(n: int) -> int:
    """The smallest size >= n of 1, 2, ..., 8 and 2^e x {5/4, 6/4, 7/4, 2} above (10, 12, 14, 16, 20, ...): at most
    25% padding where a power of two pads up to 2x, four sizes per doubling. For the tokens and sampled rows of a
    step verifying speculative proposals, (1 + k) per sequence: on the CPU each padded row costs the float32 dots
    nearly as much as a real one (1 + 4 = 5 tokens as 8 made a verifying step about 10% dearer:
    `scripts/bench_verify.py`)."""
    n = max(int(n), 1)
    step = max(1, bucket(n) // 8)
    return -(-n // step) * step


def pad_rows(x, n: int, value, dtype=np.int32) -> np.ndarray:
    """`x` along its first axis, padded with `value` to length n."""
    out = np.full((n,) + np.shape(x)[1:], value, dtype)
    out[: len(x)] = x
    return out


def pad_last(x: np.ndarray, n: int, value) -> np.ndarray:
    """An int32 array along its last axis, padded with `value` to length n (a slot mapping or a lent stack: one
    row per KV cache group where a model has several)."""
    out = np.full(x.shape[:-1] + (n,), value, np.int32)
    out[..., : x.shape[-1]] = x
    return out


def pad_table(table: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """A block table `[(num_groups,) S, B]` padded with block 0 (never read: past every sequence's length)."""
    out = np.zeros(table.shape[:-2] + (rows, cols), np.int32)
    out[..., : table.shape[-2], : table.shape[-1]] = table
    return out


def pad_copies(block_copies: np.ndarray, rows: int) -> np.ndarray:
    """(src, dst) block-copy rows `[(P,) C, 2]` padded to `rows` with (0, -1) (dst -1: dropped)."""
    out = np.zeros(block_copies.shape[:-2] + (rows, 2), np.int32)
    out[..., 1] = -1
    out[..., : block_copies.shape[-2], :] = block_copies
    return out


def pad_sampling(sampling: SamplingMetadata, n: int) -> SamplingMetadata:
    """Padding rows are greedy."""
    return SamplingMetadata(
        temperature=pad_rows(sampling.temperature, n, 0.0, np.float32),
        top_k=pad_rows(sampling.top_k, n, 0),
        top_p=pad_rows(sampling.top_p, n, 1.0, np.float32),
        min_p=pad_rows(sampling.min_p, n, 0.0, np.float32),
        seed_hi=pad_rows(sampling.seed_hi, n, 0, np.uint32),
        seed_lo=pad_rows(sampling.seed_lo, n, 0, np.uint32),
        step=pad_rows(sampling.step, n, 0),
    )


def pad_penalties(pen: PenaltyMetadata | None, n: int) -> PenaltyMetadata | None:
    """Padding rows have no penalty."""
    if pen is None:
        return None
    return PenaltyMetadata(
        presence=pad_rows(pen.presence, n, 0.0, np.float32), frequency=pad_rows(pen.frequency, n, 0.0, np.float32),
        repetition=pad_rows(pen.repetition, n, 1.0, np.float32), min_tokens=pad_rows(pen.min_tokens, n, 0),
        output_counts=pad_rows(pen.output_counts, n, 0), prompt_mask=pad_rows(pen.prompt_mask, n, False, bool),
        stop_ids=pad_rows(pen.stop_ids, n, -1))


class StepExtras(NamedTuple):
    """The optional parts of a step (None when no request in it needs them: they cost nothing then)."""

    block_copies: np.ndarray | None = None  # i32[(P,) C, 2] (src, dst) blocks copied before the KV write (per block
    #                                         pool where there are several); dst -1 = pad
    penalties: PenaltyMetadata | None = None  # [S] rows
    prompt_targets: np.ndarray | None = None  # i32[T]: the prompt token after each position whose log-probability
    #                                           is wanted, -1 elsewhere
    token_mask: np.ndarray | None = None  # i32[S, cdiv(vocab, 32)] allowed-token bits (structured output; all
    #                                       ones = unconstrained)
    pool_rows: np.ndarray | None = None  # i32[T]: the sequence whose pooled hidden-state sum each token adds to
    #                                      (pooling requests: `pool_rows`), -1 = none


NO_EXTRAS = StepExtras()


@dataclass(frozen=True)
class StepInputs:
    """A padded, device-ready step. Shapes: T tokens, S sequences, B blocks per sequence (all buckets)."""

    token_ids: np.ndarray  # int32 [T]
    positions: np.ndarray  # int32 [T]
    meta: AttentionMetadata  # slot_mapping [(G,) T], block_tables [(G,) S, B], kv_lens [S], cu_q_lens [S + 1]
    logits_indices: np.ndarray  # int32 [S]: the tokens whose logits are sampled (S rows: a step that samples
    #                             more than one token of a sequence pads its sequences to as many rows)
    sampling: SamplingMetadata  # [S] each
    decode_only: bool
    extras: StepExtras = NO_EXTRAS
    num_top_logprobs: int | None = None  # top alternatives per sampled token (a bucket); None: no log-probabilities
    num_prompt_top_logprobs: int = 0  # per prompt position, when extras.prompt_targets is set
    lora_slots: np.ndarray | None = None  # int32 [T]: each token's adapter slot (0, padding too: none); None: the
    #                                       engine serves no adapters (a runner with adapters reads None as zeros)
    image_index: np.ndarray | None = None  # int32 [T]: each token's row of the image feature array (-1: its own
    #                                        embedding); None: a step of no image placeholder
    samples: bool = True  # False: no sequence emits a token: no logits computed, the sampled tokens are zeros


def pad_step(*, token_ids: np.ndarray,  # i32[T]
             positions: np.ndarray,  # i32[T]
             slot_mapping: np.ndarray,  # i32[(G,) T]: per KV cache group where the model has several
             block_tables: np.ndarray,  # i32[(G,) S, B]
             kv_lens: np.ndarray,  # i32[S]
             cu_q_lens: np.ndarray,  # i32[S + 1]
             sampling: SamplingMetadata,  # [R] each (R = S unless logits_indices)
             block_copies: np.ndarray | None = None,  # i32[(P,) C, 2]
             penalties: PenaltyMetadata | None = None,  # [R] rows
             prompt_targets: np.ndarray | None = None,  # i32[T]
             num_top_logprobs: int | None = None,
             num_prompt_top_logprobs: int = 0,
             token_mask: np.ndarray | None = None,  # i32[R, W]
             logits_indices: np.ndarray | None = None,  # i32[R]
             lora_slots: np.ndarray | None = None,  # i32[T]
             image_index: np.ndarray | None = None,  # i32[T]
             attend_until: np.ndarray | None = None,  # i32[T]
             pool_rows: np.ndarray | None = None,  # i32[T]
             samples: bool = True,
             ) -> StepInputs:
    """Pad a ragged step to bucket sizes. Padding tokens write nowhere (slot -1); padding sequences have
    q_len 0 and kv_len 0, so every kernel returns zeros for them. Sequences are bucketed from 1 (a batch
    of one runs as one row: on a CPU a padded row costs nearly as much as a real one). Block copies take the
    sequence bucket's rows (dst -1 = padding); top-logprob counts and stop-id columns come in
    `TOP_LOGPROBS_SIZES` and `STOP_ID_WIDTHS` (the host keeps what each request asked for).
    `logits_indices`: the R tokens whose logits are sampled, when not one per sequence (its last token; speculative
    decoding samples every verified position): sampling, penalties and token masks then have R rows, padded to
    `fine_bucket(R)` as the tokens are to `fine_bucket(T)`, neither below the sequences' bucket (the sequences keep
    their own: a padding sequence costs the XLA attention path a query tile), so that T_b >= R_b >= S_b."""
    num_tokens, num_seqs = len(token_ids), len(kv_lens)
    decode_only = num_tokens == num_seqs
    # Ragged steps pad their tokens to a power of two from 16 (prefill chunks: few programs); a step that samples
    # rows of its own (verifying proposals: a few tokens per sequence, batch 1 most of all) pads its tokens and rows
    # to `fine_bucket`, so that it computes few more than it has (5 tokens of batch 1 and k = 4 as 5, not 16 or 8).
    s_b = bucket(num_seqs)
    if logits_indices is None:
        logits_indices = np.asarray(cu_q_lens[1:]) - 1
        r_b = s_b
        t_b = s_b if decode_only else bucket(num_tokens, 16)
    else:
        r_b = max(s_b, fine_bucket(len(logits_indices)))  # sampled rows: T_b >= R_b >= S_b as R >= S
        t_b = s_b if decode_only else max(s_b, fine_bucket(num_tokens))
    tables = pad_table(block_tables, s_b, bucket(block_tables.shape[-1], 2))
    copies = None
    if block_copies is not None and (block_copies[..., 1] >= 0).any():
        # A request has at most one copy pending per group (its shared last block), so rows of the sequence bucket
        # make copies on or off, not a size of their own.
        copies = pad_copies(block_copies, max(s_b, bucket(block_copies.shape[-2])))
    extras = StepExtras(block_copies=copies, penalties=pad_penalties(penalties, r_b),
                        prompt_targets=None if prompt_targets is None else pad_rows(prompt_targets, t_b, -1),
                        token_mask=None if token_mask is None else pad_rows(token_mask, r_b, -1),
                        pool_rows=None if pool_rows is None else pad_rows(pool_rows, t_b, -1))
    return StepInputs(
        extras=extras,
        num_top_logprobs=_bucket_top(num_top_logprobs),
        num_prompt_top_logprobs=0 if prompt_targets is None else _bucket_top(num_prompt_top_logprobs),
        token_ids=pad_rows(token_ids, t_b, 0),
        positions=pad_rows(positions, t_b, 0),
        meta=AttentionMetadata(pad_last(slot_mapping, t_b, -1), tables, pad_rows(kv_lens, s_b, 0),
                               pad_rows(cu_q_lens, s_b + 1, num_tokens),
                               None if attend_until is None else pad_rows(attend_until, t_b, -1)),
        logits_indices=pad_rows(logits_indices, r_b, 0),
        sampling=pad_sampling(sampling, r_b),
        decode_only=decode_only,
        lora_slots=None if lora_slots is None else pad_rows(lora_slots, t_b, 0),
        image_index=None if image_index is None else pad_rows(image_index, t_b, -1),
        samples=samples,
    )


@dataclass(frozen=True)
class FusedDecodeInputs:
    """A padded fused decode of S sequences (buckets; padding rows have max_new 0 and never run)."""

    tokens: np.ndarray  # int32 [S]: each sequence's last token, whose KV is not cached yet
    block_tables: np.ndarray  # int32 [(G,) S, B], wide enough for num_steps more tokens (per KV cache group)
    seq_lens: np.ndarray  # int32 [S]: tokens in the cache before step 1
    lent_blocks: np.ndarray  # int32 [(G,) F]: the stack the device pops from, front first, padded with -1
    sampling: SamplingMetadata  # [S] each
    stop_ids: np.ndarray  # int32 [S, K], -1 = none
    max_new: np.ndarray  # int32 [S]: tokens each sequence may generate in this call
    num_steps: int
    penalties: PenaltyMetadata | None = None  # [S] rows; output_counts are updated on device each step
    num_top_logprobs: int | None = None
    lora_slots: np.ndarray | None = None  # int32 [S]: each sequence's adapter slot (as `StepInputs.lora_slots`)


def pad_fused_decode(*, tokens: np.ndarray,  # i32[S]
                     block_tables: np.ndarray,  # i32[(G,) S, B]
                     seq_lens: np.ndarray,  # i32[S]
                     lent_blocks: np.ndarray,  # i32[(G,) F]
                     sampling: SamplingMetadata,  # [S] each
                     stop_ids: list[list[int]],  # S lists
                     max_new: np.ndarray,  # i32[S]
                     num_steps: int,
                     block_size: int,
                     penalties: PenaltyMetadata | None = None,  # [S] rows
                     num_top_logprobs: int | None = None,
                     lora_slots=None,  # S ints
                     ) -> FusedDecodeInputs:
    """Pad a fused decode to bucket sizes. The lent stack is padded with -1, which the device never pops
    (a short stack raises `overflow` instead of writing into block 0), to a length fixed by the batch bucket
    and `num_steps`: one sequence pops at most `cdiv(num_steps, block_size)` blocks in `num_steps` steps, so
    the stack's length adds no shape of its own to compile."""
    n = len(tokens)
    s_b = bucket(n)
    stack = s_b * -(-num_steps // block_size)
    if lent_blocks.shape[-1] > stack:
        raise ValueError(f"{lent_blocks.shape[-1]} lent blocks for {n} sequences and {num_steps} steps of block size "
                         f"{block_size}: at most {stack} can be popped")
    stops = np.full((s_b, stop_id_width(max(map(len, stop_ids), default=1))), -1, np.int32)
    for i, ids in enumerate(stop_ids):
        stops[i, : len(ids)] = ids
    return FusedDecodeInputs(
        tokens=pad_rows(tokens, s_b, 0),
        block_tables=pad_table(block_tables, s_b, bucket(block_tables.shape[-1], 2)),
        seq_lens=pad_rows(seq_lens, s_b, 0),
        lent_blocks=pad_last(lent_blocks, bucket(stack), -1),
        sampling=pad_sampling(sampling, s_b),
        stop_ids=stops,
        max_new=pad_rows(max_new, s_b, 0),
        num_steps=num_steps,
        penalties=pad_penalties(penalties, s_b),
        num_top_logprobs=_bucket_top(num_top_logprobs),
        lora_slots=None if lora_slots is None else pad_rows(lora_slots, s_b, 0),
    )


def _bucket_top(num_top: int | None) -> int | None:
    """None stays None (no log-probabilities computed: the lean step); 0..20 to the next of
    `TOP_LOGPROBS_SIZES`."""
    if num_top is None:
        return None
    return next((size for size in TOP_LOGPROBS_SIZES if num_top <= size), bucket(num_top))


def stop_id_width(n: int) -> int:
    """Stop-id columns for `n` ids: the next of `STOP_ID_WIDTHS`, past them a power of two."""
    return next((width for width in STOP_ID_WIDTHS if n <= width), bucket(n))
