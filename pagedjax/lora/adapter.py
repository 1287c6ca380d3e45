"""`LoRAAdapter`: one adapter's weights in host memory, in the layout the device slots take."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter of a built-in model: its identity (`lora_int_id`, `lora_name`, where it was read from), rank,
    scale (lora_alpha / r, or lora_alpha / sqrt(r) for rsLoRA) and weights by (layer index, target module):
    A float32 `[in, r]`, B float32 `[r, out]`, so that a linear of kernel W `[in, out]` computes
    `x W + scale * (x A) B` (merged: `W + scale * A B`). Targets it leaves out have no entry. Read from a PEFT
    folder the weights are numpy; given by a trainer (`LLMEngine.add_lora_adapter`) they may be JAX arrays."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())

    def slot_arrays(self, shapes: dict[str, tuple[int, int]], num_layers: int,
                    slot_rank: int) -> tuple[list[dict], list[dict]]:
        """Per layer, per target of `shapes` ((in, out) by module): A `[in, slot_rank]` and B `[slot_rank, out]`,
        this adapter's zero-padded to the slots' rank (zeros where it has no weights: they add nothing). Weights
        given as JAX arrays (an adapter a trainer holds on its devices) are padded there, never copied to the
        host."""
        a_layers, b_layers = [], []
        for i in range(num_layers):
            a_layer, b_layer = {}, {}
            for module, (n_in, n_out) in shapes.items():
                if (i, module) in self.weights:
                    wa, wb = self.weights[i, module]
                    xp = jnp if isinstance(wa, jax.Array) else np
                    a = xp.pad(xp.asarray(wa, np.float32), ((0, 0), (0, slot_rank - wa.shape[1])))
                    b = xp.pad(xp.asarray(wb, np.float32), ((0, slot_rank - wb.shape[0]), (0, 0)))
                else:
                    a = np.zeros((n_in, slot_rank), np.float32)
                    b = np.zeros((slot_rank, n_out), np.float32)
                a_layer[module], b_layer[module] = a, b
            a_layers.append(a_layer)
            b_layers.append(b_layer)
        return a_layers, b_layers
