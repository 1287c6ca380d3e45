"""pagedjax model folders: an orbax checkpoint of the parameters plus the model's config as JSON.

    path/
      pagedjax_config.json   {"format": "pagedjax", "format_version": 1 or 2, "model_config": {...}, "extra": {...}}
      params/                orbax (StandardCheckpointer) of the `Llama` parameters as a plain nested dict
      tokenizer.json         optional: the model's `tokenizers` vocabulary (without it, a model whose vocab_size
                             is 259 uses pagedjax's ByteTokenizer)

Loading restores into explicit abstract targets built from the stored config, so every parameter's presence,
shape and dtype is checked against the model the config describes, and arrays land on the local default device
whatever machine wrote them. Anything wrong with the folder's contents (invalid JSON, a config field of the
wrong type, a truncated or corrupted params file, parameters that do not match the config) is a
`ModelLoadError` (a ValueError) whose one-line message names the file and the field or parameter.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import shutil
import sys
import time
import types
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from pagedjax.config import ModelConfig
from pagedjax.config.fields import dtype_bytes
from pagedjax.model.errors import ModelLoadError, read_json
from pagedjax.model.layers.moe_quant import quantizes_experts
from pagedjax.model.llama import Llama, abstract_model, model_from_state

logger = logging.getLogger(__name__)

CONFIG_FILE = "pagedjax_config.json"
PARAMS_DIR = "params"
TOKENIZER_FILE = "tokenizer.json"
FORMAT = "pagedjax"
# 2: quantized kernels are stored `[out, ...]` (`pagedjax.model.layers.quant`); version 1 stored them `[in, out]`, which
# would restore into the new shapes silently wrong (square int8 / fp8 kernels, every int4 one). Float checkpoints
# are the same in both and are written as version 1, so that every pagedjax reads them.
# 3: a quantized mixture-of-experts model's experts are stored quantized (`pagedjax.model.layers.moe_quant`); versions 2
# and below held them float whatever `keep_float` said, and are read so (their keep_float gains "experts"). Only
# such models are written as version 3.
FORMAT_VERSION = 3
QUANTIZED_FORMAT_VERSION = 2
QUANTIZED_EXPERTS_FORMAT_VERSION = 3


def bundled_model_path() -> Path:
    """The default model shipped inside the package (`pagedjax/assets/tiny/`)."""
    return Path(__file__).resolve().parents[2] / "assets" / "tiny"


def is_pagedjax_checkpoint(path: str | os.PathLike) -> bool:
    """True if `path` is a folder written by `save_checkpoint` (config JSON + orbax params)."""
    path = Path(path)
    try:
        if not ((path / CONFIG_FILE).is_file() and (path / PARAMS_DIR).is_dir()):
            return False
        meta = json.loads((path / CONFIG_FILE).read_text())
        return isinstance(meta, dict) and meta.get("format") == FORMAT and "model_config" in meta
    except (OSError, ValueError):
        return False


def read_checkpoint_metadata(path: str | os.PathLike) -> dict:
    """The parsed `pagedjax_config.json` of a checkpoint folder (config, format version, extra info).

    Raises FileNotFoundError for a missing folder and ModelLoadError naming the file for anything else."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    cfg_file = path / CONFIG_FILE
    if not cfg_file.is_file():
        raise ModelLoadError(path, f"not a pagedjax checkpoint: {CONFIG_FILE} is missing")
    meta = read_json(cfg_file)
    if meta.get("format") != FORMAT:
        raise ModelLoadError(cfg_file, f"does not describe a pagedjax checkpoint (no \"format\": \"{FORMAT}\")")
    if not isinstance(meta.get("model_config"), dict):
        raise ModelLoadError(cfg_file, f"field 'model_config': expected an object, got {meta.get('model_config')!r}")
    version = meta.get("format_version", 1)
    if isinstance(version, bool) or not isinstance(version, int):
        raise ModelLoadError(cfg_file, f"field 'format_version': expected an int, got {version!r}")
    if version > FORMAT_VERSION:
        raise ModelLoadError(path, f"checkpoint format version {version}; this pagedjax reads up to "
                                   f"{FORMAT_VERSION} (upgrade pagedjax)")
    return meta


def _model_config(meta: dict, cfg_file: Path) -> ModelConfig:
    """`ModelConfig` from the metadata's "model_config", errors naming the file and field."""
    try:
        return ModelConfig.from_dict(meta["model_config"])
    except (TypeError, ValueError) as e:
        raise ModelLoadError(cfg_file, f"field 'model_config': {e}") from None


