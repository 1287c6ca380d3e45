"""LLMEngine: the scheduler (host) and the model runner (device) in one loop.

    engine = LLMEngine(model_config=ModelConfig(...), cache_config=CacheConfig(block_size=16, num_blocks=256))
    outputs = engine.generate([[1, 2, 3], [1, 2, 4, 5]], SamplingParams(max_tokens=8))

Each `step()` is one path, whatever the kind of step: the scheduler's plan (`StepPlan`) -> its padded inputs
(`runner.inputs.step_inputs`, with the structured-output masks) -> the device (`ModelRunner.run`) -> one
`StepResult` -> `Scheduler.update` -> the output processor (text, stop strings) and the structured-output
matchers, whose decisions the engine hands back to the scheduler -> the speculator's proposals for the next step.
A plan is a plain mixed prefill/decode step, a speculative verify step (its rows carry proposals, its result a
variable number of tokens per row) or, with `decode_steps_per_call > 1` and every running request decoding, a
fused decode of that many steps (blocks lent by the host, reconciled by `update`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import contextmanager

from flax import nnx

from pagedjax.compile_cache import cache_note, enable_compile_cache
from pagedjax.config import (
    EngineConfig,
    ModelConfig,
    QuantConfig,
    SpeculativeConfig,
)
from pagedjax.config.engine import engine_config, takes_options
from pagedjax.config.fields import is_int
from pagedjax.core.request import Request, RequestIds
from pagedjax.core.scheduler import Scheduler
from pagedjax.core.step_plan import StepPlan
from pagedjax.engine.generate import classify_batch, embed_batch, generate_batch
from pagedjax.engine.image_prompts import EncodedPrompt, image_prompt
from pagedjax.engine.output_processor import (
    OutputProcessor,
    record_pooled,
    record_prompt_logprobs,
    record_token_logprob,
)
from pagedjax.engine.protocol import PreparedRequest
from pagedjax.engine.relevance import relevance_batch
from pagedjax.engine.scoring import completion_logprobs
from pagedjax.engine.stats import EngineStats, stats_dict
from pagedjax.errors import ContextLengthExceeded, InvalidRequest, InvalidType, UnsupportedFeature
from pagedjax.lora.adapter import LoRAAdapter
from pagedjax.lora.manager import LoRAManager
from pagedjax.model.api import check_model
from pagedjax.model.classifier import Classifier
from pagedjax.model.llama import Llama
from pagedjax.model.loading.loader import engine_model, load_engine_inputs
from pagedjax.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringRequestOutput,
)
from pagedjax.pooling_params import PoolingParams
from pagedjax.runner import weights
from pagedjax.runner.host_tier import kv_identity, kv_setup, open_disk_tiers, reopen_disk_tiers
from pagedjax.runner.inputs import StepInputs, step_inputs
from pagedjax.runner.invariant import invariant_shape
from pagedjax.runner.programs import CompileEvent, all_done
from pagedjax.runner.runner import ModelRunner
from pagedjax.runner.shapes import StepShape, warmup_shapes
from pagedjax.sampling_params import RAW_SAMPLING, LoRARequest, SamplingParams, StructuredOutput
from pagedjax.spec_decode.draft_model import DraftProposer, load_draft
from pagedjax.spec_decode.mtp import MTPProposer, load_mtp_head
from pagedjax.spec_decode.proposer import StepSeen
from pagedjax.spec_decode.speculator import Speculator
from pagedjax.structured_output.compiler import Constraint, ConstraintCompiler
from pagedjax.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class LLMEngine:
    """Continuous-batching generation over a paged KV cache.

    Configured by one `EngineConfig` (`config`, None: its defaults) with `options` (its fields by name: `seed=3`,
    `cache_config=CacheConfig(...)`, ...) over it; the engine keeps the result as `engine.config`. The keywords
    besides are the objects an engine serves, not options:

    model: any model of the public contract (`pagedjax.model.api`: an `nnx.Module` with a `ModelSpec`, its weights
    in it), checked on construction (`check_model`: a model breaking the contract is refused here, named); or,
    for a built-in model (`pagedjax.model.llama`) of the option `model_config`, params: an `nnx.State` of `Llama`
    (e.g. from a checkpoint) or a `Llama` module; None initialises random weights from the option `seed` (which
    also seeds requests without a seed of their own). tokenizer / image_processor: a text model's tokenizer and a
    vision-language model's image processor (`from_pretrained` reads both from the model folder). devices: what a
    `parallel_config` shards over (default `jax.devices()`).

    The options (`EngineConfig` documents each): a `parallel_config` (None: one device, the plain single-device
    program) with `tensor_parallel_size` > 1 shards the weights and the KV cache over that many of `devices` and
    sizes the KV pool per device. One `LLMEngine` is one replica: several (`data_parallel_size` > 1) are a
    `DataParallelEngine`, which `pagedjax.make_engine` / `pagedjax.load_engine` build (the same methods).
    `max_compiled_programs` bounds the compiled step programs kept (each holds its machine code: about 12 MiB for
    the bundled model): past it the least recently used is dropped, and compiled again (or loaded from the
    persistent compilation cache) if it is needed again, so that requests of ever new shapes cannot grow the
    process's memory without bound. `compile_in_background=True` (the server's choice, with `warmup()`): a step
    whose program is not compiled yet runs on a bigger one already compiled, if there is one, while its own
    compiles in a background thread (`pagedjax.runner.programs`); `warmup()` compiles programs that can stand in
    for every step, so that no step waits for a compile, and `close()` cancels the background compiles still
    waiting. By default (False) every step waits for its own program, so that results never depend on compile
    timing: a stand-in computes the same tokens up to the last-bit rounding a change of shape may bring
    (`pagedjax.runner.shapes`), which could tip a near tie. `batch_invariant=True`: every step runs on one program
    of the engine's largest shape, so a request's tokens and log-probabilities are bitwise the same whatever
    shares its steps (`pagedjax.runner.invariant`). A `speculative_config` turns on speculative decoding
    (`pagedjax.spec_decode`): the output is the non-speculative one, token for token. `sampling_defaults`: what
    each request's sampling fields left None become, when the request is added (vLLM's unless given;
    `from_pretrained` reads the model folder's generation_config.json). A `lora_config` serves LoRA adapters
    (`pagedjax.lora`), a request's own by its `lora_request`: a built-in dense model, on one device or
    tensor-parallel, with n-gram speculation or none.

    A request's prompt and `max_tokens` must fit the context (`max_model_len`): more is a ValueError naming
    max_tokens and the limit, never a silent cut (and a request the KV pool cannot hold is refused too). A
    request that leaves `max_tokens` None (the default) generates until it stops or the context is full.
    A step whose device call raises never wedges the engine: see `step`.
    """

    @takes_options()
    def __init__(self, config: EngineConfig | None = None, *, model=None, params=None, tokenizer=None,
                 image_processor=None, devices=None, classifier: Classifier | None = None, **options):
        config = engine_config(config, options, "LLMEngine")
        self.config = config
        enable_compile_cache(config.compile_cache if isinstance(config.compile_cache, str) else None,
                             enabled=bool(config.compile_cache))
        self.seed = config.seed
        model = engine_model(config.model_config, params, model, self.seed)
        # What the engine knows of the model: its spec (a built-in model's ModelConfig too, None for others).
        self.model_config: ModelConfig | None = model.config if isinstance(model, Llama) else None
        self.cache_config = config.cache_config
        self.model_spec = check_model(model, kv_dtype=self.cache_config.kv_dtype)
        spec = self.model_spec
        if classifier is not None and (not isinstance(classifier, Classifier)
                                       or classifier.hidden_size != spec.hidden_size):
            raise ValueError(f"classifier: a Classifier over the model's {spec.hidden_size} hidden dimensions, got "
                             f"{classifier!r:.200}")
        self.classifier = classifier  # a sequence classifier's head: the engine serves pooling requests only
        dense = config.pooling_defaults.dense
        if dense and dense[0].weight.shape[1] != spec.hidden_size:
            raise ValueError(f"pooling_defaults.dense[0] takes {dense[0].weight.shape[1]} inputs, the model's hidden "
                             f"size is {spec.hidden_size}")
        if spec.bidirectional:
            self._check_bidirectional_serves(config)
        parallel_config = config.parallel_config
        lora_config = config.lora_config
        if lora_config is not None:
            self._check_lora_serves(config.speculative_config)
        draft = load_draft(config.speculative_config, spec, self.cache_config, self.seed, parallel_config)
        head = load_mtp_head(config.speculative_config, self.model_config, parallel_config)
        self.scheduler_config = config.scheduler_config.resolve(spec.max_position_embeddings)
        images = spec.images
        if images is not None:
            self.scheduler_config = self.scheduler_config.resolve_images(images.tokens_per_image)
            budget = self.scheduler_config.max_num_batched_tokens
            if images.bidirectional and budget < images.tokens_per_image:
                raise ValueError(f"SchedulerConfig.max_num_batched_tokens ({budget}) is below one image's "
                                 f"{images.tokens_per_image} tokens, which this model computes in one step (they "
                                 "attend to each other)")
        elif image_processor is not None:
            raise ValueError("LLMEngine: image_processor for a model that takes no images (ModelSpec.images)")
        self.decode_steps_per_call = config.decode_steps_per_call
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        mesh = None
        self.parallel_config = parallel_config
        # Blocks of the pools past the first: a recurrent state's snapshots (`pagedjax.config.kv_layout`), one per
        # a pool's block size of tokens.
        self.extra_pools = self.cache_config.resolve_state_blocks(spec, self.scheduler_config.max_num_seqs,
                                                                  self.scheduler_config.max_num_batched_tokens)
        self.pool_block_sizes = self.cache_config.resolve_pool_block_sizes(spec)
        if parallel_config is not None:
            from pagedjax.parallel.mesh import engine_mesh
            from pagedjax.parallel.sharding import per_device_model

            mesh = engine_mesh(parallel_config, self.model_config or spec, devices)
            # kv_memory_bytes is a per-device budget: blocks are counted by the KV heads one device holds (a draft
            # model's too: split over the same devices, its KV in the same blocks).
            self.num_blocks = self.cache_config.resolve_num_blocks(
                per_device_model(spec, mesh.size), None if draft is None else per_device_model(draft.spec, mesh.size),
                extra_pools=self.extra_pools)
        else:
            second = draft if draft is not None else head  # a draft model's or an MTP head's KV shares the blocks
            self.num_blocks = self.cache_config.resolve_num_blocks(spec, None if second is None else second.spec,
                                                                   extra_pools=self.extra_pools)
        if self.cache_config.kv_host_memory_bytes is not None and (draft is not None or head is not None):
            raise ValueError("CacheConfig.kv_host_memory_bytes: the host tier does not move a draft model's or an MTP "
                             "head's KV (which shares the target's blocks) yet; leave it out with speculative_config's "
                             f"method {config.speculative_config.method!r}")
        host_blocks = self.cache_config.resolve_host_blocks(spec, self.num_blocks, self.extra_pools)
        # The disk tier's folder is named by the weights and everything else that makes the KV bytes differ.
        self._disk_setup = None if self.cache_config.kv_disk_dir is None else kv_setup(
            model, spec, kv_dtype=self.cache_config.kv_array_dtype(spec), pool_block_sizes=self.pool_block_sizes,
            hash_seed=self.cache_config.hash_seed, backend=config.backend, mesh=mesh)
        self.disk_tiers = () if self._disk_setup is None else open_disk_tiers(
            self.cache_config.kv_disk_dir, kv_identity(nnx.state(model), self._disk_setup),
            self.cache_config.resolve_disk_blocks(spec, self.num_blocks, self.extra_pools))
        for p, (slots, size) in enumerate(zip(host_blocks, self.pool_block_sizes, strict=True)):
            longest = -(-self.scheduler_config.max_model_len // size)
            if self.disk_tiers and slots < longest:  # a hit read from disk passes through host slots
                logger.warning("the host tier holds %d blocks of pool %d, whose longest request takes %d: a prefix "
                               "hit read from the disk tier stops at %d of them (raise kv_host_memory_bytes)",
                               slots, p, longest, slots)
        # One block table per KV cache group; a window group's blocks out of its window go back to the pool while
        # requests run.
        self.scheduler = Scheduler(self.scheduler_config, self.cache_config, self.num_blocks,
                                   group_windows=spec.kv_layout.windows, group_pools=spec.kv_layout.group_pools,
                                   extra_pools=self.extra_pools, pool_block_sizes=self.pool_block_sizes,
                                   max_loras=None if lora_config is None else lora_config.max_loras,
                                   images=None if images is None else images.tokens_per_image,
                                   bidirectional_images=images is not None and images.bidirectional,
                                   host_tier_blocks=host_blocks, disk_tiers=self.disk_tiers,
                                   drop_last_hit_block=head is not None, whole_prompts=spec.bidirectional)
        self.output_processor = OutputProcessor(tokenizer, config.pooling_defaults.dense)
        self.structured = StructuredOutputManager(ConstraintCompiler(tokenizer, spec.vocab_size, spec.eos_token_ids),
                                                  config.structured_limits)
        max_programs, background = config.max_compiled_programs, config.compile_in_background
        self.runner = ModelRunner(model, self.num_blocks, self.cache_config.block_size, extra_pools=self.extra_pools,
                                  pool_block_sizes=self.pool_block_sizes,
                                  kv_dtype=self.cache_config.kv_array_dtype(spec), backend=config.backend,
                                  mesh=mesh, max_programs=max_programs, compile_in_background=background,
                                  lora=lora_config, image_slots=None if images is None else
                                  self.scheduler.encoder_cache.num_slots, host_tier_blocks=host_blocks,
                                  disk_tiers=self.disk_tiers, keep_hidden=head is not None)
        self.lora = None if lora_config is None else LoRAManager(lora_config, self.model_config, self.runner)
        if draft is not None:
            draft = DraftProposer(draft, self.num_blocks, self.cache_config,
                                  self.scheduler_config.max_num_batched_tokens, backend=self.runner.backend,
                                  max_programs=max_programs, compile_in_background=background, mesh=mesh)
        elif head is not None:
            draft = MTPProposer(head, self.runner, self.num_blocks, self.cache_config,
                                config.speculative_config.num_speculative_tokens, max_programs=max_programs,
                                compile_in_background=background)
        self.speculator = None if config.speculative_config is None else Speculator(config.speculative_config, draft)
        if config.batch_invariant:  # see pagedjax.runner.invariant
            self.runner.fixed_shape = invariant_shape(
                max_tokens=self.scheduler_config.max_num_batched_tokens, max_seqs=self.scheduler_config.max_num_seqs,
                max_request_tokens=self.max_request_tokens, block_size=self.cache_config.block_size,
                backend=self.runner.backend)
        self._request_ids = RequestIds()
        self._empty_plans = 0
        self._steps = 0
        self._fused_calls = 0
        self._failed_steps = 0
        self._generated = 0
        self._prefill_computed = 0
        self._prompt_tokens = 0
        self._elapsed = 0.0
        self._warmup_s = 0.0
        self._warned_ties = False  # the warning at the first sparse-attention indexer tie (once per engine)
        logger.info("LLMEngine: %d KV blocks x %d tokens, attention backend %s", self.num_blocks,
                    self.cache_config.block_size, self.runner.backend)

    @staticmethod
    def _check_bidirectional_serves(config: EngineConfig) -> None:
        """ValueError for what a bidirectional model (`ModelSpec.bidirectional`: it embeds, never generates, and
        keeps no prefix cache) cannot use: speculative decoding, a host or disk KV tier. Its prefix caching is off
        (logged): a block's KV depends on the tokens after it."""
        if config.speculative_config is not None:
            raise ValueError("speculative_config: a bidirectional model (an encoder) generates nothing to speculate on")
        cache = config.cache_config
        for name in ("kv_host_memory_bytes", "kv_disk_dir"):
            if getattr(cache, name) is not None:
                raise ValueError(f"CacheConfig.{name}: a bidirectional model keeps no prefix cache (a block's KV "
                                 "depends on the tokens after it) for a KV tier to hold")
        if cache.enable_prefix_caching:
            logger.info("prefix caching off: the model's attention goes both ways, so a block's KV depends on the "
                        "tokens after it (each prompt is computed whole, in one step)")

    def _check_lora_serves(self, speculative_config: SpeculativeConfig | None) -> None:
        """ValueError naming what keeps this engine from serving adapters: a model not built in, a
        mixture-of-experts one, or a draft model proposing (it would propose without the requests' adapters).
        Tensor parallelism serves them (the stacks split as their linears: `pagedjax.parallel.sharding`)."""
        if self.model_config is None:
            raise ValueError("lora_config needs a built-in model (ModelConfig / from_pretrained), not model=")
        if self.model_config.moe is not None:
            raise ValueError("lora_config: LoRA on mixture-of-experts models (ModelConfig.moe) is not supported")
        if speculative_config is not None and speculative_config.method == "draft":
            raise ValueError("lora_config: SpeculativeConfig(method='draft') is not supported with LoRA (the "
                             "draft model would propose without the requests' adapters); use method='ngram'")

    @classmethod
    @takes_options(but=("model_config",))
    def from_pretrained(cls, path=None, *, dtype: str | None = None, quantization: str | QuantConfig | None = None,
                        tokenizer=None, devices=None, classifier_from_tokens: tuple[str, str] | None = None,
                        **options) -> LLMEngine:
        """An engine over a saved model: a pagedjax orbax checkpoint folder, a local Hugging Face folder
        (config.json + *.safetensors [+ tokenizer.json]), or None for the bundled model. `options`: `EngineConfig`'s
        fields, as for `LLMEngine(...)` (the model's shape, `model_config`, is the folder's). With a
        `parallel_config`, weights are read straight into their shards on the (first replica's) mesh.
        `quantization` ("int8" | "int4" | "int4:32" | "fp8" or a `QuantConfig`): weight-only quantized linear
        layers and MoE experts, quantized at load (`pagedjax.model.layers.quant`, `pagedjax.model.layers.
        moe_quant`). `tokenizer`: instead of the folder's. A Hugging Face folder of a `model_type` registered in
        `pagedjax.ModelRegistry` is built by its factory. `sampling_defaults`: instead of the folder's (its
        generation_config.json over vLLM's defaults: `folder_sampling_defaults`). A `*ForSequenceClassification`
        folder's engine classifies (`classify`, `relevance`); `classifier_from_tokens` ("no", "yes") makes a causal
        LM one, judged by those two tokens' logits (a Qwen3-Reranker: `pagedjax.model.classifier`)."""
        config, objects = load_engine_inputs(path, dtype, quantization, tokenizer, devices, options,
                                             "LLMEngine.from_pretrained", classifier_from_tokens)
        return cls(config, **objects)

    @property
    def backend(self) -> str:
        return self.runner.backend

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt + output) one request can hold: `max_model_len`, or fewer when the KV pool
        could not hold them (`Scheduler.max_request_tokens`: a sliding-window model needs its window's KV only)."""
        return self.scheduler.max_request_tokens

    def warmup(self) -> float:
        """Compile the programs that dominate every step this engine can make (`shapes.warmup_shapes`: the
        ragged step at the largest token, sequence and block-table buckets with every optional part on, with and
        without prompt log-probabilities; on the XLA path a ladder of narrower and smaller ones too; the fused
        decode's when `decode_steps_per_call` > 1; a draft model's widest step: `DraftProposer.warmup`) and run
        each once on padding. From then on a step whose own program is not compiled runs on the fastest of them
        that dominates it while its own compiles in the background (`pagedjax.runner.programs`), instead of
        waiting for it: every step but those asking for logits or more than 512 stop ids. The KV cache's contents
        and the scheduler are left as they were, and these programs are never dropped. Returns the seconds it
        took (also logged, and in `stats().warmup_s`)."""
        start, before = time.perf_counter(), self.stats()
        shapes, max_blocks = self._warmup_shapes()
        draft, head = self._draft_model(), self._mtp_head()
        logger.info("warm-up: compiling %d programs (%s)", len(shapes) + (draft is not None) + (head is not None),
                    cache_note())
        self.runner.warmup(shapes)
        if draft is not None:  # the draft model's stand-in
            draft.warmup(self.scheduler_config.max_num_seqs, max_blocks)
        if head is not None:  # the MTP head's
            head.warmup(_widest_tokens(shapes), self.scheduler_config.max_num_seqs, max_blocks)
        seconds = time.perf_counter() - start
        self._warmup_s += seconds
        after = self.stats()
        logger.info("warm-up: %d programs ready and run in %.1f s (%d compiled, %d loaded from the compile cache)",
                    after.compilations - before.compilations, seconds,
                    after.programs_compiled - before.programs_compiled, after.programs_loaded - before.programs_loaded)
        return seconds

    def _warmup_shapes(self) -> tuple[list, int]:
        """(the target's warm-up programs, the block-table width they are compiled for)."""
        sc, bs, steps = self.scheduler_config, self.cache_config.block_size, self.decode_steps_per_call
        # A fused decode's tables have room for its steps past the sequence's tokens.
        max_blocks = -(-(self.max_request_tokens + steps - 1) // bs)
        shapes = [self.runner.fixed_shape] if self.runner.fixed_shape is not None else warmup_shapes(
            max_tokens=sc.max_num_batched_tokens, max_seqs=sc.max_num_seqs, max_blocks=max_blocks, block_size=bs,
            decode_steps=steps, narrow=self.runner.backend == "xla", images=self.model_spec.images is not None,
            attend_until=self.model_spec.bidirectional or (self.model_spec.images is not None
                                                           and self.model_spec.images.bidirectional))
        if self.speculator is not None:
            shapes += self.speculator.warmup_shapes(shapes, sc)
        return shapes, max_blocks

    def start_warmup(self) -> Future:
        """`warmup()`'s programs compiled in the background instead (`ModelRunner.warm_in_background`: the
        cheapest first, behind any program a step waits for), so that the engine serves at once: until a
        step's stand-in exists, the step compiles its own program, as without a warm-up. Returns at once a
        future of the seconds until every program was compiled; each is installed (held for good) at the next
        step after it. Needs `compile_in_background=True` (ValueError otherwise)."""
        if not self.config.compile_in_background:
            raise ValueError("start_warmup() compiles in the background: build the engine with "
                             "compile_in_background=True (or call warmup())")
        self.runner.check_awake()
        shapes, max_blocks = self._warmup_shapes()
        done = [self.runner.warm_in_background(shapes)]
        draft, head = self._draft_model(), self._mtp_head()
        if draft is not None:
            done.append(draft.start_warmup(self.scheduler_config.max_num_seqs, max_blocks))
        if head is not None:
            done.append(head.start_warmup(_widest_tokens(shapes), self.scheduler_config.max_num_seqs, max_blocks))
        logger.info("warm-up: compiling %d programs in the background (%s)",
                    len(shapes) + (draft is not None) + (head is not None), cache_note())
        return all_done(done)

    @contextmanager
    def compile_notices(self, listener: Callable[[CompileEvent], None]) -> Iterator[None]:
        """Within the block, `listener` hears of every compile a step (or the warm-up) waits for, as it starts
        and ends (`pagedjax.runner.programs.CompileEvent`): the target's, a draft model's, the image encoder's
        (a front end's progress, e.g. `generate`'s bar)."""
        caches = [self.runner.programs]
        if self._draft_model() is not None:
            caches.append(self._draft_model().runner.programs)
        if self.runner.image_features is not None:
            caches.append(self.runner.image_features.programs)
        for cache in caches:
            cache.listeners.append(listener)
        try:
            yield
        finally:
            for cache in caches:
                cache.listeners.remove(listener)

    def close(self) -> None:
        """Cancel the background compiles still waiting, a draft model's or an MTP head's too (the engine still
        serves: later programs compile when needed)."""
        self.runner.close()
        if self.speculator is not None and self.speculator.draft is not None:
            self.speculator.draft.close()

    # ----------------------------------------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    sampling_params: SamplingParams | None = None, *, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None, pooling: PoolingParams | None = None) -> None:
        """Queue a request (under `lora_request`'s adapter, or the base model). Raises `InvalidType` (a TypeError)
        for a non-string id or salt, token ids that are not ints, or sampling params of another type;
        `InvalidRequest` (a ValueError) for ids outside the vocabulary, an empty prompt, a duplicate id or an
        adapter it cannot read; `ContextLengthExceeded` for a prompt too long or a request that could never fit in
        the context or the KV pool; `UnsupportedFeature` for what this engine does not do (images to a text model,
        stop strings without a tokenizer, an adapter without a lora_config, embeddings of a model whose pooling
        pagedjax does not compute); `InvalidConstraint` for an output constraint the grammar library refuses. Each
        names the request field (`param`: `pagedjax.errors`). Nothing is queued then. With `pooling`, a pooling
        request (an embedding, `make_request`): its finished output's `embedding` holds the vector."""
        self.add_prepared_request(self.make_request(request_id, token_list(request_id, prompt_token_ids),
                                                    sampling_params, cache_salt=cache_salt,
                                                    lora_request=lora_request, pooling=pooling))

    def make_request(self, request_id: str, prompt, sampling_params: SamplingParams | None = None, *,
                     cache_salt: str | None = None, lora_request: LoRARequest | None = None,
                     pooling: PoolingParams | None = None) -> PreparedRequest:
        """A validated request of a prompt (token ids, or text with a tokenizer) that the scheduler would accept,
        its constraint compiled, its sampling fields left None set from the engine's `sampling_defaults` and a
        `max_tokens` left None to the rest of the context (`SamplingParams.with_room`); nothing is queued
        (`add_prepared_request` does). With `pooling` (and no sampling_params), a pooling request: an embedding,
        its fields left None set from the engine's `pooling_defaults` (`pagedjax.pooling_params`). Raises as
        `add_request`."""
        if not isinstance(request_id, str):
            raise InvalidType(f"request_id must be a str, got {type(request_id).__name__} {request_id!r}",
                              param="request_id")
        if pooling is None and self.classifier is not None:
            raise UnsupportedFeature(f"request {request_id!r}: this model is a sequence classifier, without an LM "
                                     "head: it serves classify and embed, not generation", param="prompt",
                                     code="generation_not_supported")
        if pooling is None and self.model_spec.bidirectional:
            raise UnsupportedFeature(f"request {request_id!r}: this model's attention goes both ways (an encoder): it "
                                     "serves embed, not generation", param="prompt", code="generation_not_supported")
        if pooling is not None:
            pooling = self._pooling(request_id, pooling, sampling_params)
            # Never sampled: it ends with its prompt (`Scheduler.update`); a token's room keeps the limits' checks.
            sampling_params = SamplingParams(max_tokens=1, **RAW_SAMPLING)
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise InvalidType(f"request {request_id!r}: sampling_params must be SamplingParams, "
                              f"got {type(params).__name__}", param="sampling_params")
        params = params.with_defaults(self.config.sampling_defaults)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidType(f"request {request_id!r}: cache_salt must be a str, got {type(cache_salt).__name__}",
                              param="cache_salt")
        tokens, images = prompt if isinstance(prompt, EncodedPrompt) else self.encode_prompt(request_id, prompt)
        params = params.with_room(self.max_request_tokens - len(tokens))  # max_tokens None: the rest of the context
        # The context; a prompt too long itself, or a request bigger than the KV pool, is the scheduler's error.
        limit = self.scheduler_config.max_model_len
        if len(tokens) < limit < len(tokens) + params.max_tokens:
            raise ContextLengthExceeded(
                f"request {request_id!r}: SamplingParams.max_tokens ({params.max_tokens}) and the prompt's "
                f"{len(tokens)} tokens exceed the {limit}-token context (max_model_len); max_tokens may be at most "
                f"{limit - len(tokens)} for this prompt", param="max_tokens")
        vocab = self.model_spec.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"request {request_id!r}: token ids {bad[:5]} outside the vocabulary [0, {vocab})",
                                 param="prompt")
        bad_stop = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad_stop:
            raise InvalidRequest(f"request {request_id!r}: stop_token_ids {bad_stop[:5]} outside [0, {vocab})",
                                 param="stop_token_ids")
        if params.stop and self.tokenizer is None:
            raise UnsupportedFeature(f"request {request_id!r}: SamplingParams.stop needs an engine with a tokenizer "
                                     "(stop strings are matched on the detokenized text); use stop_token_ids",
                                     param="stop", code="tokenizer_required")
        adapter_id = None
        if lora_request is not None:
            if self.lora is None:
                raise UnsupportedFeature(f"request {request_id!r}: lora_request needs an engine that serves "
                                         "LoRA adapters (lora_config)", param="lora_request",
                                         code="lora_not_enabled")
            try:
                adapter_id = self.lora.register(lora_request)
            except TypeError as e:
                raise InvalidType(f"request {request_id!r}: {e}", param="lora_request") from None
            except ValueError as e:
                raise InvalidRequest(f"request {request_id!r}: {e}", param="lora_request") from None
        try:
            constraint = None if params.structured is None else self.structured.compile(params.structured)
        except InvalidRequest as e:
            raise e.for_request(request_id) from None
        request = Request(request_id=request_id, prompt_token_ids=tokens, sampling_params=params,
                          eos_token_ids=self.model_spec.eos_token_ids, cache_salt=cache_salt, adapter_id=adapter_id,
                          logprobs=[] if params.logprobs is not None else None,
                          prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
                          constrained=constraint is not None, images=images, pooling=pooling)
        self.scheduler.check_request(request)
        return PreparedRequest(request, constraint)

    def _pooling(self, request_id: str, pooling: PoolingParams, sampling_params) -> PoolingParams:
        """A pooling request's options with the engine's defaults set, checked against this model."""
        if not isinstance(pooling, PoolingParams):
            raise InvalidType(f"request {request_id!r}: pooling must be PoolingParams, got {type(pooling).__name__}",
                              param="pooling")
        if sampling_params is not None:
            raise InvalidRequest(f"request {request_id!r}: a pooling request samples nothing; it takes no "
                                 "sampling_params", param="sampling_params")
        defaults = self.config.pooling_defaults
        if defaults.refused is not None:
            raise UnsupportedFeature(f"request {request_id!r}: this model's embeddings cannot be computed: "
                                     f"{defaults.refused}", param="pooling", code="pooling_not_supported")
        pooling = pooling.with_defaults(defaults)
        size = defaults.output_size(self.model_spec.hidden_size)
        if pooling.dimensions is not None and pooling.dimensions > size:
            raise InvalidRequest(f"request {request_id!r}: PoolingParams.dimensions ({pooling.dimensions}) is more "
                                 f"than the model's {size} embedding dimensions", param="dimensions")
        return pooling

    def compile_constraint(self, structured: StructuredOutput) -> Constraint:
        """A fresh matcher of a constraint, compiled once per engine and copied after (`ConstraintCompiler`: the
        server compiles in its prepare stage, off the engine thread); `InvalidConstraint` (or `LimitError`,
        `UnsupportedFeature`) as `add_request` raises."""
        return self.structured.compile(structured)

    def add_prepared_request(self, prepared: PreparedRequest) -> None:
        """Queue a request made by `make_request` (ValueError if the scheduler refuses it)."""
        request = prepared.request
        self.scheduler.add_request(request)
        if prepared.constraint is not None:
            self.structured.add(request.request_id, prepared.constraint)
        self._prompt_tokens += request.num_prompt_tokens

    def fresh_request_ids(self, prefix: str, n: int) -> list[str]:
        """`n` ids that no live request uses (`pagedjax.core.request.RequestIds`)."""
        return self._request_ids.fresh(
            prefix, n, lambda rid: self.scheduler.get_request(rid) is not None or rid in self.scheduler.groups)

    def beam_search(self, prompts, params, lora_request=None):
        """Beam search for each prompt (token ids, or text with a tokenizer), under `lora_request` as `generate`
        takes it; see `pagedjax.engine.beam_search`. Returns one `BeamSearchOutput` per prompt, its `beam_width`
        best sequences first."""
        from pagedjax.engine.beam_search import beam_search

        return beam_search(self, prompts, params, lora_request)

    def abort(self, request_id: str) -> bool:
        """Stop a request (every sample of a multi-sample one) and free all its blocks. Returns False if no such
        unfinished request; ValueError for the id of one of a request's samples, which end only together (one
        aborted alone used to leave its request without a finished output, or rank a truncated sample)."""
        request = self.scheduler.get_request(str(request_id))
        group = None if request is None else request.group
        if group is not None and request.request_id != group.request.request_id:
            raise ValueError(f"{request_id!r} is sample {request.sample_index} of request "
                             f"{group.request.request_id!r}: abort that request")
        return self.scheduler.abort(str(request_id)) is not None

    # ------------------------------------------------------------------------------------------------ adapters
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register an adapter now (its folder read and checked; requests may also name it first in
        `add_request`). Returns True; raises as `add_request` does for a bad adapter."""
        self._lora_manager().register(lora_request)
        return True

    def add_lora_adapter(self, lora_request: LoRARequest, adapter: LoRAAdapter) -> bool:
        """Register an adapter whose weights are given (`adapter`: host or device arrays, e.g. a trainer's LoRA
        parameters each step) instead of read from `lora_request.lora_path`, which then only names it. Adding an
        id again replaces its weights (blocks cached under the former ones are never hit again); nothing
        recompiles. ValueError while an unfinished request uses the id, or as `LoRAManager.register_adapter`."""
        self._check_lora_unused(lora_request.lora_int_id)
        self._lora_manager().register_adapter(lora_request, adapter)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget adapter `lora_int_id` (its host copy and device slot); False if it is not registered. ValueError
        while an unfinished request uses it. Adding the id again later (any folder) never hits the blocks cached
        under its former weights."""
        self._check_lora_unused(lora_int_id)
        return self._lora_manager().remove(lora_int_id)

    def _check_lora_unused(self, lora_int_id: int) -> None:
        """ValueError while an unfinished request uses adapter `lora_int_id` (its weights may not change or go)."""
        key = self._lora_manager().key_of(lora_int_id)
        if key is not None and any(r.adapter_id == key for r in self.scheduler.requests.values()):
            raise ValueError(f"LoRA adapter {lora_int_id} is in use by unfinished requests")

    def list_loras(self) -> list[LoRARequest]:
        """The registered adapters, in registration order."""
        return self._lora_manager().adapters

    def _lora_manager(self) -> LoRAManager:
        if self.lora is None:
            raise ValueError("this engine serves no LoRA adapters (LLMEngine(lora_config=LoRAConfig(...)))")
        return self.lora

    @property
    def failed_steps(self) -> int:
        """Steps whose device call raised (recovered from: see `step`); `stats().failed_steps` without the rest."""
        return self._failed_steps

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # --------------------------------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns outputs of the requests that got tokens or finished.

        If the device call raises, the engine stays serving: a fused decode's lent blocks are returned;
        if the KV cache was lost with the call (it is donated), a fresh one is made and every running
        request is preempted and recomputed (exact); the failed step's requests are handled by
        `Scheduler.fail_step` (alone: it finishes with finish_reason "error" and `error` set; with others:
        each reruns alone, so only the request that breaks steps fails). Other requests lose nothing.
        A KeyboardInterrupt (or other BaseException) is recovered from the same way, without blaming the
        step's requests, and re-raised.
        """
        self.runner.check_awake()  # before anything is scheduled: a refused step changes nothing
        start = time.perf_counter()
        try:
            # An MTP head reads every step's hidden states, which a fused decode keeps none of: it runs no fused decode.
            steps = 1 if self.runner.keep_hidden else self.decode_steps_per_call
            touched = self._run_step(self.scheduler.schedule(decode_steps=steps))
        finally:
            self._elapsed += time.perf_counter() - start
            self._steps += 1
        outputs = self.output_processor.outputs(touched)
        live = self.scheduler.requests.keys() | {i for g in self.scheduler.groups.values() for i in g.sample_ids}
        self.output_processor.retain(live | self.scheduler.groups.keys())
        self.structured.retain(live | self.scheduler.groups.keys())
        return outputs

    def step_inputs(self, plan: StepPlan) -> StepInputs:
        """The padded device inputs of a plan from `scheduler.schedule()` (see `pagedjax.runner.inputs`)."""
        requests = [self.scheduler.get_request(rid) for rid in plan.request_ids]
        vocab = self.model_spec.vocab_size
        lora_slots = None if self.lora is None else self.lora.slots_for([r.adapter_id for r in requests])
        return step_inputs(plan, requests, vocab_size=vocab, engine_seed=self.seed,
                           token_mask=self.structured.masks(requests, plan.emits_token, vocab), lora_slots=lora_slots,
                           images=self.model_spec.images, bidirectional=self.model_spec.bidirectional)

    def _run_step(self, plan: StepPlan) -> list[Request]:
        """One step of any kind: inputs, device, `Scheduler.update`, outputs, then the next step's proposals."""
        if plan.num_seqs == 0:
            # Legitimate once in a row (a request that preempted itself); never twice: the next plan admits
            # the waiting queue's head into an idle pool. Fail loudly rather than spin.
            self._empty_plans += 1
            if self._empty_plans > 2 and self.scheduler.has_unfinished_requests():
                raise RuntimeError(f"the scheduler made no progress for {self._empty_plans} steps with "
                                   f"{self.scheduler.num_unfinished_requests} requests unfinished (a bug)")
            return []
        self._empty_plans = 0
        requests = [self.scheduler.get_request(rid) for rid in plan.request_ids]
        try:
            result = self.runner.run(plan, self.step_inputs(plan))
        except BaseException as exc:
            return self._recover(plan, exc)
        if self.runner.indexer_ties and not self._warned_ties:
            self._warned_ties = True
            logger.warning("sparse attention: the indexer's top-k met equal scores at its cut-off (%d query rows so "
                           "far, EngineStats.indexer_ties); pagedjax keeps the lower position, transformers leaves "
                           "such ties unordered, so its outputs may differ there (docs/models.md, DeepSeek V3.2)",
                           self.runner.indexer_ties)
        before = [r.num_output_tokens for r in requests]
        drafts = [0] * plan.num_seqs if plan.num_drafts is None else plan.num_drafts.tolist()
        for i, (r, kv_len, q_len) in enumerate(zip(requests, plan.kv_lens, plan.q_lens, strict=True)):
            # Every token run except a sampled token's own decode and proposals is prefill work (prompt or recompute).
            is_decode_token = r.num_output_tokens > 0 and int(kv_len) - drafts[i] == r.num_tokens
            self._prefill_computed += int(q_len) - int(is_decode_token) - drafts[i]
        self.scheduler.update(plan, result)
        emitted = [r.num_output_tokens - b for r, b in zip(requests, before, strict=True)]
        for i, r in enumerate(requests):  # each emitted token's log-probability is its own row's
            for j in range(emitted[i] if r.wants_logprobs else 0):
                row = int(result.cu_rows[i]) + j
                record_token_logprob(r, int(result.token_ids[row]), result.logprobs, (row,))
        if result.prompt_logprobs is not None:
            record_prompt_logprobs(plan, requests, result.prompt_targets, result.prompt_logprobs)
        record_pooled(plan, requests, result.pooled)
        if plan.fused is not None:
            self._fused_calls += 1
        progressed = self._progressed(requests, before)
        if self.speculator is not None:
            self.speculator.count(plan, result, emitted)
            self.speculator.propose(self.scheduler, StepSeen(plan, result, self.scheduler))
        return progressed

    def _recover(self, plan: StepPlan, exc: BaseException) -> list[Request]:
        """Bring the host and device back to a consistent state after a step's device call raised (see
        `step`); returns the requests that failed. Re-raises anything that is not an `Exception`."""
        self._failed_steps += 1
        self.scheduler.cancel(plan)
        if self.runner.kv_cache_lost:
            logger.error("the KV cache was lost with a failed step: recomputing every running request")
            self.runner.reset_kv_cache()
            self.scheduler.drop_computed_kv()
        if not isinstance(exc, Exception):
            for rid in plan.request_ids:
                self.scheduler.preempt(rid)
            raise exc
        logger.error("step of %d request(s) failed: %s: %s", plan.num_seqs, type(exc).__name__, exc, exc_info=exc)
        return self.scheduler.fail_step(plan.request_ids, f"{type(exc).__name__}: {exc}")

    def _progressed(self, requests: list[Request], before: list[int]) -> list[Request]:
        """The requests that got tokens or finished, after the decisions that need text or a grammar: a stop
        string ends a request there (`OutputProcessor.find_stops`), and a matcher that refuses a token fails it
        (`StructuredOutputManager.advance`); the scheduler applies both."""
        for request, num_tokens, stop in self.output_processor.find_stops(requests, before):
            self.scheduler.stop_at(request, num_tokens, stop)
        for request, why in self.structured.advance(requests):
            self.scheduler.fail_request(request, why)
        progressed = []
        for r, b in zip(requests, before, strict=True):
            self._generated += r.num_output_tokens - b
            if r.num_output_tokens > b or r.is_finished:
                progressed.append(r)
        return progressed

    # ----------------------------------------------------------------------------------------------- generate
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; returns finished outputs in input order.

        As vLLM's `LLM.generate`: one prompt (a str or bytes when the engine has a tokenizer, a list of token
        ids, or a dict `{"prompt": ...}` / `{"prompt_token_ids": ...}`) is one request, a list of them a batch
        (`pagedjax.engine.generate.batch_of_prompts`). The whole batch
        is validated before any of it is queued: a bad prompt raises and queues nothing. Requests get ids
        `gen-<call>-<index>` (skipping any id in use), so they never collide with the caller's own.
        `lora_request`: one adapter for every prompt, or one (or None: the base model) per prompt.
        """
        return generate_batch(self, prompts, sampling_params, use_tqdm, lora_request)

    def encode_prompt(self, request_id: str, prompt) -> EncodedPrompt:
        """The token ids and images of a prompt: text, token ids, or a dict with images
        (`pagedjax.engine.image_prompts`: each image made into pixels by the image processor and hashed), as
        `make_request` would make them; raises as it does. It reads the tokenizer, the image processor and the
        model's spec only, so it may run on any thread: the server encodes images in a worker thread, off the
        engine's (`AsyncLLMEngine.add_request`), and hands `make_request` the `EncodedPrompt`."""
        def text_ids(text: str) -> list[int]:
            if self.tokenizer is None:
                raise UnsupportedFeature(f"request {request_id!r}: string prompts need a tokenizer; pass token ids "
                                         "or give the engine a tokenizer", param="prompt", code="tokenizer_required")
            return list(self.tokenizer.encode(text))

        if isinstance(prompt, Mapping):
            return EncodedPrompt(*image_prompt(request_id, prompt, spec=self.model_spec.images,
                                               processor=self.image_processor, encode_text=text_ids,
                                               token_list=lambda ids: token_list(request_id, ids)))
        ids = text_ids(prompt) if isinstance(prompt, (str, bytes)) else token_list(request_id, prompt)
        images = self.model_spec.images
        if images is not None and images.image_token_id in ids:
            raise InvalidRequest(f"request {request_id!r}: the prompt holds image placeholder tokens "
                                 f"({images.image_token_id}) but no images: give them as {{'prompt': ..., "
                                 "'multi_modal_data': {'image': [...]}}", param="prompt")
        return EncodedPrompt(ids)

    def save_kv_tiers(self) -> int:
        """Write every cached block still on the device to the disk tier (straight from the device), so that the
        next start on the same folder finds it too: the blocks the device evicted are there already (the disk tier
        is written through), these are the rest. Call between steps, e.g. before exiting (`pagedjax-serve` does at
        shutdown, `pagedjax-generate` when done). Returns the blocks written (0 without a disk tier)."""
        if not self.disk_tiers or self.runner.asleep:
            return 0
        kv = self.scheduler.kv_cache_manager
        written = lambda: sum(d.num_written for d in self.disk_tiers if d is not None)
        before = written()
        if kv.save_cached_blocks():
            moves = kv.take_tier_moves()
            try:
                self.runner.move_tiers(moves)
            except BaseException:
                kv.discard_tier_moves()
                raise
            kv.commit_tier_moves(moves)
        logger.info("save_kv_tiers: %d blocks written to the disk tier", written() - before)
        return written() - before

    # ------------------------------------------------------------------------------------------ training loop
    def update_weights(self, params) -> None:
        """Serve `params` (an `nnx.State` or module of the model's structure, shapes, dtypes and shardings) from
        the next step on: no recompilation, no copy; running requests recompute (`pagedjax.runner.weights`)."""
        weights.update_weights(self.runner, self.scheduler, params)
        if self.disk_tiers:  # the new weights' blocks go to (and come from) their own folder
            reopen_disk_tiers(self.disk_tiers, self.cache_config.kv_disk_dir,
                              kv_identity(nnx.state(params) if isinstance(params, nnx.Module) else params,
                                          self._disk_setup))

    def _draft_model(self) -> DraftProposer | None:
        """The draft model's proposer (method "draft"), whose runner compiles programs of its own; None otherwise."""
        draft = None if self.speculator is None else self.speculator.draft
        return draft if isinstance(draft, DraftProposer) else None

    def _mtp_head(self) -> MTPProposer | None:
        """The MTP head's proposer (method "mtp"), which compiles programs of its own; None otherwise."""
        head = None if self.speculator is None else self.speculator.draft
        return head if isinstance(head, MTPProposer) else None

    def sleep(self) -> int:
        """Release the KV pool's device memory, a draft model's or an MTP head's too (running requests recompute
        after `wake`); returns bytes freed per device. Steps raise RuntimeError until `wake()`."""
        draft = None if self.speculator is None else self.speculator.draft
        return weights.sleep(self.runner, self.scheduler) + (0 if draft is None else draft.sleep())

    def wake(self) -> float:
        """Re-create the KV pool after `sleep` (nothing recompiled); returns the seconds it took."""
        if self.speculator is not None and self.speculator.draft is not None:
            self.speculator.draft.wake()
        return weights.wake(self.runner)

    def embed(self, prompts, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = False,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[EmbeddingRequestOutput]:
        """An embedding of every prompt (as `generate` takes prompts), in input order: vLLM's `LLM.embed`. Each
        prompt runs as a pooling request (`pagedjax.pooling_params`: prefill only, batched and chunked with any
        other request, a "last" pooling taking prefix-cache hits); `pooling_params` one for all or one per prompt
        (None: the model's pooling, `EngineConfig.pooling_defaults`). Raises as `add_request`, and
        `UnsupportedFeature` for a model whose pooling pagedjax does not compute (`PoolingDefaults.refused`)."""
        return embed_batch(self, prompts, pooling_params, use_tqdm, lora_request)

    def classify(self, prompts, use_tqdm: bool = False,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[ClassificationRequestOutput]:
        """Each prompt's label probabilities under a sequence classifier's head (`from_pretrained` of a
        `*ForSequenceClassification` folder: `pagedjax.model.classifier`), in input order: vLLM's `LLM.classify`.
        The head reads the last prompt token's final hidden state (a "last" pooling request, prefix-cache hits
        taken). `UnsupportedFeature` for an engine without a classifier; otherwise raises as `embed`."""
        return classify_batch(self, prompts, use_tqdm, lora_request)

    def relevance(self, text_1, text_2, use_tqdm: bool = False,
                  lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                  ) -> list[ScoringRequestOutput]:
        """Relevance of (query, document) pairs, vLLM's `LLM.score` (`score` here gives log-probabilities): one
        `text_1` with each of `text_2`, or `text_1[i]` with `text_2[i]`; texts or token-id lists. A cross-encoder
        (a one-label classifier) scores each pair's joint prompt (the sigmoid of its logit), any other model the
        cosine similarity of the two embeddings (`pagedjax.engine.relevance`). Raises as `embed`."""
        return relevance_batch(self, text_1, text_2, use_tqdm, lora_request)

    def score(self, prompts, completions, lora_request=None):
        """Per-token log-probabilities (float32 arrays) of each completion after its prompt, by this engine's
        compiled step (`pagedjax.engine.scoring.completion_logprobs`), under `lora_request` as `generate` takes
        it."""
        return completion_logprobs(self, prompts, completions, lora_request)

    # -------------------------------------------------------------------------------------------------- stats
    def stats(self) -> EngineStats:
        """The counters now. Programs and their compile time are the target's, the draft model's and the image
        encoder's together (all compile inside steps), so `tokens_per_s` leaves every compile out."""
        programs = [self.runner.programs]
        if self._draft_model() is not None:
            programs.append(self._draft_model().runner.programs)
        if self.runner.image_features is not None:  # the image encoder's, compiled inside steps too
            programs.append(self.runner.image_features.programs)
        layout = self.model_spec.kv_layout
        pool_bytes = self.runner.block_bytes_per_pool()
        return EngineStats(
            steps=self._steps,
            fused_decode_calls=self._fused_calls,
            failed_steps=self._failed_steps,
            prompt_tokens=self._prompt_tokens,
            generated_tokens=self._generated,
            prefill_tokens_computed=self._prefill_computed,
            elapsed_s=self._elapsed,
            device_s=self.runner.device_seconds,
            compile_s=sum(p.compile_seconds for p in programs),
            compilations=sum(p.num_compilations for p in programs),
            programs_loaded=sum(p.num_loaded for p in programs),
            compiled_programs=sum(len(p) for p in programs),
            stand_in_steps=self.runner.programs.stand_in_steps,
            warmup_s=self._warmup_s,
            **({} if self.speculator is None else self.speculator.stats()),
            **({} if self.runner.image_features is None else dict(
                images_encoded=self.runner.image_features.num_encoded, encoder_s=self.runner.image_features.seconds)),
            indexer_ties=self.runner.indexer_ties,
            **({} if self.runner.host_blocks is None else dict(
                host_bytes_stored=self.runner.host_blocks.bytes_stored,
                host_bytes_loaded=self.runner.host_blocks.bytes_loaded, host_move_s=self.runner.host_blocks.seconds)),
            **({} if not self.disk_tiers else dict(
                disk_bytes_read=sum(d.bytes_read for d in self.disk_tiers if d is not None),
                disk_bytes_written=sum(d.bytes_written for d in self.disk_tiers if d is not None),
                disk_s=sum(d.seconds for d in self.disk_tiers if d is not None))),
            scheduler=self.scheduler.stats(),
            tensor_parallel_size=1 if self.runner.mesh is None else self.runner.mesh.size,
            kv_cache_bytes_per_device=self.runner.kv_cache.nbytes_per_device,
            kv_dtype=self.cache_config.resolve_kv_dtype(self.model_spec),
            kv_bytes_per_token=layout.group_pools.count(0) * pool_bytes[0] // self.cache_config.block_size,
            kv_bytes_per_block=pool_bytes[0],
            kv_groups=tuple(layout.group_name(g) for g in range(layout.num_groups)),
            kv_group_block_bytes=tuple(pool_bytes[p] for p in layout.group_pools),
        )

    def stats_dict(self) -> dict:
        """`stats()` as nested plain data (JSON-ready), derived rates included."""
        return stats_dict(self.stats())


def token_list(request_id: str, prompt_token_ids) -> list[int]:
    """Token ids as Python ints; InvalidType (a TypeError, param "prompt") for anything that is not an integer
    (floats, bools, strings)."""
    if isinstance(prompt_token_ids, (str, bytes)):
        raise InvalidType(f"request {request_id!r}: prompt_token_ids must be a sequence of ints, got "
                          f"{type(prompt_token_ids).__name__}", param="prompt")
    tokens = list(prompt_token_ids)
    bad = [t for t in tokens if not is_int(t)]
    if bad:
        raise InvalidType(f"request {request_id!r}: prompt_token_ids must be ints, got {bad[:3]!r}", param="prompt")
    return [int(t) for t in tokens]


def _widest_tokens(shapes) -> int:
    """The most tokens of the warm-up's ragged steps (`_warmup_shapes`): the most hidden states a step hands the MTP
    head."""
    return max(s.tokens for s in shapes if isinstance(s, StepShape))
