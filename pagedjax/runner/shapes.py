"""Program shapes: what a padded step compiles to, which compiled program can run a step whose own is not compiled
yet, and the re-padding that runs it there.

A ragged step's `StepShape` (a fused decode's `LoopShape`) is everything its compiled program depends on: the
runner keys its programs by it. A program *dominates* a step when each of its dimensions is at least the step's
and every optional part the step needs is on in it. The step then runs on it with the same results, because
padding is inert:
  - more tokens: padding tokens write nowhere (slot -1) and belong to no sequence;
  - more sequences: padding sequences have kv_len 0 (nothing attended), sample greedily, run nothing in a fused
    decode (max_new 0), and their tokens are dropped; more sampled rows likewise (a step verifying speculative
    proposals samples `rows` of its own, more than one per sequence: padding rows sample greedily, dropped);
  - more block-table columns: no kernel reads a sequence's blocks past its length;
  - optional parts the step does not need: block copies with dst -1 (dropped), penalties with neutral rows
    (presence 0, frequency 0, repetition 1, min_tokens 0, stop ids -1: the logits pass unchanged), log-
    probabilities and prompt log-probabilities (targets -1) computed and ignored, token masks of all ones
    (every token allowed), pooled sums of no token (pool rows -1: zeros, ignored), sampled tokens of a step that
    emits none (ignored), the random draw of a step whose rows are all greedy (skipped at run time); more top
    alternatives or stop-id columns than the step's are cut or never match;
  - a decode-only step (one token per sequence) may run on a ragged program: ragged attention takes one-token
    sequences too.
"The same results" up to the last-bit rounding any change of shape may bring (as between two bucket sizes of a
step): the tokens of the tests' models are identical, log-probabilities equal to float32 rounding.

The bound on programs (`variants_bound`): per (T, S, B), at most 2 (block copies off / on) x 3 (penalties off,
8 or 512 stop-id columns) x 3 (log-probabilities off, 5 or 20 alternatives) x 3 (prompt log-probabilities off, 5
or 20) x 2 (structured output's token mask off / on) x 2 (pooled sums off / on) x 3 (sampling off: a step in
which no sequence emits a token computes no logits; greedy: every row at temperature 0, the random draw left out;
drawing) = 648 variants of the optional parts, and `return_logits` (which
only tests and tools ask for) doubles that; T is a power of two from 16 to the
token budget's bucket (or S, for a decode-only step; for a step verifying speculative proposals one of
`inputs.fine_bucket`'s four sizes per doubling, `pad_step`), S one up to max_num_seqs' bucket (with speculation,
a verifying step's sampled rows R one more, of `fine_bucket`'s sizes up to (1 + k) max_num_seqs'), B one from 2
up to max_model_len / block_size's bucket. (Before, every power of two of copies, stop ids and alternatives was a
program of its own.) A fused decode has 24 variants per (S, B): stop ids 8 or 512, penalties off / on,
log-probabilities off, 5 or 20, greedy or drawing. A model that takes images doubles the ragged variants (image
features on / off), and again where its images attend both ways (`attend_until` on / off). The runner also holds
at most `max_programs`. Stop-id lists longer than 511 (the Python API has no limit; the server's is 256) add a
power of two each.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from pagedjax.device.attention import AttentionMetadata
from pagedjax.device.sampling import PenaltyMetadata, SamplingMetadata
from pagedjax.runner.inputs import (
    STOP_ID_WIDTHS,
    TOP_LOGPROBS_SIZES,
    FusedDecodeInputs,
    StepExtras,
    StepInputs,
    bucket,
    pad_copies,
    pad_last,
    pad_penalties,
    pad_rows,
    pad_sampling,
    pad_table,
)
from pagedjax.structured_output.masks import mask_words


class StepShape(NamedTuple):
    """The compiled signature of a ragged step (`ModelRunner.execute`); None / False / 0: the part is off."""

    kind: str  # "step"
    tokens: int  # T
    tables: tuple[int, int]  # block_tables' (S, B)
    decode_only: bool
    return_logits: bool
    copies: int | None  # block-copy rows
    stop_width: int | None  # penalties' stop-id columns
    prompt_targets: bool
    num_top_logprobs: int | None
    num_prompt_top_logprobs: int
    token_mask: bool = False  # structured output's allowed-token bits
    rows: int | None = None  # sampled rows, when not one per sequence (a step verifying speculative proposals)
    images: bool = False  # image features in place of placeholder embeddings (`StepInputs.image_index`)
    attend_until: bool = False  # image tokens attending to each other both ways (`AttentionMetadata.attend_until`)
    pool: bool = False  # pooled hidden-state sums per sequence (`StepExtras.pool_rows`: pooling requests)
    sample: bool = True  # logits and sampled tokens (off: no sequence emits a token, `StepInputs.samples`)
    draws: bool = True  # the random draw (off: every row greedy, `draws`; `pagedjax.device.sampling.sample`)

    @property
    def num_rows(self) -> int:
        """The rows it samples: `rows`, or one per sequence."""
        return self.tables[0] if self.rows is None else self.rows

    def __str__(self) -> str:
        """One short line (the log's): "step of 512 tokens, 64 x 256 table (copies, 512 stop ids, top 20, mask)"."""
        parts = [name for name, on in (("decode only", self.decode_only), ("logits", self.return_logits),
                                       ("copies", self.copies), ("images", self.images),
                                       ("both-way images", self.attend_until), ("mask", self.token_mask),
                                       ("pooling", self.pool)) if on]
        if self.stop_width:
            parts.insert(0, f"{self.stop_width} stop ids")
        if self.num_top_logprobs is not None:
            parts.append(f"top {self.num_top_logprobs}")
        if self.prompt_targets:
            parts.append(f"prompt top {self.num_prompt_top_logprobs}")
        if self.rows is not None:
            parts.append(f"{self.rows} rows")
        if not self.sample:
            parts.append("no sampling")
        elif not self.draws:
            parts.append("greedy")
        return f"step of {self.tokens} tokens, {self.tables[0]} x {self.tables[1]} table" + \
            (f" ({', '.join(parts)})" if parts else "")


class LoopShape(NamedTuple):
    """The compiled signature of a fused decode (`ModelRunner.execute_fused_decode`)."""

    kind: str  # "decode_loop"
    tables: tuple[int, int]  # (S, B)
    lent: int  # the lent stack's length
    stop_width: int
    num_steps: int
    penalties: bool
    num_top_logprobs: int | None
    draws: bool = True  # the random draw (off: every row greedy, `draws`)

    def __str__(self) -> str:
        """One short line (the log's): "fused decode of 8 steps, 64 x 256 table (512 stop ids, penalties)"."""
        parts = [f"{self.stop_width} stop ids"] + ["penalties"] * self.penalties + \
            ([] if self.num_top_logprobs is None else [f"top {self.num_top_logprobs}"]) + ["greedy"] * (not self.draws)
        return f"fused decode of {self.num_steps} steps, {self.tables[0]} x {self.tables[1]} table ({', '.join(parts)})"


def run_cost(shape: StepShape | LoopShape) -> int:
    """How much a run of the program computes, to order programs never run (`ProgramCache`'s stand-ins): its
    token rows times the table width they attend over (a fused decode: every step's)."""
    if isinstance(shape, LoopShape):
        return shape.num_steps * shape.tables[0] * shape.tables[1]
    return shape.tokens * shape.tables[1]


def step_shape(inputs: StepInputs, return_logits: bool = False) -> StepShape:
    x = inputs.extras
    tables = inputs.meta.block_tables.shape[-2:]
    rows = len(inputs.logits_indices)
    return StepShape("step", len(inputs.token_ids), tables, inputs.decode_only,
                     return_logits, None if x.block_copies is None else x.block_copies.shape[-2],
                     None if x.penalties is None else x.penalties.stop_ids.shape[1], x.prompt_targets is not None,
                     inputs.num_top_logprobs, inputs.num_prompt_top_logprobs, x.token_mask is not None,
                     None if rows == tables[0] else rows, inputs.image_index is not None,
                     inputs.meta.attend_until is not None, x.pool_rows is not None, inputs.samples,
                     inputs.samples and draws(inputs.sampling))


def loop_shape(inputs: FusedDecodeInputs) -> LoopShape:
    return LoopShape("decode_loop", inputs.block_tables.shape[-2:], inputs.lent_blocks.shape[-1],
                     inputs.stop_ids.shape[1], inputs.num_steps, inputs.penalties is not None, inputs.num_top_logprobs,
                     draws(inputs.sampling))


def draws(sampling: SamplingMetadata) -> bool:
    """Whether a step's program needs the random draw: some row samples at a temperature above 0 (padding rows are
    greedy). A step without it compiles the greedy program, unless its drawing twin is held
    (`ModelRunner._held_twin`)."""
    return bool(np.any(sampling.temperature > 0))


def _at_least(have, need) -> bool:
    """A part the program has (None: off) covers the step's: on when the step's is on, and no smaller."""
    return need is None or (have is not None and have >= need)


def dominates(program: StepShape | LoopShape, step: StepShape | LoopShape) -> bool:
    """Whether `step` can run on the program compiled for `program` (see the module's docstring)."""
    if program.kind != step.kind:
        return False
    (s, b), (step_s, step_b) = program.tables, step.tables
    if s < step_s or b < step_b or not _at_least(program.num_top_logprobs, step.num_top_logprobs):
        return False
    if isinstance(program, LoopShape):
        return (program.num_steps == step.num_steps and program.stop_width >= step.stop_width
                and program.penalties >= step.penalties and program.draws >= step.draws)  # the lent stack
        # follows from S and num_steps
    if program.decode_only and not step.decode_only:
        return False
    prompt_ok = not step.prompt_targets or (
        program.prompt_targets and program.num_prompt_top_logprobs >= step.num_prompt_top_logprobs)
    return (program.tokens >= step.tokens and program.num_rows >= step.num_rows
            and program.return_logits >= step.return_logits and prompt_ok
            and _at_least(program.copies, step.copies) and _at_least(program.stop_width, step.stop_width)
            and program.token_mask >= step.token_mask and program.images >= step.images
            and program.attend_until >= step.attend_until and program.pool >= step.pool
            and program.sample >= step.sample and program.draws >= step.draws)


def variants_bound(*, images: bool = False, attend_until: bool = False) -> int:
    """The most programs one (T, S, B) of ragged steps compiles (see the module's docstring): each optional part
    off or in one of its sizes (for a model that takes images, whose `attend_until` is on where they attend both
    ways)."""
    copies, stops, logprobs, prompt_logprobs, masks, logits, pool, sample = 2, 1 + len(STOP_ID_WIDTHS), \
        1 + len(TOP_LOGPROBS_SIZES), 1 + len(TOP_LOGPROBS_SIZES), 2, 2, 2, 3  # sample: off, greedy, drawing
    return copies * stops * logprobs * prompt_logprobs * masks * logits * pool * sample * (1 + images) * \
        (1 + attend_until)


def neutral_penalties(num_seqs: int, vocab_size: int, width: int) -> PenaltyMetadata:
    """Penalty rows that leave every logit as it is."""
    return pad_penalties(PenaltyMetadata(
        presence=np.zeros(0, np.float32), frequency=np.zeros(0, np.float32), repetition=np.zeros(0, np.float32),
        min_tokens=np.zeros(0, np.int32), output_counts=np.zeros((0, vocab_size), np.int32),
        prompt_mask=np.zeros((0, vocab_size), bool), stop_ids=np.zeros((0, width), np.int32)), num_seqs)


def _widen(pen: PenaltyMetadata | None, num_seqs: int, vocab_size: int, width: int | None) -> PenaltyMetadata | None:
    """`pen` ([S] rows) as `num_seqs` rows of `width` stop-id columns; neutral rows when the step had none."""
    if width is None:
        return None
    if pen is None:
        return neutral_penalties(num_seqs, vocab_size, width)
    pen = pad_penalties(pen, num_seqs)
    stops = np.full((num_seqs, width), -1, np.int32)
    stops[:, : pen.stop_ids.shape[1]] = pen.stop_ids
    return pen._replace(stop_ids=stops)


def repad_step(inputs: StepInputs, shape: StepShape, vocab_size: int, num_pools: int = 1) -> StepInputs:
    """`inputs` padded further to a program of `shape` that dominates them (`dominates`): the same step (of a
    model of `num_pools` block pools: block copies per pool where there are several)."""
    t, (s, b), r = shape.tokens, shape.tables, shape.num_rows
    m, x = inputs.meta, inputs.extras
    copies = None
    if shape.copies is not None:
        none = np.zeros(_groups(num_pools) + (0, 2), np.int32)  # the step's own, else none (in each pool)
        copies = pad_copies(none if x.block_copies is None else x.block_copies, shape.copies)
    targets = None
    if shape.prompt_targets:
        targets = pad_rows(np.zeros(0, np.int32) if x.prompt_targets is None else x.prompt_targets, t, -1)
    mask = None
    if shape.token_mask:  # all ones: every token allowed in rows without a constraint
        mask = pad_rows(np.zeros((0, mask_words(vocab_size)), np.int32) if x.token_mask is None else x.token_mask,
                        r, -1)
    return StepInputs(
        token_ids=pad_rows(inputs.token_ids, t, 0), positions=pad_rows(inputs.positions, t, 0),
        meta=AttentionMetadata(pad_last(m.slot_mapping, t, -1), pad_table(m.block_tables, s, b),
                               pad_rows(m.kv_lens, s, 0), pad_rows(m.cu_q_lens, s + 1, m.cu_q_lens[-1]),
                               _on(shape.attend_until, m.attend_until, t)),
        logits_indices=pad_rows(inputs.logits_indices, r, 0), sampling=pad_sampling(inputs.sampling, r),
        decode_only=shape.decode_only, samples=shape.sample,
        extras=StepExtras(block_copies=copies, penalties=_widen(x.penalties, r, vocab_size, shape.stop_width),
                          prompt_targets=targets, token_mask=mask, pool_rows=_on(shape.pool, x.pool_rows, t)),
        num_top_logprobs=shape.num_top_logprobs, num_prompt_top_logprobs=shape.num_prompt_top_logprobs,
        lora_slots=None if inputs.lora_slots is None else pad_rows(inputs.lora_slots, t, 0),
        image_index=_on(shape.images, inputs.image_index, t))


def _on(on: bool, rows: np.ndarray | None, t: int) -> np.ndarray | None:
    """A per-token i32 input of a program that has it (`on`), padded to t with -1 (no image row; a causal
    token; pooled nowhere), from the step's own or none; None for a program without it."""
    return pad_rows(np.zeros(0, np.int32) if rows is None else rows, t, -1) if on else None


def repad_fused_decode(inputs: FusedDecodeInputs, shape: LoopShape, vocab_size: int) -> FusedDecodeInputs:
    """`inputs` padded further to a fused decode of `shape` that dominates them: the same decode."""
    s, b = shape.tables
    stops = np.full((s, shape.stop_width), -1, np.int32)
    stops[: inputs.stop_ids.shape[0], : inputs.stop_ids.shape[1]] = inputs.stop_ids
    return FusedDecodeInputs(
        tokens=pad_rows(inputs.tokens, s, 0), block_tables=pad_table(inputs.block_tables, s, b),
        seq_lens=pad_rows(inputs.seq_lens, s, 0), lent_blocks=pad_last(inputs.lent_blocks, shape.lent, -1),
        sampling=pad_sampling(inputs.sampling, s), stop_ids=stops, max_new=pad_rows(inputs.max_new, s, 0),
        num_steps=shape.num_steps,
        penalties=_widen(inputs.penalties, s, vocab_size, shape.stop_width if shape.penalties else None),
        num_top_logprobs=shape.num_top_logprobs,
        lora_slots=None if inputs.lora_slots is None else pad_rows(inputs.lora_slots, s, 0))


# ------------------------------------------------------------------------------------------------ warm-up
def warmup_shapes(*, max_tokens: int, max_seqs: int, max_blocks: int, block_size: int, decode_steps: int,
                  narrow: bool, images: bool = False, attend_until: bool = False) -> list[StepShape | LoopShape]:
    """The programs that dominate every step an engine of these limits makes (tokens and sequences per step,
    blocks per sequence) but those that ask for logits, for more than `STOP_ID_WIDTHS[-1]` stop ids, or (for a
    fused decode) more: the ragged step with every optional part on, without prompt log-probabilities (the cheaper
    stand-in for most steps) and with them; and with `decode_steps` > 1 the fused decode with every part on.
    `narrow` (for the XLA attention path, whose cost grows with the block table's width and whose step cost grows
    with its tokens: the bundled model's step of T 512, S 64 took 1,043 ms at 128 blocks per sequence, 143 ms at
    32, on a loaded 2-core CPU) adds a ladder of cheaper stand-ins for the steps of fewer tokens and shorter
    sequences: widths of a quarter of the table (when it has 8 blocks or more), then a sixteenth, ... while 8
    blocks or more, each at T, T / 4, T / 16, ... down to 16 tokens (its sequences capped by its tokens). A step
    then has a stand-in of at most 4x its tokens (16 at least) and, where its table is no wider than the ladder's
    first width, at most 4x its table's width (the narrowest rung's, 8 to 31 blocks, at least) instead of the
    largest step's (measured: stand-in steps
    of 0.6-2.5 s without the token ladder; in the hostile soak, 327 steps over 100 ms in 3 minutes, nearly all of
    short sequences run on a table of 64 blocks, without the narrower widths).
    A model that takes images has its image inputs on in every ragged stand-in (`images`, and `attend_until` where
    its images attend both ways). Every ragged stand-in computes pooled sums (`pool`: one `segment_sum` of its
    hidden states, an [S, hidden] array back to the host), so that an embedding's step never waits for a compile
    either."""
    t, s, b = bucket(max_tokens, 16), bucket(min(max_seqs, max_tokens)), bucket(max_blocks, 2)
    top, stops = TOP_LOGPROBS_SIZES[-1], STOP_ID_WIDTHS[-1]
    plain = StepShape("step", t, (s, b), False, False, s, stops, False, top, 0, True, images=images,
                      attend_until=attend_until, pool=True)
    shapes: list[StepShape | LoopShape] = [plain, plain._replace(prompt_targets=True, num_prompt_top_logprobs=top)]
    if narrow:
        widths = [b // 4 if b >= 8 else b]
        while widths[-1] // 4 >= 8:
            widths.append(widths[-1] // 4)
        for width in widths:
            tokens = t
            while True:
                rows = min(s, bucket(tokens))
                shape = plain._replace(tokens=tokens, tables=(rows, width), copies=rows)
                if shape != plain:
                    shapes.append(shape)
                if tokens <= 16:
                    break
                tokens = max(16, tokens // 4)
    if decode_steps > 1:
        shapes.append(LoopShape("decode_loop", (s, b), bucket(s * -(-decode_steps // block_size)), stops,
                                decode_steps, True, top))
    return shapes


def _groups(n: int) -> tuple[int, ...]:
    """The leading axis of per-group tables and slots (per-pool block copies): none where there is one."""
    return () if n == 1 else (n,)


def padding_step(shape: StepShape, vocab_size: int, num_groups: int = 1, num_pools: int = 1) -> StepInputs:
    """A step of `shape` that is all padding: it writes no KV and reads none (`num_groups`: the model's KV cache
    groups, a table and slot mapping each; `num_pools`: its block pools, block copies each)."""
    empty = np.zeros(0, np.int32)
    g = _groups(num_groups)
    sampling = SamplingMetadata.from_lists([], [], [], [], [])
    meta = AttentionMetadata(np.zeros(g + (0,), np.int32), np.zeros(g + (0, 0), np.int32), empty,
                             np.zeros(1, np.int32))
    step = StepInputs(token_ids=empty, positions=empty, meta=meta, logits_indices=empty, sampling=sampling,
                      decode_only=shape.decode_only)
    return repad_step(step, shape, vocab_size, num_pools)


def padding_fused_decode(shape: LoopShape, vocab_size: int, num_groups: int = 1) -> FusedDecodeInputs:
    """A fused decode of `shape` that is all padding: no sequence runs (max_new 0)."""
    empty = np.zeros(0, np.int32)
    g = _groups(num_groups)
    decode = FusedDecodeInputs(tokens=empty, block_tables=np.zeros(g + (0, 0), np.int32), seq_lens=empty,
                               lent_blocks=np.zeros(g + (0,), np.int32),
                               sampling=SamplingMetadata.from_lists([], [], [], [], []),
                               stop_ids=np.zeros((0, 0), np.int32), max_new=empty, num_steps=shape.num_steps)
    return repad_fused_decode(decode, shape, vocab_size)