def _is_orbax_leftover(unraisable) -> bool:
    obj, exc = unraisable.object, unraisable.exc_value
    if isinstance(obj, types.CoroutineType):
        return "orbax" in obj.cr_code.co_filename
    return isinstance(exc, RuntimeError) and "Event loop is closed" in str(exc)


def _orbax_coroutines_alive() -> bool:
    return any(isinstance(o, types.CoroutineType) and "orbax" in o.cr_code.co_filename for o in gc.get_objects())


@contextmanager
def _orbax_failure_noise_suppressed(max_wait_s: float = 5.0) -> Iterator[list]:
    """Around an orbax restore: if it fails (the body appends to the yielded list), keep quiet what it leaves.

    When one array cannot be read, orbax abandons the other reads: their tensorstore futures complete later
    (then calling into a closed asyncio loop: "Event loop is closed") and their coroutines, once collected,
    turn GeneratorExit into an Exception (orbax catches BaseException). Python reports each as an
    "Exception ignored in ..." traceback on stderr, after the real error has been reported (at the latest
    when the interpreter exits). On failure this waits (at most `max_wait_s`) until the abandoned reads have
    finished and been collected, and logs those reports at debug level instead of printing them."""
    failed: list = []
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        if _is_orbax_leftover(unraisable):
            logger.debug("after a failed restore: %s in %r", unraisable.exc_type.__name__, unraisable.object)
            return
        previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield failed
        if failed:
            deadline = time.monotonic() + max_wait_s
            gc.collect()
            while _orbax_coroutines_alive() and time.monotonic() < deadline:
                time.sleep(0.02)
                gc.collect()
    finally:
        sys.unraisablehook = previous


def _innermost_message(e: BaseException) -> str:
    """The message of the deepest cause of `e` (tensorstore wraps the useful line in pages of spec)."""
    seen = set()
    while (e.__cause__ or e.__context__) is not None and id(e) not in seen:
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 400 else text[:400] + " ..."


# ----------------------------------------------------------------------------------------------- helpers
def _state_to_pure_dict(state: nnx.State) -> dict:
    fn = getattr(nnx, "to_pure_dict", None)  # newer flax; older flax has only the State method
    return fn(state) if fn is not None else state.to_pure_dict()


def _state_replace_by_pure_dict(state: nnx.State, pure: dict) -> None:
    fn = getattr(nnx, "replace_by_pure_dict", None)
    if fn is not None:
        fn(state, pure)
    else:
        state.replace_by_pure_dict(pure)


