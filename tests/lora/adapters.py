"""Random PEFT adapter folders for a tiny model, written as PEFT saves them (no torch, no peft), and the
merged-weights reference (`W + scale * A B` in every target linear)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from flax import nnx

from pagedjax.config import ModelConfig
from pagedjax.model.layers.lora import ATTENTION_MODULES, TARGET_MODULES, target_shapes
from pagedjax.model.llama import init_model


def write_adapter(folder: Path, cfg: ModelConfig, *, rank: int, seed: int, targets=TARGET_MODULES, alpha: float = 16.0,
                  rslora: bool = False, std: float = 0.3, **config) -> Path:
    """A PEFT LoRA folder with random A and B (B nonzero, unlike a fresh PEFT init, so the adapter matters)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    shapes = target_shapes(cfg)
    tensors = {}
    for i in range(cfg.num_layers):
        for module in (TARGET_MODULES if targets == "all-linear" else targets):
            n_in, n_out = shapes[module]
            block = "self_attn" if module in ATTENTION_MODULES else "mlp"
            key = f"base_model.model.model.layers.{i}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, n_in)) * std / math.sqrt(n_in)).astype(
                np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((n_out, rank)) * std).astype(np.float32)
    adapter_config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "use_rslora": rslora,
                      "target_modules": targets if targets == "all-linear" else list(targets), "bias": "none",
                      "use_dora": False, "modules_to_save": None, **config}
    (folder / "adapter_config.json").write_text(json.dumps(adapter_config))
    from safetensors.numpy import save_file

    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def merged_params(cfg: ModelConfig, seed: int, folder: Path, kernels=None, base: nnx.State | None = None) -> nnx.State:
    """The parameters of `init_model(cfg, seed)` (or `base`, parameters of such a model) with the adapter in
    `folder` merged into every kernel it targets: W + scale * A^T B^T in PEFT's terms (the built-in model's kernels
    are `[in, out]`). `kernels` (layer index, module) -> W: base kernels instead of the model's own (e.g. a
    quantized model's, dequantized)."""
    from safetensors.numpy import load_file

    adapter_config = json.loads((folder / "adapter_config.json").read_text())
    r, alpha = adapter_config["r"], adapter_config["lora_alpha"]
    scale = alpha / math.sqrt(r) if adapter_config.get("use_rslora") else alpha / r
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    model = init_model(cfg, seed)
    if base is not None:
        nnx.update(model, base)
    for i, layer in enumerate(model.layers):
        for module in TARGET_MODULES:
            block = "self_attn" if module in ATTENTION_MODULES else "mlp"
            key = f"base_model.model.model.layers.{i}.{block}.{module}"
            linear = getattr(getattr(layer, block), module)
            if kernels is not None:
                linear.kernel[...] = kernels[i, module]
            if f"{key}.lora_A.weight" not in tensors:
                continue
            a, b = tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"]
            linear.kernel[...] = linear.kernel[...] + scale * (a.T.astype(np.float64) @ b.T).astype(np.float32)
    return nnx.state(model, nnx.Param)
