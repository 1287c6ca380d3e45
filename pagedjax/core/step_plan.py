"""What one step runs, as plain numpy arrays: `StepPlan` (the one plan type of every kind of step: a mixed
prefill/decode step, a speculative verify step, a fused decode of several steps), and the pure functions that
build them and mirror the device's block pops.

Plain Python + numpy, no JAX. The scheduler decides *which* requests advance by how many tokens; this module
turns that decision into the ragged arrays a jitted step consumes (token ids, positions, block tables, slot
mapping), the way nano-vllm's model runner `prepare_*` does, but on the host and in numpy.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from pagedjax.core.host_tier import TierMoves
from pagedjax.core.images import ImageInput, ImageSegment, step_segments
from pagedjax.core.request import Request

_EMPTY_I32 = np.zeros((0,), np.int32)


@dataclass
class StepPlan:
    """One step's work as plain numpy arrays, ready for a jitted step.

    Sequences: running decodes first (q_len 1), then prefills / prefill chunks. Tokens are laid out seq
    after seq (ragged): sequence s owns `token_ids[cu_q_lens[s]:cu_q_lens[s+1]]`, at positions
    `kv_lens[s] - q_len[s] ... kv_lens[s] - 1`, and attends to its first `kv_lens[s]` tokens through
    `block_tables[s]`. `slot_mapping[t] = block_id * block_size + offset` is where token t's K/V goes
    (-1 = padding / not written; in a plain step every token has a slot). A model of several KV cache groups has a
    table and a slot mapping per group: `block_tables [num_groups, num_seqs, max_blocks]`, `slot_mapping
    [num_groups, num_tokens]` (and a fused decode's lent blocks `[num_groups, num_lent]`), each by its group's block
    size (a state pool's may be larger than the KV pool's).
    """

    request_ids: list[str]
    token_ids: np.ndarray  # int32 [num_tokens]
    positions: np.ndarray  # int32 [num_tokens]
    cu_q_lens: np.ndarray  # int32 [num_seqs + 1]
    kv_lens: np.ndarray  # int32 [num_seqs]: context length including this step's tokens
    block_tables: np.ndarray  # int32 [(num_groups,) num_seqs, max_blocks_per_seq], padded with 0
    slot_mapping: np.ndarray  # int32 [(num_groups,) num_tokens]
    emits_token: np.ndarray  # bool [num_seqs]: the seq's last scheduled token is its last known token, so
    #                          the token sampled from its logits is its next output (False mid-prefill)
    preempted_request_ids: list[str] = field(default_factory=list)
    num_decodes: int = 0  # the first num_decodes seqs have q_len == 1
    # int32 [num_copies, 2]: (src, dst) blocks to copy, every layer's K and V, before the step writes its KV
    # (copy-on-write of blocks shared by forks; see `KVCacheManager.fork`); with several block pools (a recurrent
    # state's snapshots beside the K/V) [num_pools, num_copies, 2], each pool's rows padded with (0, -1)
    block_copies: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int32))
    # int32 [num_seqs]: speculative decoding's proposed tokens at the end of each sequence's query, verified by
    # this step (see `pagedjax.core.step_result`); None in a step that verifies none
    num_drafts: np.ndarray | None = None
    # Several decode steps in one device call (every sequence a decode; see `FusedDecode`); None for one step
    fused: FusedDecode | None = None
    # Images (`pagedjax.core.images`): which step tokens take which rows of which image's features (in which
    # encoder cache slot), and the images whose features this step computes first, into their slots
    image_segments: list[ImageSegment] = field(default_factory=list)
    encode_images: list[tuple[ImageInput, int]] = field(default_factory=list)
    # Host tiers (`pagedjax.core.host_tier`): per block pool, the blocks to copy out to host memory and in from it
    # before the step computes (stores first); None without host tiers
    tier_moves: tuple[TierMoves, ...] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.request_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def q_lens(self) -> np.ndarray:
        return np.diff(self.cu_q_lens).astype(np.int32)

    @property
    def logits_indices(self) -> np.ndarray:
        """Where the sampled logits come from, sequence after sequence: each sequence's last scheduled token, or,
        for one verifying `num_drafts[s]` proposals, its last `1 + num_drafts[s]` tokens in order."""
        ends = self.cu_q_lens[1:]
        if self.num_drafts is None:
            return (ends - 1).astype(np.int32)
        rows = self.num_drafts + 1
        first = np.cumsum(rows) - rows  # each sequence's first row
        return (np.repeat(ends - rows - first, rows) + np.arange(int(rows.sum()))).astype(np.int32)

    @property
    def is_empty(self) -> bool:
        return self.num_seqs == 0

    @property
    def num_groups(self) -> int:
        """KV cache groups: one table and slot mapping each (a leading axis when there are several)."""
        return 1 if self.block_tables.ndim == 2 else self.block_tables.shape[0]

    @classmethod
    def empty(cls, preempted_request_ids: Sequence[str] = ()) -> StepPlan:
        return cls(request_ids=[], token_ids=_EMPTY_I32.copy(), positions=_EMPTY_I32.copy(),
                   cu_q_lens=np.zeros((1,), np.int32), kv_lens=_EMPTY_I32.copy(),
                   block_tables=np.zeros((0, 0), np.int32), slot_mapping=_EMPTY_I32.copy(),
                   emits_token=np.zeros((0,), bool), preempted_request_ids=list(preempted_request_ids))


@dataclass(frozen=True)
class FusedDecode:
    """The part of a plan that runs up to `num_steps` decode steps of every sequence on device, with no host round
    trip.

    The plan itself is step 1 (decodes only). Its `block_tables` hold each request's current blocks and are wide
    enough for `num_steps` more tokens (`max ceil((kv_len + num_steps - 1) / block_size)` columns). The host
    allocates no block for the step's tokens: a sequence whose token starts a new block (`(kv_len - 1) %
    block_size == 0`) pops it from the lent stack on device, in step 1 as in every later step, and its
    `slot_mapping` entry is -1 (the device computes it; see `simulate_device_pops`).

    `lent_block_ids` is the stack of lent blocks, popped front to back, exactly enough for every sequence to write
    `max_new_tokens[s]` tokens (with several KV cache groups one stack per group, `[num_groups, num_lent]`, padded
    with -1: a group's table gains a block whenever a sequence crosses a block of its `block_sizes[g]`).
    `max_new_tokens[s] = min(num_steps, remaining max_tokens, max_model_len - num_tokens)` (at least 1; see
    `Scheduler.max_new_tokens_left`): the device stops sequence s after that many steps (or at a stop id).
    """

    lent_block_ids: np.ndarray  # int32 [(num_groups,) num_lent]
    max_new_tokens: np.ndarray  # int32 [num_seqs]
    num_steps: int
    block_sizes: tuple[int, ...]  # each KV cache group's block size
    seq_lens: np.ndarray  # int32 [num_seqs]: tokens each sequence has in the cache before step 1


def first_rows(plan: StepPlan) -> np.ndarray:
    """int32 [num_seqs + 1]: sequence s's sampled tokens are rows first[s]..first[s + 1] - 1 of a ragged step's
    (`StepPlan.logits_indices`)."""
    rows = np.ones(plan.num_seqs, np.int32) if plan.num_drafts is None else plan.num_drafts + 1
    out = np.zeros(plan.num_seqs + 1, np.int32)
    np.cumsum(rows, out=out[1:])
    return out


def build_step_plan(scheduled: Sequence[tuple[Request, int]], block_ids: Mapping[str, Sequence[int]],
                    block_size: int | Sequence[int], *, preempted_request_ids: Sequence[str] = (), min_width: int = 0,
                    allow_missing_blocks: bool = False,
                    block_copies: Sequence = (),
                    draft_token_ids: Mapping[str, Sequence[int]] | None = None,
                    image_slots: Callable[[str], int] | None = None, num_groups: int = 1,
                    num_pools: int = 1) -> StepPlan:
    """The step that advances each `(request, num_tokens)` of `scheduled` by `num_tokens` tokens from its
    `num_computed_tokens`, through the blocks `block_ids[request_id]` it holds (in logical order; with
    `num_groups` > 1, one such sequence per KV cache group, and the plan's tables and slots per group; `block_size`
    then one per group, or one for all).

    Decodes (num_tokens == 1) come first, then prefills, each group in the given order. `min_width` widens
    the block tables (a fused decode's tables must fit its later steps). Unless `allow_missing_blocks`
    (a fused decode's step 1 may pop its block on device), every token must have a block.
    `draft_token_ids[request_id]`: proposed tokens that follow a decoding request's last known token in its query
    (`num_tokens` counts them: a request scheduled with `1 + len(drafts)` tokens); the plan's `num_drafts` says how
    many each sequence carries. `image_slots`: each cached image's encoder cache slot (requests with images).
    `block_copies`: (src, dst) pairs, with `num_pools` > 1 one sequence of them per block pool.
    """
    copies = _copies_array(block_copies, num_pools)
    if not scheduled:
        if (copies[..., 1] >= 0).any():
            raise ValueError("block copies without a scheduled request")
        return StepPlan.empty(preempted_request_ids)
    order = [x for x in scheduled if x[1] == 1]
    num_decodes = len(order)
    if num_decodes < len(scheduled):
        order += [x for x in scheduled if x[1] != 1]
    n = len(order)
    block_sizes = (block_size,) * num_groups if isinstance(block_size, int) else tuple(block_size)
    if len(block_sizes) != num_groups:
        raise ValueError(f"{len(block_sizes)} block sizes for {num_groups} KV cache groups")

    request_ids: list[str] = []
    q_list: list[int] = []
    start_list: list[int] = []
    known_list: list[int] = []
    tokens: list[int] = []
    rows: list[Sequence[int]] = []
    drafts_list: list[int] = []
    segments: list[ImageSegment] = []
    for r, k in order:
        s = r.num_computed_tokens
        if r.images:
            segments += step_segments(r.images, s, k, len(tokens), image_slots)
        drafts = draft_token_ids.get(r.request_id, ()) if draft_token_ids else ()
        request_ids.append(r.request_id)
        q_list.append(k)
        start_list.append(s)
        known_list.append(r.num_tokens + len(drafts))
        drafts_list.append(len(drafts))
        if k == 1:
            tokens.append(r.get_token_id(s))
        else:
            tokens.extend(r.get_token_ids(s, s + k - len(drafts)))
            tokens.extend(drafts)
        rows.append(block_ids[r.request_id] if num_groups > 1 else (block_ids[r.request_id],))
    q_lens = np.array(q_list, np.int32)
    starts = np.array(start_list, np.int32)
    kv_lens = starts + q_lens
    cu_q_lens = np.zeros(n + 1, np.int32)
    np.cumsum(q_lens, out=cu_q_lens[1:])
    total = int(cu_q_lens[-1])
    token_ids = np.array(tokens, dtype=np.int32)
    positions = (np.arange(total, dtype=np.int32) - np.repeat(cu_q_lens[:-1], q_lens)
                 + np.repeat(starts, q_lens)).astype(np.int32)
    seq_of_token = np.repeat(np.arange(n), q_lens)
    width = max(max(len(group_rows) for row in rows for group_rows in row), min_width, 1)
    tables_slots = [_table_and_slots([row[g] for row in rows], width, seq_of_token, positions, block_sizes[g],
                                     allow_missing_blocks) for g in range(num_groups)]
    tables, slots = zip(*tables_slots, strict=True)
    block_tables = tables[0] if num_groups == 1 else np.stack(tables)
    slot_mapping = slots[0] if num_groups == 1 else np.stack(slots)

    return StepPlan(
        request_ids=request_ids, token_ids=token_ids, positions=positions,
        cu_q_lens=cu_q_lens, kv_lens=kv_lens, block_tables=block_tables,
        slot_mapping=slot_mapping, emits_token=kv_lens == np.array(known_list, np.int32),
        preempted_request_ids=list(preempted_request_ids), num_decodes=num_decodes,
        block_copies=copies,
        num_drafts=np.array(drafts_list, np.int32) if draft_token_ids else None, image_segments=segments)


def _copies_array(block_copies: Sequence, num_pools: int) -> np.ndarray:
    """int32 `[C, 2]` of (src, dst) pairs; with several pools `[num_pools, C, 2]`, C the most of any pool, each
    pool's rows padded with (0, -1) (dst -1: dropped)."""
    if num_pools == 1:
        return np.array(block_copies, np.int32).reshape(-1, 2)
    rows = max((len(c) for c in block_copies), default=0)
    out = np.zeros((num_pools, rows, 2), np.int32)
    out[..., 1] = -1
    for p, pairs in enumerate(block_copies):
        if len(pairs):
            out[p, :len(pairs)] = pairs
    return out


def _table_and_slots(rows: list[Sequence[int]], width: int, seq_of_token: np.ndarray, positions: np.ndarray,
                     block_size: int, allow_missing_blocks: bool) -> tuple[np.ndarray, np.ndarray]:
    """One KV cache group's block table `[num_seqs, width]` (each row its blocks, padded with 0) and slot mapping
    `[num_tokens]` (-1 where a token has no block yet: only with `allow_missing_blocks`)."""
    n = len(rows)
    row_lens = np.fromiter(map(len, rows), np.int32, n)
    block_tables = np.zeros((n, width), np.int32)
    num_held = int(row_lens.sum())
    if num_held:
        flat = np.fromiter(itertools.chain.from_iterable(rows), np.int32, num_held)
        block_tables[np.arange(width) < row_lens[:, None]] = flat  # row-major fill of each prefix
    logical = positions // block_size
    has_block = logical < row_lens[seq_of_token]
    if not allow_missing_blocks and not has_block.all():
        raise ValueError("a scheduled token has no block")
    slot_mapping = block_tables[seq_of_token, np.minimum(logical, width - 1)] * block_size + positions % block_size
    return block_tables, np.where(has_block, slot_mapping, -1).astype(np.int32)


def device_pop_step(block_tables: np.ndarray, seq_lens: np.ndarray, active: np.ndarray,
                    lent_block_ids: np.ndarray, num_popped: int, block_size: int) -> tuple[np.ndarray, int]:
    """One step of the device's block pops, in numpy (mutates `block_tables` and `seq_lens` in place).

    Every active sequence whose length (tokens in the cache) is a multiple of `block_size` needs a new
    block for the token it is about to write: it pops the next lent block, in sequence order, into column
    `length // block_size`. Then every active sequence writes its token at slot
    `table[s, length // block_size] * block_size + length % block_size` and its length grows by one.

    Returns (slot_mapping int32 [num_seqs], -1 where inactive; the new number of popped blocks).
    Raises ValueError if the stack runs dry or a row has no column left (the host lent too little).
    """
    num_seqs, width = block_tables.shape
    slots = np.full((num_seqs,), -1, np.int32)
    for s in range(num_seqs):
        if not active[s]:
            continue
        length = int(seq_lens[s])
        col = length // block_size
        if col >= width:
            raise ValueError(f"seq {s}: its block table row of {width} columns is full")
        if length % block_size == 0:
            if num_popped >= len(lent_block_ids):
                raise ValueError("the lent block stack ran dry")
            block_tables[s, col] = lent_block_ids[num_popped]
            num_popped += 1
        slots[s] = block_tables[s, col] * block_size + length % block_size
        seq_lens[s] = length + 1
    return slots, num_popped


def simulate_device_pops(block_tables: np.ndarray, seq_lens: np.ndarray, lent_block_ids: np.ndarray,
                         num_active_steps: np.ndarray, block_size: int,
                         ) -> tuple[np.ndarray, np.ndarray, int]:
    """Host (numpy) mirror of a whole fused decode's block pops: the reconciliation contract.

    Starts from `seq_lens[s]` cached tokens (`FusedDecode.seq_lens`, i.e. `plan.kv_lens - 1`); sequence
    s is active for its first `num_active_steps[s]` steps (its `max_new_tokens`, or fewer if it stopped
    early); each step applies `device_pop_step`.

    Returns (block tables after the loop, slot_mapping int32 [num_steps, num_seqs] with -1 where inactive,
    number of blocks popped). Raises ValueError if the stack runs dry or a row has no column left.
    """
    tables = np.array(block_tables, dtype=np.int32, copy=True)
    lens = np.array(seq_lens, dtype=np.int64, copy=True)
    active_steps = np.asarray(num_active_steps)
    num_steps = int(active_steps.max()) if active_steps.size else 0
    slots = np.full((num_steps, tables.shape[0]), -1, np.int32)
    popped = 0
    for step in range(num_steps):
        slots[step], popped = device_pop_step(tables, lens, active_steps > step, lent_block_ids, popped,
                                              block_size)
    return tables, slots, popped


def lent_stacks(lent, num_groups: int) -> np.ndarray:
    """The lent blocks of `KVCacheManager.lend_blocks` as a fused decode's stack: int32 `[num_lent]` for one group,
    `[num_groups, num_lent]` for several, each group's padded with -1 (never popped) to the longest."""
    if num_groups == 1:
        return np.array(lent, np.int32)
    out = np.full((num_groups, max(map(len, lent), default=0)), -1, np.int32)
    for g, ids in enumerate(lent):
        out[g, :len(ids)] = ids
    return out


def claim_lent_blocks(plan: StepPlan, block_tables: np.ndarray, i: int, request_id: str, held, num_tokens: int,
                      claimed: list[set[int]], group_pools: Sequence[int] = (0,)):
    """The lent blocks sequence i of a fused decode adopts: those its row of the device's `block_tables` gained past
    the `held` blocks, up to the blocks its new length `num_tokens` needs (added to `claimed`, a set per block
    pool); with several KV cache groups (`group_pools`: each one's pool), per group (`held`, the tables and the
    result). Changes nothing else; RuntimeError if the device changed a block the host placed, kept a block that
    was not lent, or took one twice (checked before anything is applied)."""
    sizes = plan.fused.block_sizes
    if len(group_pools) == 1:
        return _claim(block_tables[i], plan.fused.lent_block_ids, request_id, held, -(-num_tokens // sizes[0]),
                      claimed[group_pools[0]])
    return tuple(_claim(block_tables[g, i], plan.fused.lent_block_ids[g], request_id, held[g],
                        -(-num_tokens // sizes[g]), claimed[p]) for g, p in enumerate(group_pools))


def _claim(row: np.ndarray, lent_block_ids: np.ndarray, request_id: str, held: Sequence[int], need: int,
           claimed: set[int]) -> list[int]:
    if row[:len(held)].tolist() != list(held):
        raise RuntimeError(f"request {request_id!r}: the device changed blocks the host had placed "
                           f"({row[:len(held)].tolist()} != {list(held)})")
    new_blocks = row[len(held):need].tolist()
    lent = set(lent_block_ids.tolist())
    bad = [b for b in new_blocks if b not in lent or b in claimed]
    if bad:
        raise RuntimeError(f"request {request_id!r}: table row holds blocks {bad} that were not lent or are claimed "
                           "twice")
    if len(new_blocks) != max(0, need - len(held)):
        raise RuntimeError(f"request {request_id!r}: table row too narrow for {need} blocks")
    claimed.update(new_blocks)
    return new_blocks


def unclaimed_lent_blocks(plan: StepPlan, claimed: list[set[int]], group_pools: Sequence[int] = (0,)):
    """A fused decode's lent blocks that no sequence claimed (`claim_lent_blocks`): back to their pools (per group
    where there are several)."""
    lent = plan.fused.lent_block_ids.tolist()
    if len(group_pools) == 1:
        return [b for b in lent if b not in claimed[group_pools[0]]]
    return tuple([b for b in ids if b >= 0 and b not in claimed[p]] for ids, p in zip(lent, group_pools,
                                                                                      strict=True))
