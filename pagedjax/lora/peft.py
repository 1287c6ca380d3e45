"""Reading a PEFT LoRA adapter folder without torch: `adapter_config.json` and `adapter_model.safetensors`
(opened and checked by `safetensors`; its tensors in float32, float16 or bfloat16, as PEFT saves them: bf16 ones
are read from the file's bytes as `ml_dtypes.bfloat16`, which safetensors' numpy API cannot make where numpy has
no 'bfloat16'), for a built-in Llama-family model.

Supported: `r`, `lora_alpha`, `use_rslora`, `target_modules` (a list of the linears q_proj, k_proj, v_proj,
o_proj, gate_proj, up_proj, down_proj, each by name or by a dotted path ending in one, as PEFT matches them and
saves "all-linear": "model.layers.0.self_attn.q_proj"; or "all-linear"), `layers_to_transform` (only those
layers' tensors are present), `bias` "none". Refused with a ValueError naming the field or tensor: DoRA (`use_dora`),
`modules_to_save`, embedding or LM-head adapters, biases, per-module ranks or alphas (`rank_pattern`,
`alpha_pattern`), `fan_in_fan_out`, a rank above the engine's `max_lora_rank`, tensors of other names or shapes,
and a `.bin` checkpoint (a torch pickle: save it as safetensors); a config nested too deeply to parse. Refused
too, before any of it reaches a device slot: a `lora_alpha` or a weight that is NaN, infinite, or of magnitude
above `MAX_MAGNITUDE` (1e6). The scale (at most |lora_alpha|) and both factors under that bound keep an adapter's
products of ordinary activations far inside float32's range (|x| 1e4, 1e5 inputs, rank 512: under 1e30 of
3.4e38); a trained adapter's weights and alpha are many orders of magnitude below it, and past it (B = 1e38, an
alpha of 1e308) an adapter only overflows, answering each of its requests with NaN (empty text).

Tensor names are PEFT's over `LlamaForCausalLM`: `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`
(`[r, in]`) and `...lora_B.weight` (`[out, r]`); they are stored transposed (`[in, r]`, `[r, out]`) as the built-in
model's kernels are.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

from pagedjax.config import ModelConfig
from pagedjax.lora.adapter import LoRAAdapter
from pagedjax.model.layers.lora import ATTENTION_MODULES, TARGET_MODULES, target_shapes

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_MAGNITUDE = 1e6  # of lora_alpha and of every weight (see the module's docstring)
_TENSOR = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


def _field_error(path: Path, field: str, why: str) -> ValueError:
    return ValueError(f"LoRA adapter {str(path)!r}: {CONFIG_FILE} field {field!r} {why}")


def read_adapter_config(path: Path, max_rank: int) -> dict:
    """The folder's adapter config, checked: `r`, `lora_alpha`, `use_rslora`, the target modules (expanded) and
    every field whose feature is not supported (see the module's docstring)."""
    file = path / CONFIG_FILE
    if not file.is_file():
        raise ValueError(f"LoRA adapter {str(path)!r}: no {CONFIG_FILE} (a PEFT adapter folder holds it)")
    try:
        cfg = json.loads(file.read_bytes())
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"LoRA adapter {str(path)!r}: {CONFIG_FILE} is not valid JSON: {e}") from None
    except RecursionError:  # the decoder recurses per nested array or object: e.g. 100,000 '['
        raise ValueError(f"LoRA adapter {str(path)!r}: {CONFIG_FILE} is nested too deeply to read (a PEFT config "
                         "is one flat object)") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"LoRA adapter {str(path)!r}: {CONFIG_FILE} is not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise _field_error(path, "peft_type", f"is {cfg['peft_type']!r}: only LORA adapters are supported")
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise _field_error(path, "r", f"must be an int >= 1, got {r!r}")
    if r > max_rank:
        raise _field_error(path, "r", f"is {r}, above the engine's max_lora_rank {max_rank}")
    alpha = cfg.get("lora_alpha", 8)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise _field_error(path, "lora_alpha", f"must be a number, got {alpha!r}")
    if not abs(alpha) <= MAX_MAGNITUDE:  # NaN compares false; an int too large for a float compares fine
        raise _field_error(path, "lora_alpha", f"must be a finite number of magnitude at most {MAX_MAGNITUDE:g}, "
                                               f"got {_short(alpha)}")
    rslora = cfg.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise _field_error(path, "use_rslora", f"must be a bool, got {rslora!r}")
    if cfg.get("use_dora", False):
        raise _field_error(path, "use_dora", "is set: DoRA adapters are not supported")
    if cfg.get("modules_to_save"):
        raise _field_error(path, "modules_to_save", f"is {cfg['modules_to_save']!r}: fully trained modules beside "
                                                    "the adapter are not supported")
    if cfg.get("bias", "none") != "none":
        raise _field_error(path, "bias", f"is {cfg['bias']!r}: only 'none' is supported")
    for field in ("rank_pattern", "alpha_pattern"):
        if cfg.get(field):
            raise _field_error(path, field, "is set: per-module ranks and alphas are not supported")
    if cfg.get("fan_in_fan_out", False):
        raise _field_error(path, "fan_in_fan_out", "is set: only nn.Linear-layout (out, in) weights are supported")
    targets = cfg.get("target_modules")
    if targets == "all-linear":
        targets = list(TARGET_MODULES)
    elif isinstance(targets, str):
        raise _field_error(path, "target_modules", f"is the pattern {targets!r}: give a list of module names or "
                                                   "'all-linear'")
    if not isinstance(targets, list) or not targets:
        raise _field_error(path, "target_modules", f"must be a non-empty list of module names, got {targets!r}")
    # PEFT's rule: an entry names a module by its full path or a dotted suffix of it ("q_proj",
    # "model.layers.0.self_attn.q_proj": PEFT saves "all-linear" expanded so)
    unknown = sorted(t for t in map(str, targets) if t.rsplit(".", 1)[-1] not in TARGET_MODULES)
    if unknown:
        raise _field_error(path, "target_modules", f"names {unknown}: adapters of {', '.join(TARGET_MODULES)} only "
                                                   "(no embedding or LM-head adapters)")
    scale = alpha / math.sqrt(r) if rslora else alpha / r
    return {"r": r, "scale": float(scale), "target_modules": tuple(targets)}