def _to_pure_dict(state: Any) -> dict:
    """nnx.State / Llama module / nested dict -> a plain nested dict of arrays."""
    if isinstance(state, nnx.Module):
        state = nnx.state(state, nnx.Param)
    if isinstance(state, nnx.State):
        return _state_to_pure_dict(state)
    if isinstance(state, dict):
        return state
    raise TypeError(f"expected an nnx.State, a Llama module or a dict of arrays, got {type(state).__name__}")


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> {"layers.0.mlp.up_proj.kernel": leaf}; keys (ints too) become strings."""
    if isinstance(tree, dict) or hasattr(tree, "items") and not hasattr(tree, "shape"):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def _abstract_state(cfg: ModelConfig) -> nnx.State:
    """The parameter state of `Llama(cfg)` with `jax.ShapeDtypeStruct` leaves; nothing is allocated."""
    return nnx.state(abstract_model(cfg), nnx.Param)


def _check_tree(expected: dict[str, Any], found: dict[str, Any], where: Path, what: str) -> None:
    """Same parameter names, shapes and (where known) dtypes, else a ModelLoadError naming the differences."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    problems = []
    if missing:
        problems.append(f"missing parameters {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        problems.append(f"unexpected parameters {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    for name in sorted(set(expected) & set(found)):
        e, f = expected[name], found[name]
        f_shape = getattr(f, "shape", None)
        if f_shape is not None and tuple(f_shape) != tuple(e.shape):
            problems.append(f"{name}: shape {tuple(f_shape)}, expected {tuple(e.shape)}")
        f_dtype = getattr(f, "dtype", None)
        if f_dtype is not None:
            try:
                same = jnp.dtype(f_dtype) == jnp.dtype(e.dtype)
            except TypeError:
                same = True  # an unrecognised metadata dtype: leave it to the restore
            if not same:
                problems.append(f"{name}: dtype {jnp.dtype(f_dtype).name}, expected {jnp.dtype(e.dtype).name}")
    if problems:
        shown = "; ".join(problems[:12]) + (" ..." if len(problems) > 12 else "")
        raise ModelLoadError(where, f"{what}: {shown}")


def _stored_tree(ckptr: ocp.StandardCheckpointer, params_dir: Path) -> dict | None:
    """The stored parameter metadata (names, shapes, dtypes) as a nested dict, or None if unavailable.

    orbax's `metadata()` has returned the tree itself in older versions and a `StepMetadata` whose
    `item_metadata(.tree)` holds it in newer ones; both are accepted.
    """
    try:
        md = ckptr.metadata(params_dir)
    except Exception as e:  # noqa: BLE001 - a best-effort check; the restore itself still validates shapes
        logger.debug("no orbax metadata for %s: %s", params_dir, e)
        return None
    md = getattr(md, "item_metadata", md)
    md = getattr(md, "tree", md)
    return md if isinstance(md, dict) else None


# ------------------------------------------------------------------------------------------- save / load
def save_checkpoint(path: str | os.PathLike, cfg: ModelConfig, state: nnx.State | Llama | dict, *,
                    extra: dict | None = None) -> Path:
    """Write `cfg` and the parameters `state` to the folder `path` (created; an older checkpoint there is
    replaced). `extra` is any JSON-serialisable information kept beside the config (training details...).

    The parameters must be those of `Llama(cfg)`: names, shapes and dtypes are checked before writing.
    """
    path = Path(path).absolute()
    pure = _to_pure_dict(state)
    expected = _flatten(_state_to_pure_dict(_abstract_state(cfg)))
    _check_tree(expected, _flatten(pure), path, f"parameters do not match the model config {cfg}")
    meta = {
        "format": FORMAT,
        "format_version": _format_version(cfg),
        "model_config": cfg.to_dict(),
        "num_params": int(sum(int(np.prod(v.shape)) for v in expected.values())),
        "extra": extra or {},
    }
    json.dumps(meta)  # fail before touching the folder if `extra` is not JSON-serialisable
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_FILE).unlink(missing_ok=True)  # the folder is no checkpoint until both parts are written
    params_dir = path / PARAMS_DIR
    if params_dir.exists():
        shutil.rmtree(params_dir)
    # Host copies: the caller's arrays stay untouched (and may be donated to a training step meanwhile).
    host = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), pure)
    ckptr = ocp.StandardCheckpointer()
    try:
        ckptr.save(params_dir, host)
        ckptr.wait_until_finished()
    finally:
        ckptr.close()
    # Written beside, then renamed over: a reader never sees half a config. Created with open(), not mkstemp
    # (0600): the config gets the mode the user's umask gives new files, like the weights orbax wrote.
    tmp = path / f".config-{uuid.uuid4().hex}.json"
    try:
        with open(tmp, "x") as f:
            json.dump(meta, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path / CONFIG_FILE)
    finally:
        tmp.unlink(missing_ok=True)  # a failed write leaves no stray file (after the rename it is gone already)
    return path


def _format_version(cfg: ModelConfig) -> int:
    """The oldest format version that holds `cfg`'s parameters as stored (every pagedjax since reads it)."""
    if cfg.quantization is None:
        return 1
    return QUANTIZED_EXPERTS_FORMAT_VERSION if cfg.moe is not None and quantizes_experts(cfg.quantization) else \
        QUANTIZED_FORMAT_VERSION


