"""The engine's counters: `EngineStats` (a snapshot, `LLMEngine.stats()`) and their JSON-ready form."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagedjax.core.scheduler import SchedulerStats


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's counters; the scheduler's queues, prefix cache and memory are in
    `scheduler` (and its `memory`)."""

    steps: int  # step() calls
    fused_decode_calls: int  # of which ran several decode steps in one device call
    failed_steps: int  # steps whose device call raised (see `LLMEngine.step`)
    prompt_tokens: int  # prompt tokens of every request added
    generated_tokens: int
    prefill_tokens_computed: int  # prompt/recompute tokens actually run through the model
    elapsed_s: float  # time spent inside step()
    device_s: float  # of which in compiled device calls (dispatch + compute + read back)
    compile_s: float  # of which waiting for new programs to be traced and compiled (or loaded): the steps', a
    #                   draft model's and the image encoder's
    # Programs (the target's steps, a draft model's and the image encoder's, `pagedjax.runner.programs`) obtained:
    # compiled, or loaded from JAX's persistent compilation cache (`programs_loaded` of them); the warm-up's, the
    # background's and dropped ones included.
    compilations: int
    scheduler: SchedulerStats
    tensor_parallel_size: int = 1  # devices the model and its KV pool are sharded over
    kv_cache_bytes_per_device: int = 0  # the KV pool's bytes on each of those devices
    kv_dtype: str = ""  # the KV cache's dtype ("int8", "fp8": 8-bit pages with scales; see CacheConfig.kv_dtype)
    kv_bytes_per_token: int = 0  # KV bytes one cached token takes on each device in every KV cache group (its KV
    #                              heads, scales included)
    kv_bytes_per_block: int = 0  # KV bytes of one block on each device, whichever group holds it (the first pool's)
    kv_groups: tuple[str, ...] = ()  # the KV cache groups by name ("full", "window-128", "state": `KVCacheLayout`)
    kv_group_block_bytes: tuple[int, ...] = ()  # bytes of one block of each group's pool on each device
    programs_loaded: int = 0  # of `compilations`, loaded from the persistent compilation cache instead of compiled
    compiled_programs: int = 0  # held now: at most LLMEngine's max_compiled_programs (the least recently used go)
    stand_in_steps: int = 0  # steps run on a bigger compiled program while their own compiled in the background
    warmup_s: float = 0.0  # `LLMEngine.warmup`'s time (not in elapsed_s)
    # Speculative decoding (`LLMEngine(speculative_config=...)`): sequence-steps that verified proposals, the
    # proposals verified, those accepted, and the seconds the proposer took (in elapsed_s; a draft model's or an MTP
    # head's compiles included).
    spec_sequences: int = 0
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_proposer_s: float = 0.0
    # Images (a vision-language model): images encoded (each time: an image dropped from the encoder cache and
    # needed again is encoded again), and the seconds that took (inside elapsed_s, results on device; the
    # encoder's compiles are in compile_s instead).
    images_encoded: int = 0
    encoder_s: float = 0.0
    # Sparse attention (DeepSeek V3.2): query rows, summed over the sparse layers, whose indexer's top-k cut-off
    # fell between equal scores, where pagedjax's tie rule (the lower position) chose what the scores did not
    # (`PagedKVCache.indexer_ties`; transformers leaves such ties unordered). The engine logs a warning at the first.
    indexer_ties: int = 0
    # The host tier (`CacheConfig.kv_host_memory_bytes`; block counts and hits in `scheduler`): bytes copied out to
    # it and in from it, and the seconds those moves took (inside elapsed_s).
    host_bytes_stored: int = 0
    host_bytes_loaded: int = 0
    host_move_s: float = 0.0
    # The disk tier under it (`CacheConfig.kv_disk_dir`; block counts in `scheduler`): bytes of the files read and
    # written, and the seconds that took (reads while scheduling, writes inside host_move_s).
    disk_bytes_read: int = 0
    disk_bytes_written: int = 0
    disk_s: float = 0.0
    # A DataParallelEngine's stats combine its replicas': each replica's own, and the requests each was given.
    replicas: tuple[EngineStats, ...] = ()
    requests_per_replica: tuple[int, ...] = ()

    @property
    def programs_compiled(self) -> int:
        """Of `compilations`, the programs XLA compiled (not found in the persistent compilation cache)."""
        return self.compilations - self.programs_loaded

    @property
    def step_s(self) -> float:
        """Seconds inside step() not spent waiting for compiles: what the steps themselves took."""
        return self.elapsed_s - self.compile_s

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of stepping, compilation excluded."""
        return self.generated_tokens / self.step_s if self.step_s > 0 else 0.0

    @property
    def kv_group_bytes(self) -> tuple[int, ...]:
        """KV bytes the requests hold in each KV cache group now (on each device)."""
        return tuple(n * b for n, b in zip(self.scheduler.memory.group_blocks, self.kv_group_block_bytes, strict=True))

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted proposals per proposal verified."""
        return self.spec_accepted_tokens / self.spec_proposed_tokens if self.spec_proposed_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Proposals accepted per sequence per verifying step (it emits one more token than that)."""
        return self.spec_accepted_tokens / self.spec_sequences if self.spec_sequences else 0.0


def stats_dict(s: EngineStats) -> dict:
    """`EngineStats` as nested plain data (JSON-ready), derived rates included (replicas' too)."""
    d = dataclasses.asdict(s)
    d["tokens_per_s"] = s.tokens_per_s
    d["kv_group_bytes"] = list(s.kv_group_bytes)
    d["step_s"] = s.step_s
    d["programs_compiled"] = s.programs_compiled
    d["spec_acceptance_rate"] = s.spec_acceptance_rate
    d["spec_mean_accepted_length"] = s.spec_mean_accepted_length
    d["scheduler"]["prefix_cache_hit_rate"] = s.scheduler.prefix_cache_hit_rate
    d["scheduler"]["memory"]["waste_fraction"] = s.scheduler.memory.waste_fraction
    d["replicas"] = [stats_dict(r) for r in s.replicas]
    return d
