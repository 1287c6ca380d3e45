"""Load a local Hugging Face model folder (Llama / Mistral / Qwen2 / Qwen3 / Phi-3 / OLMo 2 / Gemma 2 / Gemma 3
text / Mixtral / Qwen3-MoE / gpt-oss) into pagedjax. `fill_state` is the one safetensors reader under it and under
every family module's `load` (`pagedjax.model.families`: names, shapes and dtypes checked before any data is read;
block-scaled FP8 weights dequantized, `hf_fp8`), with `hf_names`, the Llama family's tensor names, which they
extend.

    cfg, params, tokenizer = load_hf("path/to/folder")           # config.json, *.safetensors, tokenizer.json
    engine = LLMEngine(model_config=cfg, params=params, tokenizer=tokenizer)

- `load_hf_config(path)` maps `config.json` (+ `generation_config.json` for EOS/BOS ids) to a `ModelConfig`,
  refusing (with a `ModelLoadError` naming the file and field) anything pagedjax cannot compute exactly: see
  `pagedjax.model.loading.hf_config`, where it lives (it is re-exported here).
- `load_hf_params(path, cfg)` reads the safetensors (one file, or shards listed in
  `model.safetensors.index.json`) tensor by tensor with the numpy API (no torch), transposes linear weights
  to pagedjax's `[in, out]` kernels, casts to `cfg.dtype` and fills an abstract `nnx.State` leaf by leaf, so
  that the host never holds a second full copy of the weights. Names and shapes are checked against the
  model before any tensor is read; missing, unexpected and mis-shaped tensors are errors naming the tensor, and
  a truncated or corrupted file is an error naming the file.

Parameter names of `pagedjax.model.llama.Llama` mirror `LlamaForCausalLM` (minus the `model.` prefix; with
the other families' norms, e.g. `Gemma2ForCausalLM`'s, under their names), so the name mapping is mechanical;
RoPE uses the same rotate-half convention, so q/k need no permutation, and Gemma's norm weights are stored as
offsets from 1 on both sides. Fused projections (Phi-3's `qkv_proj` and `gate_up_proj`, `_FUSED`) are split
along their output rows into the separate ones the model keeps. Mixture-of-experts checkpoints hold one tensor per
expert and projection (Qwen3-MoE's `mlp.experts.{e}.gate_proj.weight`, ...; Mixtral's
`block_sparse_moe.experts.{e}.w1/w3/w2.weight` and `block_sparse_moe.gate.weight`, read as aliases of those,
`_canonical`), as transformers' `save_pretrained` writes them: each goes into slice e of the model's stacked
`[E, width, hidden]` parameter (down_proj transposed, gate / up as stored), placed once all E slices are read.
gpt-oss names some tensors its own way and stores its experts stacked, gate and up interleaved in one tensor, in
MXFP4 in the released checkpoints: its family module gives the names (`gpt_oss.tensor_names`) and presents the
experts as the model holds them (`gpt_oss.ExpertTensors`, `fill_state`'s view: split, dequantized exactly).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pagedjax.config import ModelConfig
from pagedjax.model.classifier import HEAD, is_classifier
from pagedjax.model.errors import ModelLoadError, read_json
from pagedjax.model.families import gpt_oss
from pagedjax.model.llama import abstract_model, model_from_state  # noqa: F401  (model_from_state: re-export)
from pagedjax.model.loading import hf_fp8, hf_quant
from pagedjax.model.loading.hf_config import SUPPORTED_MODEL_TYPES, load_hf_config  # noqa: F401  (re-exports)
from pagedjax.model.loading.hf_quant import Codec

logger = logging.getLogger(__name__)

# Non-parameter tensors that some checkpoints carry and that pagedjax recomputes.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
# Fused Hugging Face projections -> the model's separate ones, stacked in this order along the output rows.
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# Mixtral's expert projections under the names of Qwen3-MoE's (and of the model's parameters).
_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _canonical(name: str) -> str:
    """A checkpoint tensor's name as the model's parameters spell it: Mixtral's `block_sparse_moe` is `mlp`, its
    experts' w1 / w3 / w2 are gate_proj / up_proj / down_proj; every other name is unchanged."""
    parts = name.split(".")
    if "block_sparse_moe" not in parts:
        return name
    i = parts.index("block_sparse_moe")
    parts[i] = "mlp"
    if len(parts) == i + 5 and parts[i + 1] == "experts" and parts[i + 3] in _MIXTRAL_EXPERT:
        parts[i + 3] = _MIXTRAL_EXPERT[parts[i + 3]]
    return ".".join(parts)