def _short(value: float) -> str:
    """A number as an error message shows it: an int of hundreds of digits (JSON allows them) cut short."""
    shown = repr(value)
    return shown if len(shown) <= 32 else f"{shown[:12]}... ({len(shown)} digits)"


def _check_values(path: Path, key: str, weight: np.ndarray) -> None:
    """Refuse tensor `key` (float32) if any weight is NaN, infinite or above `MAX_MAGNITUDE` in magnitude."""
    if np.isnan(weight).any():
        raise ValueError(f"LoRA adapter {str(path)!r}: tensor {key!r} holds NaN (every weight must be finite)")
    peak = float(np.abs(weight).max())
    if math.isinf(peak):
        raise ValueError(f"LoRA adapter {str(path)!r}: tensor {key!r} holds an infinity (as float32; every weight "
                         "must be finite)")
    if peak > MAX_MAGNITUDE:
        raise ValueError(f"LoRA adapter {str(path)!r}: tensor {key!r} holds a weight of magnitude {peak:.3g}, above "
                         f"the {MAX_MAGNITUDE:g} an adapter's weights may reach")


def _targeted(path: str, entries: tuple[str, ...]) -> bool:
    """Whether module `path` (e.g. "model.layers.0.self_attn.q_proj") is one of `entries` (PEFT's rule)."""
    return any(path == e or path.endswith("." + e) for e in entries)


