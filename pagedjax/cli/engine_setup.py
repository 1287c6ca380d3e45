"""The model and the engine a run uses, and the check that the KV pool fits in memory before it is allocated."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

from pagedjax.cli.args import LORA_FIELDS, SPECULATIVE_FLAGS
from pagedjax.cli.errors import CLIError
from pagedjax.cli.sizes import format_size
from pagedjax.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from pagedjax.config.lora import LoRAConfig
from pagedjax.config.parallel import ParallelConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CLIModel:
    """The model a run serves: a built-in one (`model_config` and its `params`) or one of `--model-class`
    (`model`); its `spec` and the tokenizer either way."""

    spec: Any  # pagedjax.ModelSpec
    tokenizer: Any
    model_config: Any = None  # ModelConfig of a built-in model
    params: Any = None  # its nnx.State
    model: Any = None  # a --model-class model (pagedjax.model.api)
    num_params: int = 0  # the parameters (`StoredParams.num_params`: quantization scales not counted)

    def engine_args(self) -> dict:
        """`LLMEngine`'s model arguments."""
        if self.model is not None:
            return {"model": self.model}
        return {"model_config": self.model_config, "params": self.params}

    def without_weights(self) -> CLIModel:
        """This model's description with its weights dropped, for after the engine took them: the engine may
        hold them in another form (a mixture-of-experts model's experts per expert on one CPU device), which a
        reference kept here would double."""
        return dataclasses.replace(self, params=None, model=None)


def cli_model(spec, tokenizer, **weights) -> CLIModel:
    """A `CLIModel` of `weights` (model_config and params, or model), its parameter count taken now."""
    from flax import nnx

    from pagedjax.engine.summary import StoredParams

    state = weights["params"] if weights.get("model") is None else nnx.state(weights["model"], nnx.Param)
    return CLIModel(spec, tokenizer, **weights, num_params=StoredParams.of(state).num_params)


def load_model_for_cli(args: argparse.Namespace) -> CLIModel:
    """The model `--model` / `--model-class` / `--dtype` name: a `--model-class` factory's, the factory
    registered for the `--model` folder's `model_type` (`pagedjax.ModelRegistry`), or `load_pretrained_for_cli`.
    A factory that returns no tokenizer gets the `--model` folder's tokenizer.json, if it has one."""
    if getattr(args, "model_class", None) is None:
        registered = load_registered_for_cli(args.model, args.dtype)
        if registered is not None:
            return _own_model(args, *registered, f"--model {args.model} (a registered model_type)",
                              "return (model, tokenizer) from the registered factory, or put tokenizer.json in "
                              "the folder")
        cfg, params, tokenizer = load_pretrained_for_cli(args.model, args.dtype,
                                                         getattr(args, "tensor_parallel_size", 1),
                                                         getattr(args, "quantization", None))
        return cli_model(cfg.spec, tokenizer, model_config=cfg, params=params)
    if args.dtype is not None:
        raise CLIError("--dtype applies to the built-in models; a --model-class factory chooses its own dtype")
    model, tokenizer = load_model_class(args.model_class, args.model)
    if tokenizer is None and args.model is not None:  # as for a registered factory: the folder's tokenizer.json
        from pagedjax.model.loading.loader import folder_tokenizer_for

        tokenizer = folder_tokenizer_for(args.model, model)
    return _own_model(args, model, tokenizer, f"--model-class {args.model_class}",
                      "return (model, tokenizer) from the factory, or put tokenizer.json in the --model folder")


