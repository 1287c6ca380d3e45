"""Speculative decoding by a multi-token-prediction head (`SpeculativeConfig(method="mtp")`): after each step the
head (`pagedjax.spec_decode.mtp_head`) runs over the final hidden states the target just computed, and chains its
greedy guesses into each speculating request's proposals.

    load_mtp_head(config, target_config)   ->  the head (a folder or a module, checked against the target), or None
    MTPProposer(head, target_runner, ...)  ->  a `Proposer`: one device call per step, the target's hidden states
                                               never leave the device (`ModelRunner(keep_hidden=True)`)

What the head computes at position p needs the target's final hidden state f_p and the token t_{p+1}, so it can run
only where the target has run: after each step, at every position the step computed and kept (accepted) for a
request that speculates (prefill chunks too, so that a request's head KV covers its prompt; a verifying step's
rejected positions are not kept, and its accepted ones are computed again with the target's hidden states, over
the chain's guesses). A request asked for proposals gets them from its last kept position, N - 1, where the head's
logits guess t_{N+1} = d_1; then d_j at position N - 1 + j, with the head's own output h as the feature, guesses
d_{j+1} (slots of the blocks `Scheduler.reserve_draft_slots` gave it). All of it is one jitted call per step: the
ragged rows, then k - 1 one-token steps (a `lax.scan`) for all asked requests together.

The head's KV: one layer's page arrays of the target's `num_blocks` x `block_size`, addressed by the target's block
ids (as a draft model's), so the KV pool is sized with the head's bytes per block included. An engine with a head
runs no fused decode (`LLMEngine.step`: its steps keep no hidden states), and its prefix-cache hits end a block early
(`KVCacheManager.drop_last_hit_block`: the head's KV at a hit's last position was made with the next token of the
request that cached it). A block copied on write for a fork keeps whatever head KV its slots held: a guess made
over it may be worse, never a token different, because every proposal is verified by the target
(`pagedjax.core.step_result`: the output is exactly the non-speculative one). Proposals are greedy, so accepting
one when the target's own draw equals it is rejection sampling with a one-hot proposal distribution
(`pagedjax.spec_decode.draft_model` says why): seeded sampling stays exact too.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pagedjax.config import CacheConfig, ModelConfig, SpeculativeConfig
from pagedjax.core.request import RequestStatus
from pagedjax.device.attention import AttentionMetadata
from pagedjax.device.kv_cache import KVCache, init_kv_cache
from pagedjax.model.api import PagedKVCache
from pagedjax.runner.inputs import bucket, pad_last, pad_rows, pad_table
from pagedjax.runner.programs import Job, ProgramCache, abstract_value
from pagedjax.runner.runner import ModelRunner
from pagedjax.spec_decode.draft_kv import draft_plan
from pagedjax.spec_decode.mtp_head import MTPHead, head_config, load_head
from pagedjax.spec_decode.proposer import ProposalAsk, StepSeen
from pagedjax.spec_decode.speculator import speculates

logger = logging.getLogger(__name__)


def load_mtp_head(config: SpeculativeConfig | None, target: ModelConfig | None, parallel_config) -> MTPHead | None:
    """The MTP head of `config` (None unless its method is "mtp"): `config.draft_model` a head's folder
    (`save_head`'s) or an `MTPHead`, for a built-in target of config `target`. ValueError for a head of another
    target's shape, a target that is not a built-in model, no head given, or tensor parallelism."""
    if config is None or config.method != "mtp":
        return None
    if parallel_config is not None:
        raise ValueError("SpeculativeConfig(method='mtp') does not run under a parallel_config yet")
    if target is None:
        raise ValueError("SpeculativeConfig(method='mtp') needs a built-in model (its ModelConfig): the head shares "
                         "its embedding and LM head")
    head = config.draft_model
    if head is None:
        raise ValueError("SpeculativeConfig(method='mtp') needs its head: draft_model= a head's folder or an "
                         "MTPHead (LLMEngine.from_pretrained and --model find a model folder's own mtp/)")
    if isinstance(head, str | os.PathLike):
        return load_head(head, target)
    if not isinstance(head, MTPHead):
        raise TypeError(f"SpeculativeConfig(method='mtp').draft_model: a head's folder or an MTPHead, got "
                        f"{type(head).__name__}")
    if head.config != head_config(target):
        raise ValueError(f"SpeculativeConfig(method='mtp'): the MTPHead was built for another target "
                         f"({head.config}), this model's head is {head_config(target)}")
    return head


class HeadRows(NamedTuple):
    """One step's head call, on the host: the ragged rows (positions the target computed and kept, one sequence
    per request) and the chain of the asked ones. Padded to `bucket` sizes by `pad`."""

    rows: np.ndarray  # i32[R]: each row's index among the target step's tokens (its hidden state)
    token_ids: np.ndarray  # i32[R]: t_{p+1}
    positions: np.ndarray  # i32[R]: p
    slot_mapping: np.ndarray  # i32[R]
    cu_q_lens: np.ndarray  # i32[S + 1]
    kv_lens: np.ndarray  # i32[S]
    block_tables: np.ndarray  # i32[S, B]
    chain_slots: np.ndarray  # i32[k - 1, S]: where chain step j writes (-1: the sequence makes no guess j + 1)


def head_rows(step: StepSeen, asks: list[ProposalAsk], k: int, block_size: int) -> tuple[HeadRows | None, list[int]]:
    """The head's rows after `step` (see the module's docstring; None: no row) and, for each ask, its sequence among
    them (-1: no proposal: the step did not compute its last position with a kept hidden state). The ragged part is
    laid out as a draft model's catch-up is (`draft_kv.draft_plan`: tokens t_{p+1} at positions p)."""
    plan, scheduler = step.plan, step.scheduler
    asked = {ask.request.request_id: ask for ask in asks}
    cu = plan.cu_q_lens.tolist()
    seqs, rows = [], []  # (ask, first position, tokens) per sequence; each row's index among the step's tokens
    for i, rid in enumerate(plan.request_ids):
        request = scheduler.requests.get(rid)
        if request is None or request.status != RequestStatus.RUNNING or not speculates(request):
            continue
        start = int(plan.kv_lens[i]) - (cu[i + 1] - cu[i])  # the step's first position of this request
        end = min(int(plan.kv_lens[i]), request.num_computed_tokens)  # kept: accepted proposals only
        if end <= start:
            continue
        ask = asked.get(rid) or ProposalAsk(request, 0, tuple(scheduler.draft_blocks(request)[0]))
        seqs.append((ask, start, request.get_token_ids(start + 1, end + 1)))
        rows.append(np.arange(cu[i], cu[i] + end - start, dtype=np.int32))
    if not seqs:
        return None, [-1] * len(asks)
    head = draft_plan(seqs, block_size)
    chain = np.full((max(k - 1, 0), len(seqs)), -1, np.int32)
    where = {rid: s for s, rid in enumerate(head.request_ids)}
    sequence_of = []
    for ask in asks:
        s = where.get(ask.request.request_id, -1)
        if s >= 0 and head.kv_lens[s] != ask.request.num_computed_tokens:
            s = -1  # its last position was not computed by this step
        sequence_of.append(s)
        if s >= 0 and ask.cap > 1:  # guess j + 1 is made at position N - 1 + j
            pos = head.kv_lens[s] - 1 + np.arange(1, ask.cap)
            chain[:ask.cap - 1, s] = head.block_tables[s, pos // block_size] * block_size + pos % block_size
    return HeadRows(np.concatenate(rows), head.token_ids, head.positions, head.slot_mapping, head.cu_q_lens,
                    head.kv_lens, head.block_tables, chain), sequence_of


def pad(x: HeadRows, num_rows: int, num_seqs: int, width: int) -> HeadRows:
    """`x` padded to `num_rows` rows, `num_seqs` sequences and tables `width` blocks wide: padding rows write
    nowhere (slot -1), padding sequences have no rows."""
    return HeadRows(pad_rows(x.rows, num_rows, 0), pad_rows(x.token_ids, num_rows, 0),
                    pad_rows(x.positions, num_rows, 0), pad_rows(x.slot_mapping, num_rows, -1),
                    pad_rows(x.cu_q_lens, num_seqs + 1, x.cu_q_lens[-1]), pad_rows(x.kv_lens, num_seqs, 0),
                    pad_table(x.block_tables, num_seqs, width),
                    pad_last(x.chain_slots, num_seqs, -1))


def _head_step(head_graphdef, head_params, target_graphdef, target_params, kv: KVCache, hidden, x: HeadRows, *,
               backend: str, block_size: int) -> tuple[jax.Array, KVCache]:
    """The head's ragged rows (`hidden` `[T, hidden]`: the target step's hidden states, of which `x.rows` are the
    rows' features), then its chain: returns (guesses i32[S, k], the head's KV). The first column is each sequence's
    guess at its last row; column j the guess made at chain step j (meaningful where it wrote)."""
    head: MTPHead = nnx.merge(head_graphdef, head_params)
    target = nnx.merge(target_graphdef, target_params)
    spec = head.spec
    meta = AttentionMetadata(x.slot_mapping, x.block_tables, x.kv_lens, x.cu_q_lens)
    cache = PagedKVCache(kv.layers, meta, backend=backend, spec=spec, block_sizes=(block_size,))
    h, cache = head(target.embed(x.token_ids), hidden[x.rows], x.positions, cache)
    last_rows = jnp.maximum(x.cu_q_lens[1:] - 1, 0)  # [S]: each sequence's last row (its first guess)
    h = h[last_rows]  # [S, hidden]
    guess = jnp.argmax(head.logits(target, h), axis=-1).astype(jnp.int32)
    num_seqs = x.kv_lens.shape[0]
    last = x.positions[last_rows]  # [S]: N - 1
    cu_q_lens = jnp.arange(num_seqs + 1, dtype=jnp.int32)

    def chain_step(carry, step):  # token d_{j+1} at position N + j, one per sequence (a loop: k is up to 64)
        h, guess, layers = carry
        slots, j = step
        pos = last + 1 + j
        meta = AttentionMetadata(slots, x.block_tables, jnp.where(slots >= 0, pos + 1, 1), cu_q_lens)
        cache = PagedKVCache(layers, meta, backend=backend, decode_only=True, spec=spec, block_sizes=(block_size,))
        h, cache = head(target.embed(guess), h, pos, cache)
        guess = jnp.argmax(head.logits(target, h), axis=-1).astype(jnp.int32)
        return (h, guess, cache.layers), guess

    steps = x.chain_slots.shape[0]
    (_, _, layers), chained = jax.lax.scan(chain_step, (h, guess, cache.layers),
                                           (x.chain_slots, jnp.arange(steps, dtype=jnp.int32)))
    return jnp.concatenate([guess[:, None], chained.T], axis=1), KVCache(layers)


class HeadShape(NamedTuple):
    """A head call's program: its rows (the target step's tokens, whose hidden states it reads), its sequences and
    its block tables' width, each a bucket."""

    rows: int
    seqs: int
    width: int


def _compile(jitted, args: tuple, static: dict):
    return jitted.lower(*args, **static).compile()


class MTPProposer:
    """The MTP head's `Proposer` (see the module's docstring). A head call that raises costs the step its proposals
    (logged, counted in `num_failed_calls`; the head's KV is made again if the call took it).

    Its programs, one per `HeadShape`, are held in a `ProgramCache` of `max_programs`: with `compile_in_background`
    (a server's choice) a call whose program is not compiled yet runs on the warm-up's program (`warmup`), padded,
    or without one makes no proposals that step, while its own compiles in the background (proposals are optional:
    the tokens are the same), instead of stalling every stream for the compile; otherwise each compiles when first
    needed, on the engine's thread."""

    def __init__(self, head: MTPHead, target: ModelRunner, num_blocks: int, cache_config: CacheConfig, k: int, *,
                 max_programs: int = 64, compile_in_background: bool = False):
        if not target.keep_hidden:
            raise ValueError("MTPProposer: the target's runner must keep its hidden states (keep_hidden=True)")
        self.k = k
        self.block_size = cache_config.block_size
        self.num_blocks = num_blocks
        self.kv_dtype = cache_config.kv_array_dtype(head.spec)
        self.head_graphdef, self.head_params = nnx.split(head)
        self.spec = head.spec
        self.target = target
        self.kv: KVCache | None = self._new_kv()
        self.num_failed_calls = 0
        head_graphdef, target_graphdef = self.head_graphdef, target.graphdef
        # Parameters pass as flat lists of arrays (as the runner's steps take them): walking an nnx.State per call
        # costs more than this head's whole step on a small model.
        self._head_leaves, head_treedef = jax.tree.flatten(self.head_params)
        target_treedef = jax.tree.structure(target.params)

        def call(head_leaves, target_leaves, kv, hidden, x, *, backend, block_size):
            return _head_step(head_graphdef, jax.tree.unflatten(head_treedef, head_leaves), target_graphdef,
                              jax.tree.unflatten(target_treedef, target_leaves), kv, hidden, x,
                              backend=backend, block_size=block_size)

        # The head's KV is donated (updated in place). Its rows are padded to the target step's tokens (at most those
        # of its rejected proposals more than it keeps) and its sequences and table width to powers of two, as the
        # target's steps are: a program per (step bucket, sequences, width) (one per row bucket too made a short
        # request compile twice as many, at about 1.4 s each on this CPU).
        self._call = jax.jit(call, donate_argnums=(2,), static_argnames=("backend", "block_size"))
        self.programs = ProgramCache(max_programs, background=compile_in_background)
        self.widest: HeadShape | None = None  # the warm-up's program (`warmup`): a stand-in for every narrower call

    def _new_kv(self) -> KVCache:
        return init_kv_cache(self.spec.kv_layout, self.num_blocks, self.block_size, self.kv_dtype)

    def _prepare(self, shape: HeadShape) -> Job:
        """The compile job of `shape`'s program (abstract arguments only: it may run on the compile thread)."""
        i32 = lambda *dims: jax.ShapeDtypeStruct(dims, jnp.int32)
        r, n = shape.rows, shape.seqs
        x = HeadRows(i32(r), i32(r), i32(r), i32(r), i32(n + 1), i32(n), i32(n, shape.width),
                     i32(max(self.k - 1, 0), n))
        hidden = jax.ShapeDtypeStruct((r, self.spec.hidden_size), jnp.dtype(self.spec.dtype))
        args = jax.tree.map(abstract_value, (self._head_leaves, self.target.param_leaves, self.kv))
        return functools.partial(_compile, self._call, (*args, hidden, x),
                                 dict(backend=self.target.backend, block_size=self.block_size))

    def widest_shape(self, max_rows: int, max_seqs: int, max_blocks: int) -> HeadShape:
        """The head's program at the largest buckets its calls reach: `max_rows` (the target's widest step's
        tokens), `max_seqs` sequences, tables of `max_blocks` target blocks (the head's chain writes up to k - 1
        positions past a sequence's tokens: a block more per `block_size` of them)."""
        chain_blocks = -(-max(self.k - 1, 0) // self.block_size)
        return HeadShape(bucket(max_rows), bucket(max_seqs), bucket(max_blocks + chain_blocks, 2))

    def warmup(self, max_rows: int, max_seqs: int, max_blocks: int) -> None:
        """Compile and hold (for good) the head's `widest_shape` program: a call whose own program is not compiled
        yet runs on it, padded (`LLMEngine.warmup`), instead of making no proposals while its own compiles in the
        background (or, without background compiles, it still compiles its own first)."""
        shape = self.widest_shape(max_rows, max_seqs, max_blocks)
        self.programs.compile(shape, functools.partial(self._prepare, shape), pinned=True, note="MTP head")
        self.widest = shape

    def start_warmup(self, max_rows: int, max_seqs: int, max_blocks: int):
        """`warmup`'s program compiled in the background (`LLMEngine.start_warmup`); its future of seconds."""
        shape = self.widest_shape(max_rows, max_seqs, max_blocks)
        self.widest = shape
        return self.programs.warm_in_background([(shape, functools.partial(self._prepare, shape))])

    def _stand_in(self, shape: HeadShape):
        """(the warm-up's shape, its program) when that program is held and at least as wide as `shape` in every
        bucket; else None."""
        held = None if self.widest is None else self.programs.executables.get(self.widest)
        if held is None or any(a > b for a, b in zip(shape, self.widest, strict=True)):
            return None
        return self.widest, held

    def forget(self, live_request_ids) -> None:
        """Nothing per request: what the head's KV covers follows from each step (see the module's docstring)."""

    def close(self) -> None:
        """Cancel the head's background compiles still waiting (`LLMEngine.close`)."""
        self.programs.close()

    def sleep(self) -> int:
        """Release the head's KV arrays (with the target's: `LLMEngine.sleep`); bytes freed (0 if asleep)."""
        if self.kv is None:
            return 0
        freed = self.kv.nbytes
        for a in jax.tree.leaves(self.kv):
            a.delete()
        self.kv = None
        return freed

    def wake(self) -> None:
        if self.kv is None:
            self.kv = self._new_kv()

    def propose(self, asks: list[ProposalAsk], step: StepSeen | None) -> list[list[int]]:
        hidden = None if step is None else step.result.hidden
        if hidden is None or self.kv is None:  # a fused decode (no hidden states kept), or asleep
            return [[] for _ in asks]
        x, sequence_of = head_rows(step, asks, self.k, self.block_size)
        if x is None:
            return [[] for _ in asks]
        shape = HeadShape(hidden.shape[0], bucket(len(x.kv_lens)), bucket(x.block_tables.shape[1], 2))
        x = pad(x, *shape)
        try:
            program = self.programs.lookup_optional(shape, functools.partial(self._prepare, shape))
            if program is None:  # compiling in the background: the warm-up's program, padded, or no proposals
                stand_in = self._stand_in(shape)
                if stand_in is None:
                    return [[] for _ in asks]
                shape, program = stand_in
                x = pad(x, *shape)
                hidden = jnp.pad(hidden, ((0, shape.rows - hidden.shape[0]), (0, 0)))
            guesses, self.kv = program(self._head_leaves, self.target.param_leaves, self.kv, hidden, x)
            guesses = np.asarray(guesses)
        except Exception as exc:  # the proposals only: the target's step goes on without them
            self.num_failed_calls += 1
            if any(a.is_deleted() for a in jax.tree.leaves(self.kv)):
                self.kv = self._new_kv()
            logger.error("MTP head call failed, no proposals this step: %s: %s", type(exc).__name__, exc,
                         exc_info=exc)
            return [[] for _ in asks]
        return [[] if s < 0 else guesses[s, :ask.cap].tolist() for ask, s in zip(asks, sequence_of, strict=True)]