def load_checkpoint(path: str | os.PathLike, dtype: str | None = None, *,
                    mesh: jax.sharding.Mesh | None = None) -> tuple[ModelConfig, nnx.State]:
    """Read a folder written by `save_checkpoint`: `(ModelConfig, nnx.State of Llama's parameters)`.

    With a tensor-parallel `mesh` (`pagedjax.parallel`), each parameter is restored straight into its shards:
    orbax reads each device's slice onto that device (no device, and no host buffer, holds a whole sharded
    tensor).

    `dtype` ("float32" | "bfloat16" | "float16") casts the parameters after loading and is recorded in
    the returned config; None keeps the stored dtype. Raises FileNotFoundError for a missing folder and
    ModelLoadError (a ValueError) for anything that is not a matching, readable pagedjax checkpoint.
    """
    path = Path(path).absolute()
    meta = read_checkpoint_metadata(path)
    cfg = _model_config(meta, path / CONFIG_FILE)
    if cfg.quantization is not None and meta.get("format_version", 1) < QUANTIZED_FORMAT_VERSION:
        raise ModelLoadError(path, "a quantized checkpoint of format version 1 stores its kernels [in, out], which "
                                   "this pagedjax no longer reads: quantize the float checkpoint again "
                                   "(LLMEngine.from_pretrained(..., quantization=...), --quantization)")
    if meta.get("format_version", 1) < QUANTIZED_EXPERTS_FORMAT_VERSION and cfg.moe is not None and \
            quantizes_experts(cfg.quantization):  # written before experts were quantized: they are float
        cfg = cfg.replace(quantization=dataclasses.replace(cfg.quantization,
                                                           keep_float=(*cfg.quantization.keep_float, "experts")))
    params_dir = path / PARAMS_DIR
    if not params_dir.is_dir():
        raise ModelLoadError(path, f"not a pagedjax checkpoint: {PARAMS_DIR}/ is missing")
    if dtype is not None:
        dtype_bytes(dtype)  # validates the name

    abstract = _abstract_state(cfg)
    if mesh is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                              _state_to_pure_dict(abstract))
    else:
        from pagedjax.parallel.sharding import key_names, param_sharding_fn

        where = param_sharding_fn(cfg, mesh)
        target = jax.tree_util.tree_map_with_path(
            lambda kp, s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where(key_names(kp))),
            _state_to_pure_dict(abstract))
    expected = _flatten(target)
    ckptr = ocp.StandardCheckpointer()
    problem = None
    # The checkpointer is closed before a failed restore's wait (`_orbax_failure_noise_suppressed`): open, it held
    # the abandoned reads of an emptied data file for the whole wait.
    with _orbax_failure_noise_suppressed() as failed:
        try:
            stored = _stored_tree(ckptr, params_dir)
            if stored is not None:
                _check_tree(expected, _flatten(stored), params_dir, f"parameters do not match {CONFIG_FILE}")
            try:
                restored = ckptr.restore(params_dir, target)
            except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise bare Exceptions for unreadable data
                problem = _innermost_message(e)  # not chained: the exception holds orbax's abandoned reads
                failed.append(problem)
        finally:
            ckptr.close()
    if problem is not None:
        raise ModelLoadError(params_dir, f"cannot read the parameters (truncated or corrupted checkpoint?): "
                                         f"{problem}")
    _check_tree(expected, _flatten(restored), params_dir, "parameters restored wrongly")

    state = abstract
    _state_replace_by_pure_dict(state, restored)
    if dtype is not None and jnp.dtype(dtype) != jnp.dtype(cfg.dtype):
        # Quantized weights and their scales keep their storage dtypes (`pagedjax.model.layers.quant`).
        state = jax.tree_util.tree_map_with_path(
            lambda kp, x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) and not _is_quantized(kp) else x,
            state)
        cfg = cfg.replace(dtype=dtype)
    return cfg, state


def _is_quantized(keypath) -> bool:
    """Whether a state leaf is a `QuantizedLinear`'s stored weight or scale."""
    return any(getattr(k, "key", None) in ("qweight", "scale") for k in keypath)


def load_checkpoint_tokenizer(path: str | os.PathLike, cfg: ModelConfig):
    """The tokenizer of a checkpoint folder: an `HFTokenizer` over its tokenizer.json (BOS and EOS from `cfg`),
    else the `ByteTokenizer` when `cfg.vocab_size` is the byte vocabulary's, else None.

    A tokenizer.json that cannot be read, or whose ids do not fit the model, is a ModelLoadError naming it.
    """
    from pagedjax.model.tokenizer import ByteTokenizer

    file = Path(path) / TOKENIZER_FILE
    if not file.is_file():
        return ByteTokenizer() if cfg.vocab_size == ByteTokenizer.vocab_size else None
    from pagedjax.model.hf_tokenizer import HFTokenizer

    tok = HFTokenizer.from_file(file, eos_token_ids=cfg.eos_token_ids, bos_token_id=cfg.bos_token_id)
    if tok.vocab_size > cfg.vocab_size:
        raise ModelLoadError(file, f"a vocabulary of {tok.vocab_size} tokens does not fit the model's vocab_size "
                                   f"{cfg.vocab_size} ({CONFIG_FILE})")
    return tok


def load_model(path: str | os.PathLike | None = None, dtype: str | None = None) -> Llama:
    """A ready `Llama` module from a checkpoint folder (None: the bundled model)."""
    cfg, state = load_checkpoint(bundled_model_path() if path is None else path, dtype=dtype)
    return model_from_state(cfg, state)


__all__ = [
    "CONFIG_FILE",
    "PARAMS_DIR",
    "TOKENIZER_FILE",
    "bundled_model_path",
    "is_pagedjax_checkpoint",
    "load_checkpoint",
    "load_checkpoint_tokenizer",
    "load_model",
    "read_checkpoint_metadata",
    "save_checkpoint",
]