def _own_model(args: argparse.Namespace, model, tokenizer, where: str, tokenizer_hint: str) -> CLIModel:
    """A model of the public contract (a --model-class or registered factory's), quantized with
    --quantization; CLIError naming `where` if its spec is malformed or it has no tokenizer for text prompts."""
    if getattr(args, "quantization", None) is not None:  # the factory's nnx.Linear layers
        from pagedjax.model.layers.quant import quantize_model

        try:
            quantize_model(model, args.quantization)
        except ValueError as e:
            raise CLIError(f"--quantization {args.quantization.name}: {e}") from None
    from pagedjax.model.api import model_spec

    try:  # the spec's types only: the engine traces the whole contract (check_model) when it is built
        spec = model_spec(model)
    except TypeError as e:
        raise CLIError(f"{where}: {e}") from None
    if tokenizer is None:
        raise CLIError(f"{where} gave no tokenizer: {tokenizer_hint} for text prompts")
    return cli_model(spec, tokenizer, model=model)


def load_registered_for_cli(path: str | None, dtype: str | None):
    """`(model, tokenizer or None)` by the factory registered for the `--model` folder's `model_type`
    (`pagedjax.model.loading.loader.load_registered`), None for a folder of no registered type. The factory's
    failure is a CLIError naming the folder (its traceback logged at debug level)."""
    from pagedjax.model.loading.loader import ModelLoadError, load_registered

    try:
        return load_registered(path, dtype)
    except ModelLoadError as e:  # an unreadable config.json: the built-in loader would say the same
        raise CLIError(f"cannot load the model: {e}") from None
    except Exception as e:  # noqa: BLE001 - the user's factory: its failure is reported, its traceback logged
        logger.debug("the factory registered for --model %s failed", path, exc_info=True)
        raise CLIError(f"--model {path}: its registered factory raised {type(e).__name__}: {e}") from None


def load_model_class(target: str, path: str | None):
    """`MODULE:FACTORY` (the module importable: installed, on PYTHONPATH, or in the current folder) called with
    `path` (--model, or None) -> (model, tokenizer or None). CLIError naming what is wrong."""
    import importlib

    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise CLIError(f"--model-class must be MODULE:FACTORY (e.g. mypkg.gpt2:load), got {target!r}")
    # As `python -m` does: the current folder first on sys.path. A console script (`pagedjax-serve`) starts with
    # its own bin folder there instead, so `mymodule:load` next to the user was not found. It stays there: the
    # factory may import its own siblings later.
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        factory = importlib.import_module(module_name)
        for part in attr.split("."):
            factory = getattr(factory, part)
    except ModuleNotFoundError as e:
        raise CLIError(f"--model-class {target}: no module {e.name!r} (install it, put it on PYTHONPATH or run "
                       "from its folder)") from None
    except AttributeError:
        raise CLIError(f"--model-class {target}: module {module_name!r} has no {attr!r}") from None
    if not callable(factory):
        raise CLIError(f"--model-class {target}: {attr!r} is not callable")
    try:
        result = factory(path)
    except Exception as e:  # noqa: BLE001 - the user's code: its failure is reported, its traceback logged
        logger.debug("--model-class %s failed", target, exc_info=True)
        raise CLIError(f"--model-class {target}({path!r}) raised {type(e).__name__}: {e}") from None
    return result if isinstance(result, tuple) and len(result) == 2 else (result, None)


def load_pretrained_for_cli(path: str | None, dtype: str | None, tensor_parallel_size: int = 1,
                            quantization=None):
    """(ModelConfig, params, tokenizer) through the project's loader; CLIError (one line naming the file) if
    the model cannot be loaded or has no tokenizer for text prompts. With `tensor_parallel_size` > 1 the weights
    are read straight into their shards (each device receives only its slice)."""
    from pagedjax.model.loading.loader import ModelLoadError, load_pretrained

    where = path or "the bundled model"
    mesh = None
    if tensor_parallel_size > 1:
        import jax

        from pagedjax.parallel import ParallelConfig, replica_meshes

        check_device_count(tensor_parallel_size)
        mesh = replica_meshes(ParallelConfig(tensor_parallel_size=tensor_parallel_size), jax.devices())[0]
    try:
        cfg, params, tokenizer = load_pretrained(path, dtype=dtype, mesh=mesh, quantization=quantization)
    except ModelLoadError as e:
        raise CLIError(f"cannot load the model: {e}") from None
    except OSError as e:
        raise CLIError(f"cannot load {where}: {e.strerror or e}" + (f": {e.filename}" if e.filename else "")) \
            from None
    except (TypeError, ValueError) as e:
        raise CLIError(f"cannot load {where}: {' '.join(str(e).split())}") from None
    if tokenizer is None:
        raise CLIError(f"{where} has no tokenizer pagedjax can use for text prompts (tokenizer.json, or the "
                       "byte-level vocabulary)")
    return cfg, params, tokenizer