def hf_names(path: tuple, shape: tuple, quant=None) -> list[tuple[str, bool | Codec, int | None]]:
    """pagedjax state path -> the Hugging Face tensors it is read from: (name, whether the tensor is transposed
    or the `Codec` of a pre-quantized one, the expert whose slice it fills or None for the whole parameter). A
    stacked expert projection (..., 'experts', 'gate_proj') of shape `[E, width, hidden]` is E tensors
    `experts.{e}.gate_proj.weight` (gate / up kept as HF's [out, in], down transposed to [in, out]:
    `pagedjax.model.layers.moe.Experts`); a quantized one's `qweight` / `scale` `[E, out, ...]` (`moe_quant`) is E
    compressed-tensors tensors `experts.{e}.gate_proj.weight_packed` / `.weight_scale`, each `[out, ...]` as stored
    (down too)."""
    *mods, leaf = (str(p) for p in path)
    if leaf in ("qweight", "scale") and len(mods) >= 2 and mods[-2] == "experts":  # `QuantizedExperts`: per expert
        prefix = "model." + ".".join(mods[:-1])
        return [(*hf_quant.tensor(f"{prefix}.{e}.{mods[-1]}", leaf, quant), e) for e in range(shape[0])]
    if leaf in ("qweight", "scale"):  # a QuantizedLinear of a compressed-tensors checkpoint (`hf_quant`)
        name, codec = hf_quant.tensor(_hf_name((*mods, "kernel"))[0].removesuffix(".weight"), leaf, quant)
        return [(name, codec, None)]
    if mods and mods[-1] == "experts":
        prefix = "model." + ".".join(mods)
        return [(f"{prefix}.{e}.{leaf}.weight", leaf == "down_proj", e) for e in range(shape[0])]
    name, transpose = _hf_name(path)
    return [(name, transpose, None)]


def _hf_name(path: tuple) -> tuple[str, bool]:
    """pagedjax state path -> (Hugging Face tensor name, whether the tensor is transposed)."""
    *mods, leaf = (str(p) for p in path)
    if leaf == "kernel":
        name, transpose = "weight", True
    elif leaf in ("embedding", "weight"):
        name, transpose = "weight", False
    elif leaf == "bias":
        name, transpose = "bias", False
    else:
        raise ValueError(f"no Hugging Face name for model parameter {'.'.join(mods + [leaf])}")
    prefix = "" if mods[0] == "lm_head" else "model."
    return prefix + ".".join(mods + [name]), transpose


def _unfused(name: str, targets: dict) -> list[str] | None:
    """The model parameters a fused checkpoint tensor holds (`_FUSED`: "...self_attn.qkv_proj.weight" ->
    q_proj, k_proj, v_proj), in row order; None if `name` is not one whose parts the model has."""
    module_path, _, leaf = name.rpartition(".")
    prefix, _, module = module_path.rpartition(".")
    parts = [f"{prefix}.{p}.{leaf}" for p in _FUSED.get(module, ())]
    return parts if parts and all(p in targets for p in parts) else None


def safetensors_files(path: str | os.PathLike) -> list[Path]:
    """The folder's safetensors files: the shards of `model.safetensors.index.json`, or `model.safetensors`,
    or else every `*.safetensors` file."""
    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(index, "no 'weight_map' object")
        if not all(isinstance(f, str) for f in weight_map.values()):
            raise ModelLoadError(index, "field 'weight_map': file names must be strings")
        files = [folder / f for f in dict.fromkeys(weight_map.values())]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists shards that do not exist: {missing}")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder} (pytorch .bin checkpoints are not supported)")
    return files


