"""`GET /metrics`: the server's and the engine's state in Prometheus' text format (`prometheus_client`).

Engine state is read at scrape time from the async engine's latest statistics (taken by the engine thread after
every step and command), so a scrape never touches the engine itself:

  pagedjax_num_requests_running / _waiting        the scheduler's queues
  pagedjax_num_requests_pending                   requests in the server (added, not yet finished)
  pagedjax_kv_blocks_used / _free / _cached / _total   the KV pool (cached: idle, reusable by a prefix hit)
  pagedjax_kv_cache_usage                         used blocks / all blocks
  pagedjax_prefix_cache_hit_rate                  prompt tokens found in the prefix cache / looked up
  pagedjax_compiled_programs                      compiled step programs held (at most --max-compiled-programs)
  pagedjax_prefix_cache_queries_total / _hits_total
  pagedjax_preemptions_total, pagedjax_prompt_tokens_total, pagedjax_generation_tokens_total,
  pagedjax_engine_steps_total, pagedjax_engine_failed_steps_total, pagedjax_compilations_total,
  pagedjax_programs_loaded_total                  of the compilations, programs loaded from the compilation cache
  pagedjax_stand_in_steps_total                   steps run on a bigger compiled program while their own compiled
  pagedjax_engine_step_seconds                    histogram: the engine thread's `step()` calls (a chunk gap of a
                                                  stream is at least the step that ended it)

Measured by the server per request (histograms):

  pagedjax_time_to_first_token_seconds            arrival to the first generated token
  pagedjax_inter_token_latency_seconds            between consecutive tokens (a step that brings k tokens
                                                  counts k intervals of dt / k)
  pagedjax_e2e_request_latency_seconds            arrival to the last token
  pagedjax_request_success_total{finish_reason}   finished requests (stop, length, error, abort)

Every server has its own registry, so several servers live in one process (tests) without clashes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from pagedjax.engine import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
STEP_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 10.0)


class DurationHistogram:
    """Durations counted in `STEP_BUCKETS`, observed by one thread and read by another (the engine thread's steps,
    read at scrape time without a registry, so that the engine side needs no server)."""

    def __init__(self, edges: tuple[float, ...] = STEP_BUCKETS):
        self.edges = edges
        self._counts = [0] * (len(edges) + 1)  # the last: over every edge
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        i = next((i for i, edge in enumerate(self.edges) if seconds <= edge), len(self.edges))
        with self._lock:
            self._counts[i] += 1
            self._sum += seconds

    def cumulative(self) -> tuple[list[tuple[str, int]], float]:
        """([(upper edge, count of durations <= it), ..., ("+Inf", all)], sum of the durations)."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        running, buckets = 0, []
        for edge, count in zip([*map(str, self.edges), "+Inf"], counts, strict=True):
            running += count
            buckets.append((edge, running))
        return buckets, total


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats], pending: Callable[[], int], steps: DurationHistogram):
        self._stats = stats
        self._pending = pending
        self._steps = steps

    def collect(self):
        s = self._stats()
        sched, mem = s.scheduler, s.scheduler.memory
        gauges = {
            "num_requests_running": ("Requests in the running batch.", sched.num_running),
            "num_requests_waiting": ("Requests waiting for a place in the running batch.", sched.num_waiting),
            "num_requests_pending": ("Requests in the server: added and not finished.", self._pending()),
            "kv_blocks_used": ("KV blocks held by requests.", mem.num_used_blocks),
            "kv_blocks_free": ("Idle KV blocks without cached content.", mem.num_free_blocks),
            "kv_blocks_cached": ("Idle KV blocks still holding a cached prefix.", mem.num_cached_blocks),
            "kv_blocks_total": ("KV blocks in the pool.", mem.num_blocks),
            "kv_cache_usage": ("Used KV blocks over all KV blocks.", mem.block_usage),
            "prefix_cache_hit_rate": ("Prompt tokens found in the prefix cache over those looked up.",
                                      sched.prefix_cache_hit_rate),
            "compiled_programs": ("Compiled step programs held (the least recently used go past the limit).",
                                  s.compiled_programs),
            "spec_decode_mean_accepted_length": ("Speculative proposals accepted per sequence per verifying step.",
                                                 s.spec_mean_accepted_length),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"pagedjax_{name}", doc, value=value)
        # Per KV cache group (`pagedjax.config.kv_layout`: one for a model of one kind), labelled by index and name.
        group_blocks = GaugeMetricFamily("pagedjax_kv_group_blocks_used", "KV blocks held by requests, per KV cache "
                                         "group.", labels=["group", "kind"])
        group_bytes = GaugeMetricFamily("pagedjax_kv_group_bytes_used", "KV bytes held by requests on each device, "
                                        "per KV cache group.", labels=["group", "kind"])
        for g, (name, blocks, nbytes) in enumerate(zip(s.kv_groups, mem.group_blocks, s.kv_group_bytes,
                                                       strict=True)):
            group_blocks.add_metric([str(g), name], blocks)
            group_bytes.add_metric([str(g), name], nbytes)
        yield group_blocks
        yield group_bytes
        counters = {
            "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.", sched.prefix_cache_queries),
            "prefix_cache_hits": ("Prompt tokens found in the prefix cache.", sched.prefix_cache_hits),
            "prefix_cache_host_hits": ("Prefix-hit tokens loaded from the host tier.", sched.host_hit_tokens),
            "kv_host_blocks_stored": ("KV blocks the device pool evicted into the host tier.",
                                      sched.host_blocks_stored),
            "kv_host_blocks_loaded": ("KV blocks loaded from the host tier for prefix hits.",
                                      sched.host_blocks_loaded),
            "kv_host_bytes_stored": ("Bytes copied out to the host tier.", s.host_bytes_stored),
            "kv_host_bytes_loaded": ("Bytes copied in from the host tier.", s.host_bytes_loaded),
            "kv_host_move_seconds": ("Seconds the host tier's moves took.", s.host_move_s),
            "kv_disk_blocks_read": ("KV blocks read from the disk tier's files into the host tier.",
                                    sched.disk_blocks_read),
            "kv_disk_blocks_written": ("KV blocks written to the disk tier's files (each the host tier stores).",
                                       sched.disk_blocks_written),
            "kv_disk_files_bad": ("Disk tier files found corrupt, truncated or foreign (removed, a miss).",
                                  sched.disk_files_bad),
            "kv_disk_bytes_read": ("Bytes read from the disk tier.", s.disk_bytes_read),
            "kv_disk_bytes_written": ("Bytes written to the disk tier.", s.disk_bytes_written),
            "kv_disk_seconds": ("Seconds the disk tier's reads and writes took.", s.disk_s),
            "preemptions": ("Requests preempted for lack of KV blocks.", sched.num_preemptions),
            "prompt_tokens": ("Prompt tokens of every request added.", s.prompt_tokens),
            "generation_tokens": ("Tokens generated.", s.generated_tokens),
            "engine_steps": ("Engine steps.", s.steps),
            "engine_failed_steps": ("Engine steps whose device call raised.", s.failed_steps),
            "compilations": ("Step programs obtained: compiled, or loaded from the compilation cache.", s.compilations),
            "programs_loaded": ("Step programs loaded from the persistent compilation cache instead of compiled.",
                                s.programs_loaded),
            "stand_in_steps": ("Steps run on a bigger compiled program while their own compiled in the background.",
                               s.stand_in_steps),
            "spec_decode_num_draft_tokens": ("Speculative proposals verified.", s.spec_proposed_tokens),
            "spec_decode_num_accepted_tokens": ("Speculative proposals accepted.", s.spec_accepted_tokens),
            "spec_decode_proposer_seconds": ("Seconds the speculative proposer took.", s.spec_proposer_s),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"pagedjax_{name}", doc, value=value)
        buckets, total = self._steps.cumulative()
        yield HistogramMetricFamily("pagedjax_engine_step_seconds", "The engine thread's steps.", buckets=buckets,
                                    sum_value=total)