def check_device_count(tensor_parallel_size: int, data_parallel_size: int = 1) -> None:
    """CLIError unless there are `tensor_parallel_size` x `data_parallel_size` devices."""
    import jax

    need = tensor_parallel_size * data_parallel_size
    if len(jax.devices()) < need:
        asked = f"--tensor-parallel-size {tensor_parallel_size}"
        if data_parallel_size > 1:
            asked = f"{asked} x --data-parallel-size {data_parallel_size} = {need} devices"
        raise CLIError(f"{asked}: only {len(jax.devices())} {jax.default_backend()} device(s); on CPU set "
                       "XLA_FLAGS=--xla_force_host_platform_device_count=N")


def memory_available(device) -> tuple[int, str] | None:
    """(bytes free for new arrays on `device`, what that is) or None when unknown. Accelerators report their
    allocator's limit through `memory_stats()`; on the CPU it is the machine's available memory."""
    try:
        mem = device.memory_stats()
    except Exception:  # noqa: BLE001 - not every backend implements it
        mem = None
    if mem and mem.get("bytes_limit"):
        limit = int(mem["bytes_limit"])
        return limit - int(mem.get("bytes_in_use", 0)), f"{device.platform} device memory ({format_size(limit)})"
    if device.platform != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return kib * 1024, "available host memory"
    except (OSError, StopIteration, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host memory"
    except (AttributeError, OSError, ValueError):
        return None


def check_kv_pool_fits(cache_config, spec, device, tensor_parallel_size: int = 1) -> None:
    """CLIError if the KV pool the cache config asks for is bigger than the device's free memory (checked
    before allocating: allocating it would fail with RESOURCE_EXHAUSTED, or get the process killed). With
    tensor parallelism the pool is counted per device: the KV heads one device holds."""
    if tensor_parallel_size > 1:
        from pagedjax.parallel.sharding import per_device_model

        spec = per_device_model(spec, tensor_parallel_size)
    try:
        num_blocks = cache_config.resolve_num_blocks(spec)
    except ValueError as e:
        raise CLIError(f"--kv-memory: {e}") from None
    block_bytes = cache_config.block_bytes(spec)
    need = num_blocks * block_bytes
    available = memory_available(device)
    if available is not None and need > available[0]:
        free, what = available
        raise CLIError(f"a KV pool of {num_blocks:,} blocks x {format_size(block_bytes)} = {format_size(need)} "
                       f"does not fit in the {what}: {format_size(max(free, 0))} free; lower --kv-memory or "
                       "--num-blocks")


# The --speculative-* flags' argparse names -> SpeculativeConfig's fields, and --max-*lora* -> LoRAConfig's.
_SPECULATIVE_FLAGS = {flag[2:].replace("-", "_"): field for field, flag, _, _ in SPECULATIVE_FLAGS}
_LORA_FLAGS = {field: "--" + field.replace("_", "-") for field in LORA_FIELDS}


def speculative_config_of(args: argparse.Namespace):
    """The `SpeculativeConfig` of the --speculative-* flags (None without --speculative-method; CLIError for a
    --speculative-* flag given without it)."""
    given = {field: getattr(args, flag) for flag, field in _SPECULATIVE_FLAGS.items()
             if getattr(args, flag) is not None}
    if args.speculative_method is None:
        if given:
            flag = next(f for f, field in _SPECULATIVE_FLAGS.items() if field in given)
            raise CLIError(f"--{flag.replace('_', '-')} needs --speculative-method")
        return None
    # The one combination SpeculativeConfig refuses in its own field names, said here in the flags' names.
    if args.speculative_method == "draft" and "draft_model" not in given:
        raise CLIError("--speculative-method draft needs --speculative-draft-model PATH")
    if args.speculative_method == "ngram" and "draft_model" in given:
        raise CLIError("--speculative-draft-model applies to --speculative-method draft and mtp, not ngram")
    return SpeculativeConfig(method=args.speculative_method, **given)


# What the engine's errors call the things the --speculative-* flags set (a draft model that does not load, or
# does not fit the target): in a CLI message, the flag stands for the Python name.
_SPECULATIVE_NAMES = {"SpeculativeConfig(method='draft')": "--speculative-method draft",
                      "SpeculativeConfig(method='mtp')": "--speculative-method mtp",
                      **{f"SpeculativeConfig.{field}": f"--{flag.replace('_', '-')}"
                         for flag, field in _SPECULATIVE_FLAGS.items()},
                      **{f"LoRAConfig.{field}": flag for field, flag in _LORA_FLAGS.items()}}


def in_flags(message: str) -> str:
    """An engine error's message with the speculative and LoRA fields it names replaced by their flags."""
    for name, flag in _SPECULATIVE_NAMES.items():
        message = message.replace(name, flag)
    return message


def sampling_defaults_of(args: argparse.Namespace):
    """The engine's `SamplingDefaults`: the --model folder's generation_config.json (the bundled model's without
    --model) over vLLM's defaults; vLLM's alone for a --model-class model without --model (it has no folder).
    ValueError naming the file for a bad one. The sampling flags left unset are these (`SamplingParams` None)."""
    from pagedjax.config.sampling import SamplingDefaults
    from pagedjax.model.loading.generation_config import folder_sampling_defaults

    if getattr(args, "model_class", None) is not None and args.model is None:
        return SamplingDefaults()
    return folder_sampling_defaults(args.model)


def pooling_defaults_of(args: argparse.Namespace):
    """The engine's `PoolingDefaults`: the --model folder's sentence-transformers modules (the default for decoder
    models without them, and for a --model-class model without --model)."""
    from pagedjax.config.pooling import PoolingDefaults
    from pagedjax.model.loading.pooling_config import folder_pooling_defaults

    if getattr(args, "model_class", None) is not None and args.model is None:
        return PoolingDefaults()
    return folder_pooling_defaults(args.model)


def classifier_of(args: argparse.Namespace, loaded: CLIModel):
    """The engine's classifier: a --model `*ForSequenceClassification` folder's head, or --classifier-from-tokens'
    two tokens' LM-head rows (`pagedjax.model.loading.hf_classifier`); None otherwise. CLIError naming the problem."""
    from pagedjax.model.loading.hf_classifier import engine_classifier

    try:
        return engine_classifier(args.model, loaded.model_config, loaded.params, loaded.tokenizer,
                                 getattr(args, "classifier_from_tokens", None))
    except ValueError as e:
        raise CLIError(f"cannot load the classifier: {e}") from None


def lora_config_of(args: argparse.Namespace) -> LoRAConfig | None:
    """The `LoRAConfig` of `add_lora_options`' flags (None for a front end without them, or without
    --enable-lora); CLIError for a --max-*lora* flag given without --enable-lora."""
    if not getattr(args, "enable_lora", False):
        given = [flag for name, flag in _LORA_FLAGS.items() if getattr(args, name, None) is not None]
        if given:
            raise CLIError(f"{given[0]} needs --enable-lora")
        return None
    return LoRAConfig(**{name: getattr(args, name) for name in _LORA_FLAGS if getattr(args, name) is not None})


def engine_config_of(args: argparse.Namespace, compile_cache: bool | str = True, structured_limits=None,
                     sampling_defaults=None) -> EngineConfig:
    """The `EngineConfig` of the engine flags (`pagedjax.cli.args.add_engine_options`, `add_lora_options`): every
    option the flags leave unset is the field's default, as in Python. compile_cache: the CLI sets JAX's cache up
    itself (`pagedjax.cli.warm_start`). structured_limits / sampling_defaults: None: the defaults / the --model
    folder's (`sampling_defaults_of`). CLIError for flags the configs refuse."""
    from pagedjax.config.structured import StructuredLimits

    tp, dp = args.tensor_parallel_size, args.data_parallel_size
    try:
        return EngineConfig(
            cache_config=CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                                     kv_memory_bytes=args.kv_memory, kv_host_memory_bytes=args.kv_host_memory,
                                     kv_disk_dir=args.kv_disk_dir, kv_disk_bytes=args.kv_disk_bytes,
                                     enable_prefix_caching=args.enable_prefix_caching, kv_dtype=args.kv_dtype),
            # max_model_len None: the model's max_position_embeddings, resolved by the engine as in Python, so
            # one model has one context length in Python, pagedjax-generate and pagedjax-serve.
            scheduler_config=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                             max_num_batched_tokens=args.max_num_batched_tokens,
                                             max_model_len=args.max_model_len),
            parallel_config=None if tp * dp == 1 else ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp),
            speculative_config=speculative_config_of(args), backend=args.backend,
            decode_steps_per_call=args.decode_steps_per_call, seed=args.seed, compile_cache=compile_cache,
            max_compiled_programs=args.max_compiled_programs,
            # Warmed-up programs stand in while a step's own compiles (the server's way): no stream stalls on a
            # compile; without warm-up, each step waits for its own program. Across processes each step's program
            # must be the same on all: compiled in the step (the warm-up then compiles in the foreground).
            compile_in_background=args.warmup and args.processes == 1,
            structured_limits=StructuredLimits() if structured_limits is None else structured_limits,
            sampling_defaults=sampling_defaults_of(args) if sampling_defaults is None else sampling_defaults,
            lora_config=lora_config_of(args), pooling_defaults=pooling_defaults_of(args))
    except (TypeError, ValueError) as e:
        raise CLIError(in_flags(str(e))) from None