def read_tensors(file: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as numpy. The file is opened (its header and offsets checked) by
    `safetensors`; its tensors are read through the numpy API, except BF16 ones, read from the file's bytes as
    `ml_dtypes.bfloat16` (the numpy API fails on them where numpy has no 'bfloat16': "data type 'bfloat16' not
    understood"). SafetensorError for a corrupt file."""
    import ml_dtypes
    from safetensors import safe_open

    tensors: dict[str, np.ndarray] = {}
    bf16: list[str] = []
    with safe_open(str(file), framework="numpy") as f:
        for name in f.keys():
            if f.get_slice(name).get_dtype() == "BF16":
                bf16.append(name)
            else:
                tensors[name] = f.get_tensor(name)
    if bf16:
        with open(file, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_len))
            for name in bf16:
                begin, end = header[name]["data_offsets"]
                f.seek(8 + header_len + begin)
                data = f.read(end - begin)
                tensors[name] = np.frombuffer(data, dtype=ml_dtypes.bfloat16).reshape(header[name]["shape"])
    return tensors


def load_peft_adapter(path, lora_name: str, lora_int_id: int, model_config: ModelConfig,
                      max_rank: int) -> LoRAAdapter:
    """The PEFT adapter in folder `path` for a model of `model_config`, checked (see the module's docstring)."""
    from safetensors import SafetensorError

    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"LoRA adapter {str(path)!r}: no such folder")
    cfg = read_adapter_config(path, max_rank)
    if not (path / WEIGHTS_FILE).is_file():
        found = "adapter_model.bin (a torch pickle: save it with safe_serialization=True)" if (
            path / "adapter_model.bin").is_file() else "nothing"
        raise ValueError(f"LoRA adapter {str(path)!r}: no {WEIGHTS_FILE} (found {found})")
    try:
        tensors = read_tensors(path / WEIGHTS_FILE)
    except SafetensorError as e:  # a truncated or corrupt file (not a ValueError: the Rust library's own type)
        raise ValueError(f"LoRA adapter {str(path)!r}: {WEIGHTS_FILE} is not a valid safetensors file: {e}") \
            from None
    shapes = target_shapes(model_config)
    r = cfg["r"]
    halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        m = _TENSOR.fullmatch(key)
        if m is None:
            what = "an embedding adapter" if "lora_embedding" in key else "not a LoRA A/B weight of a target linear"
            raise ValueError(f"LoRA adapter {str(path)!r}: tensor {key!r} is {what} (unsupported)")
        layer, block, module, half = int(m[1]), m[2], m[3], m[4]
        if (not _targeted(f"model.layers.{layer}.{block}.{module}", cfg["target_modules"])
                or (block == "self_attn") != (module in ATTENTION_MODULES)):
            raise ValueError(f"LoRA adapter {str(path)!r}: tensor {key!r} is of no module of target_modules "
                             f"{sorted(cfg['target_modules'])}")
        if layer >= model_config.num_layers:
            raise ValueError(f"LoRA adapter {str(path)!r}: tensor {key!r} is of layer {layer}; the model has "
                             f"{model_config.num_layers}")
        n_in, n_out = shapes[module]
        want = (r, n_in) if half == "A" else (n_out, r)
        if value.shape != want:
            raise ValueError(f"LoRA adapter {str(path)!r}: tensor {key!r} has shape {tuple(value.shape)}, the model "
                             f"and r={r} need {want}")
        with np.errstate(over="ignore"):  # a float64 weight beyond float32's range becomes inf: refused next
            weight = np.asarray(value, np.float32)
        _check_values(path, key, weight)
        halves.setdefault((layer, module), {})[half] = weight.T
    weights = {}
    for (layer, module), pair in sorted(halves.items()):
        if len(pair) != 2:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise ValueError(f"LoRA adapter {str(path)!r}: layer {layer} {module} has no {missing} weight")
        weights[layer, module] = (np.ascontiguousarray(pair["A"]), np.ascontiguousarray(pair["B"]))
    if not weights:
        raise ValueError(f"LoRA adapter {str(path)!r}: {WEIGHTS_FILE} holds no LoRA weights")
    return LoRAAdapter(lora_name=lora_name, lora_int_id=lora_int_id, lora_path=str(path), rank=r,
                       scale=cfg["scale"], weights=weights)
