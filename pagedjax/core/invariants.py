"""The scheduler's invariants as one check, for tests and soak runs (O(num_blocks + held blocks)).

Plain Python, no JAX.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from pagedjax.core.encoder_cache import EncoderCacheManager
from pagedjax.core.kv_cache_manager import RELEASED, KVCacheManager, cdiv
from pagedjax.core.request import Request, RequestStatus


def check_scheduler_invariants(kv: KVCacheManager, *, running: Sequence[Request], waiting: Iterable[Request],
                               requests: Mapping[str, Request], max_num_seqs: int,
                               encoder_cache: EncoderCacheManager | None = None, mid_step: bool = False) -> None:
    """Raise RuntimeError naming the first broken invariant (O(num_blocks + held blocks); for tests and
    soak runs): each request is in exactly one queue; waiting ones hold nothing; between steps a running
    request holds exactly `cdiv(num_computed_tokens, block_size)` blocks in each KV cache group (of the group's
    block size), or those its pending proposals need (`mid_step`: at least); every
    block's ref_cnt is the number of requests holding it (+1 while lent), so none is lost or doubly
    owned; a block shared by two requests holds the same computed tokens for both (full, unless they are
    forks of one another sharing their partial last block); the encoder cache holds at most its budget of image
    features, and only running requests need any. The scheduler's state: its KV cache manager, queues, request
    table, `max_num_seqs` and encoder cache (`Scheduler.check_invariants`)."""
    waiting = list(waiting)

    def require(ok: bool, what: str) -> None:
        if not ok:
            raise RuntimeError(f"scheduler invariant violated: {what}")

    for pool, tier in zip(kv.pools, kv.tiers, strict=True):
        pool.check_invariants()
        require(pool.num_free + pool.num_used + pool.num_cached == pool.num_blocks, "block counts")
        if tier is not None:
            tier.check_invariants()
    running_ids = [r.request_id for r in running]
    waiting_ids = [r.request_id for r in waiting]
    require(len(set(running_ids)) == len(running_ids) and not set(running_ids) & set(waiting_ids),
            "a request is queued twice")
    require(set(running_ids) | set(waiting_ids) == set(requests), "queues and the request table differ")
    require(len(running) <= max_num_seqs, "more running than max_num_seqs")
    for r in waiting:
        require(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), f"{r.request_id} waits as "
                f"{r.status}")
        require(r.num_computed_tokens == 0 and not kv.holds(r.request_id),
                f"waiting {r.request_id} holds KV")
    holders = kv.holders()
    require(set(holders) <= set(running_ids), "a request that is not running holds blocks")
    if encoder_cache is not None:  # image features: within budget, needed only by running requests
        try:
            encoder_cache.check(set(running_ids))
        except AssertionError as e:
            require(False, f"encoder cache: {e}")
    for r in running:
        require(r.status is RequestStatus.RUNNING, f"{r.request_id} runs as {r.status}")
        for held, bs in zip(kv.per_group(kv.num_held_blocks(r.request_id)), kv.group_block_sizes, strict=True):
            need = cdiv(r.num_computed_tokens, bs)
            most = cdiv(r.num_tokens + len(r.draft_token_ids), bs) if r.draft_token_ids else need  # proposals'
            require(held >= need if mid_step else need <= held <= most,
                    f"{r.request_id} holds {held} blocks of {bs} tokens for {r.num_computed_tokens} tokens")
    # Per KV cache group (`kv.per_group`: one entry per group). Block ids are their pool's own: counted per (pool,
    # block).
    count: dict[tuple[int, int], int] = {}
    for rid, blocks in holders.items():
        per_group = kv.per_group(blocks)
        released = kv.per_group(kv.num_released_blocks(rid))
        for group_blocks, num_released, p in zip(per_group, released, kv.group_pools, strict=True):
            live = [b for b in group_blocks if b != RELEASED]
            require(len(set(live)) == len(live), "a request holds a block twice")
            require(len(live) == len(group_blocks) - num_released, f"{rid} released a block that is not a "
                    "leading one")
            for b in live:
                count[p, b] = count.get((p, b), 0) + 1
    for p, (pool, lent) in enumerate(zip(kv.pools, kv.lent_per_pool(), strict=True)):
        require(not {b for q, b in count if q == p} & lent, "a lent block is held by a request")
        ref = pool.ref_counts()
        for b in range(pool.num_blocks):
            require(int(ref[b]) == count.get((p, b), 0) + (b in lent), f"pool {p} block {b}: ref_cnt {int(ref[b])}, "
                    f"{count.get((p, b), 0)} holders, lent {b in lent}")
    by_id = {r.request_id: r for r in running}
    seen: dict[tuple[int, int], tuple[int, ...]] = {}
    owner: dict[tuple[int, int], int] = {}  # (pool, block) -> the group holding it
    for rid, blocks in holders.items():
        r = by_id[rid]
        for g, (group_blocks, p, bs) in enumerate(zip(kv.per_group(blocks), kv.group_pools, kv.group_block_sizes,
                                                      strict=True)):
            for i, b in enumerate(group_blocks):
                if b == RELEASED:
                    continue
                require(owner.setdefault((p, b), g) == g, f"block {b} is held in two KV cache groups")
                if count[p, b] > 1:
                    # Shared blocks come from prefix hits (full) or forks (the last one may be partial: then
                    # every holder has the same computed tokens in it, and copies it before writing more).
                    filled = min(bs, r.num_computed_tokens - i * bs)
                    require(filled > 0, f"shared block {b} holds no computed token of {rid}")
                    tokens = tuple(r.get_token_ids(i * bs, i * bs + filled))
                    require(seen.setdefault((p, b), tokens) == tokens, f"shared block {b} differs between holders")