def build_engine(args: argparse.Namespace, loaded: CLIModel, compile_cache: bool | str = True,
                 structured_limits=None):
    """The engine the arguments describe (`engine_config_of`; a `DataParallelEngine` with --data-parallel-size
    > 1), its KV pool checked against the device's memory first; with --warmup it compiles in the background (its
    caller warms it up: `LLMEngine.warmup`, or the server's `start_warmup`, once everything else is checked)."""
    import jax

    from pagedjax.engine import make_engine
    from pagedjax.model.loading.loader import folder_image_processor, folder_mtp_head

    config = engine_config_of(args, compile_cache, structured_limits)
    # --speculative-method mtp without --speculative-draft-model: the --model folder's own head (mtp/)
    config = config.replace(speculative_config=folder_mtp_head(args.model, config.speculative_config))
    if config.parallel_config is not None:
        check_device_count(args.tensor_parallel_size, args.data_parallel_size)
    check_kv_pool_fits(config.cache_config, loaded.spec, jax.local_devices()[0], args.tensor_parallel_size)
    classifier = classifier_of(args, loaded)
    weights = loaded.engine_args()
    # A vision-language --model folder's image processor (pagedjax-generate's --image, pagedjax-serve's image parts).
    image_processor = None if args.model is None else folder_image_processor(args.model, weights)
    try:
        return make_engine(config.replace(model_config=weights.pop("model_config", None)), **weights,
                           tokenizer=loaded.tokenizer, image_processor=image_processor, classifier=classifier)
    except (TypeError, ValueError, FileNotFoundError) as e:  # FileNotFoundError: a missing draft model folder
        raise CLIError(in_flags(str(e))) from None
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise CLIError(f"out of device memory building the engine (KV pool of "
                       f"{config.cache_config.pool_bytes(loaded.spec):,} "
                       "bytes); lower --kv-memory or --num-blocks") from None
