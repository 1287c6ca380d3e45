"""`LoRAConfig`: multi-LoRA serving's limits (`LLMEngine(lora_config=LoRAConfig(max_loras=..., ...))`).

Plain Python, no JAX.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedjax.config.fields import check_int, option


@dataclass(frozen=True)
class LoRAConfig:
    """max_loras: device slots for adapters, so the most distinct adapters one step serves (slot 0, the base
    model, comes on top). max_lora_rank: every slot's rank (an adapter of lower rank is zero-padded to it; one of
    higher rank is refused). max_cpu_loras: adapters kept loaded in host memory (None: max_loras), >= max_loras;
    past it the least recently used one not in a device slot is dropped and read from its folder again when next
    asked for. Changing which adapters sit in the slots changes array contents only, never a compiled program."""

    max_loras: int = option(4, "device slots for adapters: the most distinct adapters one step runs")
    max_lora_rank: int = option(16, "every slot's rank: adapters of a higher rank are refused")
    max_cpu_loras: int | None = option(None, "adapters kept in host memory, at least --max-loras (default: "
                                             "--max-loras); the least recently used one past it is read from its "
                                             "folder again when next needed")

    def __post_init__(self) -> None:
        check_int("LoRAConfig", "max_loras", self.max_loras, lo=1)
        check_int("LoRAConfig", "max_lora_rank", self.max_lora_rank, lo=1)
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        check_int("LoRAConfig", "max_cpu_loras", self.max_cpu_loras, lo=self.max_loras)

    @property
    def num_slots(self) -> int:
        """Device slots including slot 0 (no adapter: zeros)."""
        return self.max_loras + 1
