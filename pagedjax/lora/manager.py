"""`LoRAManager`: the engine's adapters. Registers each `LoRARequest` (its folder read and checked when first
seen), keeps up to `max_cpu_loras` adapters in host memory (least recently used dropped, read again when next
needed), and before each step puts the step's adapters in device slots (`SlotTable`), writing the new ones
through the runner: array contents only, so nothing recompiles."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

from pagedjax.config import ModelConfig
from pagedjax.config.lora import LoRAConfig
from pagedjax.lora.adapter import LoRAAdapter
from pagedjax.lora.peft import load_peft_adapter
from pagedjax.lora.slots import SlotTable
from pagedjax.model.layers.lora import target_shapes
from pagedjax.runner.runner import ModelRunner
from pagedjax.sampling_params import LoRARequest

logger = logging.getLogger(__name__)


class LoRAManager:
    """Adapters of one engine (see the module's docstring). An adapter's identity in block hashes (its key, a
    request's `adapter_id`) is its `lora_int_id` and how many times that id was removed before: while registered,
    an id is bound to one name and folder, and an id added again after `remove` never matches the blocks cached
    under its former weights."""

    def __init__(self, config: LoRAConfig, model_config: ModelConfig, runner: ModelRunner):
        self.config = config
        self.model_config = model_config
        self.runner = runner
        self.slots = SlotTable(config.max_loras)  # by adapter key
        self._shapes = target_shapes(model_config)
        self._requests: dict[int, LoRARequest] = {}  # registered adapters by lora_int_id
        self._keys: dict[int, str] = {}  # their keys
        self._removals: dict[int, int] = {}  # times each id was removed
        self._host: OrderedDict[str, LoRAAdapter] = OrderedDict()  # by key, least recently used first
        self._pinned: dict[str, LoRAAdapter] = {}  # adapters given with their weights (`register_adapter`)
        self.num_slot_loads = 0
        self.num_disk_loads = 0
        self.slot_load_seconds = 0.0

    def register(self, request: LoRARequest) -> str:
        """The adapter key of `request` (a request's `adapter_id`), its folder read and checked if new. TypeError
        for anything but a `LoRARequest`; ValueError for an unsupported adapter (naming the field) or an id bound
        to another name or folder."""
        if not isinstance(request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        i = request.lora_int_id
        known = self._requests.get(i)
        if known is not None:
            if known != request:
                raise ValueError(f"lora_int_id {i} is {known.lora_name!r} at {known.lora_path!r}; got "
                                 f"{request.lora_name!r} at {request.lora_path!r} (an id names one adapter until "
                                 "it is removed)")
            return self._keys[i]
        key = self._next_key(i)
        self._cache(key, self._read(request))
        self._requests[i], self._keys[i] = request, key
        return key

    def register_adapter(self, request: LoRARequest, adapter: LoRAAdapter) -> str:
        """Register `request` with the weights `adapter` holds (its `lora_path` then only names it): kept in memory
        for as long as it is registered, never read from a folder. An id already registered is replaced: the
        new weights get a new key, so no block cached under the former ones is hit again. ValueError for an
        adapter of another id, a rank above `max_lora_rank`, or weights not of the model's targets' shapes; the
        caller makes sure no unfinished request uses a replaced id."""
        if not isinstance(request, LoRARequest) or not isinstance(adapter, LoRAAdapter):
            raise TypeError(f"register_adapter takes a LoRARequest and a LoRAAdapter, got "
                            f"{type(request).__name__} and {type(adapter).__name__}")
        if adapter.lora_int_id != request.lora_int_id:
            raise ValueError(f"adapter {adapter.lora_int_id} given for lora_int_id {request.lora_int_id}")
        if adapter.rank > self.config.max_lora_rank:
            raise ValueError(f"adapter rank {adapter.rank} > max_lora_rank {self.config.max_lora_rank}")
        for (layer, module), (a, b) in adapter.weights.items():
            n_in, n_out = self._shapes.get(module, (None, None))
            if not 0 <= layer < self.model_config.num_layers or n_in is None or a.shape != (n_in, adapter.rank) \
                    or b.shape != (adapter.rank, n_out):
                raise ValueError(f"adapter weights for layer {layer} {module}: A {tuple(a.shape)}, B "
                                 f"{tuple(b.shape)}; the model's targets take A [in, {adapter.rank}], B "
                                 f"[{adapter.rank}, out] of {self._shapes} in layers [0, "
                                 f"{self.model_config.num_layers})")
        self.remove(request.lora_int_id)
        key = self._next_key(request.lora_int_id)
        self._pinned[key] = adapter
        self._requests[request.lora_int_id], self._keys[request.lora_int_id] = request, key
        return key

    def _next_key(self, lora_int_id: int) -> str:
        removals = self._removals.get(lora_int_id, 0)
        return str(lora_int_id) if removals == 0 else f"{lora_int_id}.{removals}"

    def remove(self, lora_int_id: int) -> bool:
        """Forget adapter `lora_int_id` (host copy, device slot, binding); False if it is not registered. The
        caller makes sure no unfinished request uses it (`key_of`). Its device slot is zeroed: a removed adapter's
        weights leave the device with it, not when another adapter happens to take the slot."""
        request = self._requests.pop(lora_int_id, None)
        if request is None:
            return False
        key = self._keys.pop(lora_int_id)
        self._removals[lora_int_id] = self._removals.get(lora_int_id, 0) + 1
        self._host.pop(key, None)
        self._pinned.pop(key, None)
        slot = self.slots.release(key)
        if slot is not None:
            self.runner.clear_lora_slot(slot)
        return True

    def key_of(self, lora_int_id: int) -> str | None:
        """The key of registered adapter `lora_int_id` (None: not registered)."""
        return self._keys.get(lora_int_id)

    @property
    def adapters(self) -> list[LoRARequest]:
        """Every registered adapter, in registration order."""
        return list(self._requests.values())

    def _read(self, request: LoRARequest) -> LoRAAdapter:
        self.num_disk_loads += 1
        return load_peft_adapter(request.lora_path, request.lora_name, request.lora_int_id, self.model_config,
                                 self.config.max_lora_rank)

    def _cache(self, key: str, adapter: LoRAAdapter) -> None:
        self._host[key] = adapter
        self._host.move_to_end(key)
        while len(self._host) > self.config.max_cpu_loras:
            dropped, _ = self._host.popitem(last=False)
            logger.info("LoRA adapter %s dropped from host memory (max_cpu_loras %d)", dropped,
                        self.config.max_cpu_loras)

    def host_adapter(self, key: str) -> LoRAAdapter:
        """Registered adapter `key` in memory (read from its folder again if it was dropped)."""
        if key in self._pinned:
            return self._pinned[key]
        adapter = self._host.get(key)
        if adapter is None:
            i = next(i for i, k in self._keys.items() if k == key)
            adapter = self._read(self._requests[i])
        self._cache(key, adapter)
        return adapter

    def slots_for(self, adapter_ids: list[str | None]) -> list[int]:
        """Each request's device slot for a step of requests with these `adapter_id`s (None: the base model, slot
        0), loading the adapters not resident into slots first (least recently used evicted, never one of this
        step's). ValueError for more distinct adapters than `max_loras` (the scheduler never plans that). A load
        that raises (its folder changed and no longer reads, an interrupt) leaves the adapters not yet written
        without a slot, so no later step reads a slot that still holds another adapter's weights as theirs."""
        slot_of, loads = self.slots.assign(key for key in adapter_ids if key is not None)
        for n, (key, slot) in enumerate(loads):
            try:
                self._load(key, slot)
            except BaseException:
                for unwritten, _ in loads[n:]:
                    self.slots.release(unwritten)
                raise
        return [0 if key is None else slot_of[key] for key in adapter_ids]

    def _load(self, key: str, slot: int) -> None:
        start = time.perf_counter()
        host = self.host_adapter(key)
        a, b = host.slot_arrays(self._shapes, self.model_config.num_layers, self.config.max_lora_rank)
        self.runner.set_lora_slot(slot, a, b, host.scale)
        self.num_slot_loads += 1
        self.slot_load_seconds += time.perf_counter() - start