_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16}
# Integer tensors, read only into integer parameters (DeepSeek V4's hash router table `tid2eid`).
_ST_INT_DTYPES = {"I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8}


def _read_tensor(handle, file: Path, name: str) -> np.ndarray:
    """One tensor as numpy. bf16 goes through the numpy API when this safetensors version maps it to
    ml_dtypes' bfloat16, else through the raw bytes of the file."""
    try:
        return handle.get_tensor(name)
    except (TypeError, ValueError, KeyError, AttributeError) as e:  # e.g. an old safetensors without numpy bf16
        logger.debug("safetensors numpy API failed for %s (%s); reading raw bytes", name, e)
        return _read_raw(file, name)


def read_stored(file: Path, name: str) -> np.ndarray:
    """One tensor of a safetensors file, any dtype numpy has (a `fill_state` view's tensors: uint8 MXFP4 too)."""
    from safetensors import safe_open

    with safe_open(str(file), framework="numpy") as f:
        return _read_tensor(f, file, name)


def _read_raw(file: Path, name: str) -> np.ndarray:
    """Read one tensor straight from a safetensors file: u64 header length, JSON header, data."""
    with open(file, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
        info = header[name]
        dtype = _ST_DTYPES.get(info["dtype"]) or _ST_INT_DTYPES.get(info["dtype"]) or hf_fp8.raw_dtype(info["dtype"])
        if dtype is None:
            raise ValueError(f"tensor {name!r} in {file.name}: dtype {info['dtype']} is not supported")
        begin, end = info["data_offsets"]
        f.seek(8 + header_len + begin)
        data = f.read(end - begin)
    return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(info["shape"])


def tensor_headers(files: list[Path]) -> Iterator[tuple[Path, str, tuple[int, ...], str]]:
    """(file, tensor name, shape, safetensors dtype) of every tensor; ModelLoadError naming a file whose header
    cannot be read (safetensors checks there that the header covers the whole file: truncation shows here)."""
    from safetensors import safe_open

    for file in files:
        try:
            with safe_open(str(file), framework="numpy") as f:
                entries = []
                for name in f.keys():
                    sl = f.get_slice(name)
                    entries.append((file, name, tuple(sl.get_shape()), sl.get_dtype()))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError (an Exception)
            raise ModelLoadError(file, f"not a readable safetensors file (truncated or corrupted?): {e}") from e
        yield from entries


def load_hf_params(path: str | os.PathLike, cfg: ModelConfig, *, mesh=None) -> nnx.State:
    """Weights of a Hugging Face folder as an `nnx.State` with the structure of `nnx.split(init_model(cfg))[1]`.

    Streams tensor by tensor: each is read, transposed if it is a linear weight, cast to `cfg.dtype` and put
    on the device before the next is read. With a tensor-parallel `mesh` (`pagedjax.parallel`), each device
    receives only its slice of the tensor (`jax.make_array_from_callback`; on several hosts, each process
    places only its own devices' slices). Raises ModelLoadError (a ValueError) for missing, unexpected or
    mis-shaped tensors (naming them) before reading any data, and naming the file for unreadable data. The load
    time is logged (logger `pagedjax.model.loading.hf_loader`, level INFO).
    """
    where = None
    if mesh is not None:
        from pagedjax.parallel.sharding import param_sharding_fn

        where = param_sharding_fn(cfg, mesh)

    hf = read_json(Path(path) / "config.json")
    classifier = is_classifier(hf)

    def skip(name: str) -> bool:
        # tied: the embedding is the head, as in transformers; `hf_quant`'s weight_shape tensors are redundant
        return name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and cfg.tie_word_embeddings) or (
            cfg.quantization is not None and name.endswith(".weight_shape")) or (
            classifier and name.startswith(f"{HEAD}."))  # the head: `load_classifier`

    names = lambda p, shape: hf_names(p, shape, cfg.quantization)
    view = None
    if hf.get("model_type") in gpt_oss.MODEL_TYPES:  # its own names and experts
        names = lambda p, shape: gpt_oss.tensor_names(p) or hf_names(p, shape, cfg.quantization)
        view = gpt_oss.ExpertTensors()
    elif is_base_model(hf):  # `Qwen3Model` and the like (embedding models): no `model.` prefix, no LM head of its own
        names = lambda p, shape: [(n.removeprefix("model."), t, e) for n, t, e in hf_names(p, shape, cfg.quantization)]
        if not cfg.tie_word_embeddings:
            raise ModelLoadError(Path(path) / "config.json", f"a base model ({hf['architectures'][0]}) without tied "
                                 "word embeddings has no LM head to load (tie_word_embeddings is false)")
    return fill_state(path, lambda: nnx.split(abstract_model(cfg))[1], names, skip=skip, where=where, view=view)


def is_base_model(hf: dict) -> bool:
    """Whether a config.json's `architectures` name a base model (`Qwen3Model`, `LlamaModel`: the transformer without
    its LM head, as embedding models are saved), whose tensors are named without the `model.` prefix."""
    archs = hf.get("architectures")
    return isinstance(archs, list) and len(archs) == 1 and isinstance(archs[0], str) and archs[0].endswith("Model") \
        and "For" not in archs[0]


def fill_state(path: str | os.PathLike, state: nnx.State | Callable[[], nnx.State], names, *, skip=None,
               where=None, fp8_block: tuple[int, int] | None = None, view=None) -> nnx.State:
    """Fill the abstract parameters `state` (`jax.ShapeDtypeStruct` leaves, e.g. `nnx.split(nnx.eval_shape(...))`)
    from a Hugging Face folder's safetensors, in place, and return it: the loading of every built-in model. `state`
    may be a function building it, called once every file's header was read: a truncated file then fails before
    the abstract model is traced (seconds for a large config).

    names(state path, shape) -> the checkpoint tensors of that parameter, [(name, transposed? or the `Codec` of
    a pre-quantized tensor, the expert whose slice it fills or None)] (`hf_names` is the Llama family's);
    skip(name) -> True for a checkpoint tensor the model does not read; where(state path) -> the parameter's
    sharding (None: one device); fp8_block: the `weight_block_size` of a block-scaled FP8 checkpoint, whose
    float8 weights are dequantized by their `weight_scale_inv` (`hf_fp8`); view: what a family stores other than
    as its model holds it, presented as the tensors `names` gives (`view.headers(entries)`: the (file, name, shape,
    safetensors dtype) the loader sees instead of the stored ones; `view.read(name, read_stored)`: such a
    tensor's data from the stored ones, `read_stored(file, name)`, or None for a tensor as stored; gpt-oss's
    fused, MXFP4 experts: `pagedjax.model.families.gpt_oss.ExpertTensors`). Each tensor is cast to its
    parameter's dtype. ModelLoadError (a ValueError)
    for missing, unexpected or mis-shaped tensors (naming them) before any data is read, and naming the file
    for unreadable data; the load time is logged."""
    from safetensors import safe_open

    start = time.perf_counter()
    files = safetensors_files(path)
    headers = list(tensor_headers(files))  # a file that cannot be read fails here, before the model is traced
    if not isinstance(state, nnx.State):
        state = state()
    skip = skip or (lambda name: False)
    # HF name -> (the model's parameter, transposed?, the expert slice it fills or None: the whole parameter).
    targets: dict[str, tuple[Any, bool, int | None]] = {}
    place = {}  # id of a parameter -> its sharding, with a mesh
    for p, var in nnx.to_flat_state(state):
        for name, transpose, expert in names(tuple(p), tuple(var.get_value().shape)):
            targets[name] = (var, transpose, expert)
        if where is not None:
            place[id(var)] = where(tuple(p))

    # Pass 1: headers only. Check names and shapes; decide which file each tensor comes from, and into which
    # model parameters it goes: (target, first row, last row) with rows None for a whole tensor.
    plan: dict[Path, list[tuple[str, list[tuple[str, int | None, int | None]]]]] = {f: [] for f in files}
    seen: dict[str, Path] = {}
    unexpected, misshaped, skipped = [], [], []
    scales: dict[str, tuple[Path, tuple[int, ...], str]] = {}  # a block-scaled FP8 weight's scales, by name
    fp8: dict[str, tuple[int, ...]] = {}  # float8 weight -> its shape (`hf_fp8`)
    entries = headers if view is None else view.headers(headers)
    for file, name, shape, st_dtype in entries:
        if skip(name):
            skipped.append(name)
            continue
        if fp8_block is not None and name.endswith(".weight" + hf_fp8.SCALE_SUFFIX):
            scales[name] = (file, shape, st_dtype)
            continue
        canonical = _canonical(name)
        parts = [canonical] if canonical in targets else _unfused(canonical, targets)
        if parts is None:
            unexpected.append(name)
            continue
        fused = parts != [canonical]
        pieces, row = [], 0
        for part in parts:
            if part in seen:
                raise ModelLoadError(file, f"tensor {part!r} also appears in {seen[part].name}"
                                           + (f" (in {name!r} here)" if fused or part != name else ""))
            var, transpose, expert = targets[part]
            part_shape = tuple(var.get_value().shape)[0 if expert is None else 1:]  # an expert: its slice
            if isinstance(transpose, Codec):
                part_shape = transpose.hf_shape(part_shape)
            else:
                part_shape = part_shape[::-1] if transpose else part_shape  # HF's [out, in]: fused parts stack rows
            pieces.append((part, row, row + part_shape[0]) if fused else (part, None, None))
            row += part_shape[0]
            seen[part] = file
        want = (row, *part_shape[1:])  # a whole tensor's shape too: its only part's
        if shape != want:
            misshaped.append(f"{name}: checkpoint {list(shape)}, model expects {list(want)}")
        codec = targets[parts[0]][1]
        integer = jnp.issubdtype(targets[parts[0]][0].get_value().dtype, jnp.integer)
        allowed = codec.dtypes if isinstance(codec, Codec) else _ST_INT_DTYPES if integer else _ST_DTYPES
        if fp8_block is not None and st_dtype == hf_fp8.FP8_DTYPE and not isinstance(codec, Codec) and len(
                shape) == 2:
            fp8[name] = shape
        elif st_dtype not in allowed:
            raise ModelLoadError(file, f"tensor {name!r}: dtype {st_dtype} is not supported "
                                       f"(supported: {', '.join(allowed)})")
        plan[file].append((name, pieces))
    missing = sorted(set(targets) - set(seen))
    scale_files: dict[str, Path] = {}  # the scales of the float8 weights, and their files
    for name, shape in fp8.items():
        scale = name + hf_fp8.SCALE_SUFFIX
        if scale not in scales:
            missing.append(scale)
            continue
        file, scale_shape, scale_dtype = scales.pop(scale)
        scale_files[scale] = file
        want = hf_fp8.scale_shape(shape, fp8_block)
        if scale_shape != want:
            misshaped.append(f"{scale}: checkpoint {list(scale_shape)}, blocks of {list(fp8_block)} of "
                             f"{list(shape)} expect {list(want)}")
        if not hf_fp8.is_scale_dtype(scale_dtype):
            raise ModelLoadError(file, f"tensor {scale!r}: dtype {scale_dtype} is not a float scale")
    unexpected += scales  # scales of no float8 weight
    problems = []
    if missing:
        problems.append(f"missing tensors: {missing}")
    if unexpected:
        problems.append(f"unexpected tensors: {sorted(unexpected)}")
    if misshaped:
        problems.append("mis-shaped tensors: " + "; ".join(misshaped))
    if problems:
        raise ModelLoadError(path, "the weights do not match the model config: " + ". ".join(problems))
    if skipped:
        logger.debug("ignored tensors: %s", skipped)

    # Pass 2: data, one tensor at a time. A stacked expert parameter is assembled on the host and placed once its
    # last expert's slice is read (the experts of one layer are usually adjacent in a checkpoint).
    num_bytes = 0
    stacks: dict[int, tuple[np.ndarray, set[int]]] = {}  # id of a parameter -> (its host array, experts read)
    for file, tensors in plan.items():
        if not tensors:
            continue
        with safe_open(str(file), framework="numpy") as f:
            for name, pieces in tensors:
                try:
                    whole = None if view is None else view.read(name, read_stored)
                    if whole is None:
                        whole = _read_tensor(f, file, name)
                except ModelLoadError:
                    raise
                except Exception as e:  # noqa: BLE001 - whatever the reader raised, name the file and tensor
                    raise ModelLoadError(file, f"cannot read tensor {name!r} (truncated or corrupted?): {e}") from e
                num_bytes += whole.nbytes
                if name in fp8:
                    scale_name = name + hf_fp8.SCALE_SUFFIX
                    whole = hf_fp8.dequantize(whole, _read_raw(scale_files[scale_name], scale_name), fp8_block)
                for part, first, last in pieces:
                    var, transpose, expert = targets[part]
                    dtype = transpose.dtype if isinstance(transpose, Codec) else jnp.dtype(var.get_value().dtype)
                    array = whole if first is None else whole[first:last]
                    if isinstance(transpose, Codec):
                        array = transpose.convert(array)
                    elif transpose:
                        array = array.T
                    if expert is not None:
                        array = _stack_expert(stacks, var, expert, array, dtype)
                        if array is None:  # more experts to come
                            continue
                    array = np.ascontiguousarray(array, dtype=dtype)
                    if id(var) in place:  # each device gets its slice only
                        value = jax.make_array_from_callback(array.shape, place[id(var)],
                                                             lambda idx, a=array: a[idx])
                    else:
                        value = jax.device_put(array)
                    del array
                    var.set_value(value)
                del whole

    elapsed = time.perf_counter() - start
    dtypes = sorted({str(var.get_value().dtype) for var, _, _ in targets.values()})
    msg = (f"loaded {len(seen)} tensors ({num_bytes / 2**20:.1f} MiB) from {len(files)} safetensors file(s) "
           f"in {elapsed:.2f}s as {', '.join(dtypes)}")
    logger.info("%s: %s", path, msg)
    return state


def _stack_expert(stacks: dict, var, expert: int, array: np.ndarray, dtype) -> np.ndarray | None:
    """Write one expert's `array` into slice `expert` of `var`'s host array (allocated on its first expert);
    the whole array once every expert is in, else None."""
    shape = tuple(var.get_value().shape)
    stack, done = stacks.setdefault(id(var), (np.empty(shape, dtype), set()))
    stack[expert] = array
    done.add(expert)
    if len(done) < shape[0]:
        return None
    del stacks[id(var)]
    return stack


def load_hf(path: str | os.PathLike, dtype: str | None = None, *, mesh=None) -> tuple[ModelConfig, nnx.State, Any]:
    """(ModelConfig, params, tokenizer or None) of a local Hugging Face folder.

    The tokenizer is an `HFTokenizer` when the folder has `tokenizer.json` and the `tokenizers` package is
    installed, else None.
    """
    cfg = load_hf_config(path, dtype=dtype)
    params = load_hf_params(path, cfg, mesh=mesh)
    return cfg, params, folder_tokenizer(path, cfg.eos_token_ids, cfg.bos_token_id)


def folder_tokenizer(path: str | os.PathLike, eos_token_ids: tuple[int, ...], bos_token_id: int | None):
    """The folder's `tokenizer.json` as an `HFTokenizer`, or None (no such file, or no `tokenizers` package)."""
    if not (Path(path) / "tokenizer.json").is_file():
        return None
    try:
        from pagedjax.model.hf_tokenizer import HFTokenizer

        return HFTokenizer.from_pretrained(path, eos_token_ids=eos_token_ids, bos_token_id=bos_token_id)
    except ImportError:
        logger.warning("%s has tokenizer.json but the 'tokenizers' package is not installed", path)
        return None