class ServerMetrics:
    """The registry of one server: engine gauges read at scrape time, and per-request histograms."""

    def __init__(self, stats: Callable[[], EngineStats], pending: Callable[[], int], steps: DurationHistogram):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats, pending, steps))
        self.ttft = Histogram("pagedjax_time_to_first_token_seconds", "Time to the first generated token.",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("pagedjax_inter_token_latency_seconds", "Time between consecutive generated tokens.",
                             buckets=ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("pagedjax_e2e_request_latency_seconds", "Time from arrival to the last token.",
                             buckets=E2E_BUCKETS, registry=self.registry)
        self.finished = Counter("pagedjax_request_success", "Finished requests by finish reason.",
                                ["finish_reason"], registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self) -> RequestTimer:
        return RequestTimer(self)


class RequestTimer:
    """One request's token timings, fed with its cumulative token count at every output."""

    def __init__(self, metrics: ServerMetrics):
        self._metrics = metrics
        self.arrival = time.perf_counter()
        self._last: float | None = None  # when the previous tokens arrived
        self._tokens = 0

    def tokens(self, total: int) -> None:
        """The request now has `total` generated tokens."""
        new = total - self._tokens
        if new <= 0:
            return
        now = time.perf_counter()
        if self._last is None:  # tokens that come with the first one have no interval of their own
            self._metrics.ttft.observe(now - self.arrival)
        else:
            gap = (now - self._last) / new
            for _ in range(new):
                self._metrics.itl.observe(gap)
        self._last = now
        self._tokens = total

    def finish(self, reason: str | None) -> None:
        self._metrics.e2e.observe(time.perf_counter() - self.arrival)
        self._metrics.finished.labels(finish_reason=reason or "abort").inc()
