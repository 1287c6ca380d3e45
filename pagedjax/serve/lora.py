"""The adapters a server serves by name (vLLM's interface): a request's `model` names the base model or an adapter;
`--lora-modules` registers adapters at start; `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` add and
remove them at runtime, only when the operator enabled it (`RuntimeLoRAUpdates`).

A runtime load reads a folder a client names, so before any of it is read:
  - the path is taken under the operator's root: a `..` component, an absolute path outside the root, and any
    component that resolves (through symbolic links) outside the root are refused (403), each prefix of the path
    checked, not only the whole; so is an adapter file that is a link out of the root;
  - the adapter's files must be regular files, `adapter_config.json` at most `MAX_CONFIG_BYTES` and
    `adapter_model.safetensors` at most `max_bytes` (413);
  - then the whole adapter is read and checked in a worker thread (never on the event loop, never on the engine
    thread for a bad one); only a valid adapter reaches the engine, which registers it on its own thread.
Error messages name the path as the client gave it, never the server's absolute path. The root's contents are the
operator's: the checks bound what a client's path can reach, not files the operator puts there.

At most `max_registered` adapters are served at once (`--max-registered-loras`, start-up modules included): a
load past it is refused (400 `too_many_lora_adapters`) before anything is read, so no client grows the server's
adapters, and what `/v1/models` lists, without bound.

Ids: every adapter gets a fresh `lora_int_id` (never reused), so a name loaded again after an unload never hits
the KV blocks cached under its former weights. Unloading an adapter that running requests use lets them finish
under it: the name is gone at once (new requests get 404), the engine removes the weights after the last of them
(`AsyncLLMEngine.remove_lora`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePath

from pagedjax.lora.peft import CONFIG_FILE, WEIGHTS_FILE, load_peft_adapter
from pagedjax.sampling_params import LoRARequest
from pagedjax.serve.async_engine import AsyncLLMEngine, EngineStoppedError
from pagedjax.serve.errors import APIError, bad_request

logger = logging.getLogger(__name__)

DEFAULT_MAX_LORA_BYTES = 2**30
# Adapters served at once: far more than device slots or host copies (those are the engine's --max-loras and
# --max-cpu-loras), so that a server of many fine-tunes never meets it, yet a bound on its records.
DEFAULT_MAX_REGISTERED_LORAS = 256
MAX_CONFIG_BYTES = 2**20  # PEFT's adapter_config.json is a few KB (tens with "all-linear" saved as paths)
MAX_NAME_LENGTH = 256


@dataclass(frozen=True)
class RuntimeLoRAUpdates:
    """What `/v1/load_lora_adapter` may read: adapter folders under `root` (`--lora-root`), whose safetensors file
    is at most `max_bytes` (`--max-lora-bytes`)."""

    root: Path
    max_bytes: int = DEFAULT_MAX_LORA_BYTES

    def __post_init__(self) -> None:
        real = Path(os.path.realpath(self.root))
        if not real.is_dir():
            raise ValueError(f"the LoRA root {str(self.root)!r} is not a folder")
        if not isinstance(self.max_bytes, int) or self.max_bytes < 1:
            raise ValueError(f"max_bytes must be an int >= 1, got {self.max_bytes!r}")
        object.__setattr__(self, "root", real)


def _inside(path: str, root: Path) -> bool:
    return path == str(root) or path.startswith(str(root).rstrip(os.sep) + os.sep)


def _forbidden(message: str) -> APIError:
    return APIError(403, message, param="lora_path", code="lora_path_not_allowed")


def resolve_under_root(given: str, root: Path) -> Path:
    """The real folder that `given` (relative to `root`, or absolute inside it) names; 403 if it may leave `root`
    (a `..` component, an absolute path elsewhere, a component resolving outside through a link), 404 if no such
    folder. `root` is a real path (`RuntimeLoRAUpdates.root`)."""
    if "\0" in given:
        raise bad_request("lora_path: must not contain a NUL character", "lora_path")
    path = PurePath(given)
    if ".." in path.parts:
        raise _forbidden(f"lora_path {given!r} contains '..': adapter paths may not leave the server's LoRA root")
    if path.is_absolute():
        if not _inside(os.path.normpath(given), root):
            raise _forbidden(f"lora_path {given!r} is an absolute path outside the server's LoRA root; give a path "
                             "relative to it")
        path = PurePath(os.path.normpath(given)).relative_to(root)
    current = root
    for i, part in enumerate(path.parts):  # every prefix: a link out of the root anywhere is refused
        current = Path(os.path.realpath(current / part))
        if not _inside(str(current), root):
            shown = PurePath(*path.parts[: i + 1])
            raise _forbidden(f"lora_path {given!r}: {str(shown)!r} is a symbolic link that leaves the server's "
                             "LoRA root")
    if not current.is_dir():
        raise APIError(404, f"lora_path {given!r}: no adapter folder there under the server's LoRA root",
                       param="lora_path", code="lora_adapter_not_found")
    return current


def check_adapter_files(folder: Path, given: str, root: Path, max_bytes: int) -> None:
    """Refuse, before reading them, adapter files that are links out of `root` (403), not regular files (400) or
    larger than their limit (413). A missing file is left to the adapter loader, which names it."""
    for name, limit, flag in ((CONFIG_FILE, MAX_CONFIG_BYTES, None), (WEIGHTS_FILE, max_bytes, "--max-lora-bytes")):
        file = folder / name
        if not os.path.lexists(file):
            continue
        real = os.path.realpath(file)
        if not _inside(real, root):
            raise _forbidden(f"lora_path {given!r}: {name} is a symbolic link that leaves the server's LoRA root")
        try:
            info = os.stat(real)
        except OSError as e:
            raise bad_request(f"lora_path {given!r}: cannot read {name}: {e.strerror}", "lora_path",
                              "invalid_lora_adapter") from None
        if not stat.S_ISREG(info.st_mode):
            raise bad_request(f"lora_path {given!r}: {name} is not a regular file", "lora_path",
                              "invalid_lora_adapter")
        if info.st_size > limit:
            why = f"the {limit:,} bytes this server reads" + (f" ({flag})" if flag else "")
            raise APIError(413, f"lora_path {given!r}: {name} is {info.st_size:,} bytes, more than {why}",
                           param="lora_path", code="lora_adapter_too_large")


@dataclass(frozen=True)
class ServedAdapter:
    request: LoRARequest
    root: str  # what /v1/models shows as the adapter's `root`: never an absolute server path


class ServedAdapters:
    """The adapters a server serves, by name, over an engine with LoRA enabled (or none, without it); see the
    module docstring. `modules` (name -> folder, the operator's `--lora-modules`) are registered now, on the
    engine before its thread starts: ValueError naming the module for a bad one. `runtime`: what the load
    endpoint may read (None: runtime loading and unloading are off). `max_registered`: the most adapters served at
    once, `modules` included."""

    def __init__(self, engine: AsyncLLMEngine, *, base_name: str, modules: Mapping[str, str] | None = None,
                 runtime: RuntimeLoRAUpdates | None = None, max_registered: int = DEFAULT_MAX_REGISTERED_LORAS):
        if not isinstance(max_registered, int) or isinstance(max_registered, bool) or max_registered < 1:
            raise ValueError(f"max_registered must be an int >= 1, got {max_registered!r}")
        if len(modules or {}) > max_registered:
            raise ValueError(f"{len(modules)} LoRA modules, more than the {max_registered} adapters this server "
                             "serves at once (--max-registered-loras)")
        self.engine = engine
        self.base_name = base_name
        self.runtime = runtime
        self.max_registered = max_registered
        self.lora_config = engine.lora_config
        if self.lora_config is None and (modules or runtime is not None):
            raise ValueError("LoRA adapters need an engine with a lora_config (--enable-lora)")
        if modules and engine.is_running:
            raise ValueError("LoRA modules are registered before the engine thread starts")
        self._ids = itertools.count(1)
        self._served: dict[str, ServedAdapter] = {}
        self._loading: set[str] = set()  # names a load is reading now
        for name, path in (modules or {}).items():
            where = f"LoRA module {name}={path}"
            try:
                self._check_name(name)
            except APIError as e:
                raise ValueError(f"{where}: {e.message}") from None
            request = LoRARequest(name, next(self._ids), str(path))
            try:
                engine.add_lora_before_start(request)
            except (TypeError, ValueError, OSError) as e:
                raise ValueError(f"{where}: {e}") from None
            self._served[name] = ServedAdapter(request, self._shown_root(Path(path)))
            logger.info("serving LoRA adapter %s from %s", name, path)

    @property
    def enabled(self) -> bool:
        """Whether the engine serves adapters at all."""
        return self.lora_config is not None

    def served(self) -> list[ServedAdapter]:
        """The adapters served now, in the order they were loaded."""
        return list(self._served.values())

    def lookup(self, model: str) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 naming the field if neither."""
        if model == self.base_name:
            return None
        adapter = self._served.get(model)
        if adapter is None:
            also = f" and the LoRA adapters {sorted(self._served)[:20]}" if self._served else ""
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.base_name}`{also}.",
                           param="model", code="model_not_found")
        return adapter.request

    def _shown_root(self, folder: Path) -> str:
        """An adapter folder as /v1/models shows it: relative to the LoRA root when inside it, else its own name."""
        real = os.path.realpath(folder)
        if self.runtime is not None and _inside(real, self.runtime.root):
            return str(PurePath(real).relative_to(self.runtime.root))
        return folder.name or str(folder)

    def _check_name(self, name: str) -> None:
        if not name or len(name) > MAX_NAME_LENGTH or not name.isprintable() or any(c.isspace() for c in name):
            raise bad_request(f"lora_name {name[:80]!r}: must be 1 to {MAX_NAME_LENGTH} printable characters "
                              "without spaces", "lora_name", "invalid_lora_name")
        if name == self.base_name:
            raise bad_request(f"lora_name {name!r} is the base model's name", "lora_name", "invalid_lora_name")
        if name in self._served or name in self._loading:
            raise bad_request(f"The LoRA adapter {name!r} has already been loaded (unload it first to replace it).",
                              "lora_name", "lora_adapter_exists")

    def _check_room(self) -> None:
        """400 when `max_registered` adapters are served or being loaded."""
        held = len(self._served) + len(self._loading)
        if held >= self.max_registered:
            raise bad_request(f"This server serves at most {self.max_registered} LoRA adapters at once "
                              f"(--max-registered-loras) and holds {held}: unload one first.",
                              code="too_many_lora_adapters")

    def check_runtime(self) -> RuntimeLoRAUpdates:
        """What runtime loads may read; 404 (saying how to enable them) when runtime updates are off."""
        if self.runtime is None:
            why = ("it serves no LoRA adapters (--enable-lora)" if not self.enabled else
                   "runtime LoRA updates are off (--enable-runtime-lora-updates with --lora-root DIR)")
            raise APIError(404, f"Loading and unloading LoRA adapters at runtime is not enabled on this server: "
                                f"{why}.", code="lora_updates_disabled")
        return self.runtime

    # ------------------------------------------------------------------------------------------------- load
    async def load(self, name: str, path: str) -> LoRARequest:
        """Serve the adapter in folder `path` (under the LoRA root) as `name`; APIError for every refusal (see
        the module docstring). The folder is checked and read in a worker thread, then registered on the
        engine's thread."""
        runtime = self.check_runtime()
        self._check_name(name)
        self._check_room()
        self._loading.add(name)
        try:
            folder = await asyncio.to_thread(self._read_checked, name, path, runtime)
            request = LoRARequest(name, next(self._ids), str(folder))
            try:
                await self.engine.add_lora(request)
            except (TypeError, ValueError, OSError) as e:  # checked already: a file changed meanwhile
                raise self._invalid(e, folder, path) from None
            except EngineStoppedError as e:
                raise APIError(503, f"The server is not taking requests: {e}", code="unavailable") from None
            self._served[name] = ServedAdapter(request, self._shown_root(folder))
        finally:
            self._loading.discard(name)
        logger.info("loaded LoRA adapter %s (id %d) from %s", name, request.lora_int_id, folder)
        return request

    def _read_checked(self, name: str, given: str, runtime: RuntimeLoRAUpdates) -> Path:  # a worker thread
        """The real folder of `given`, its path and files checked, the whole adapter read and checked against the
        model (then dropped: the engine reads it again from the page cache, on its own thread)."""
        folder = resolve_under_root(given, runtime.root)
        check_adapter_files(folder, given, runtime.root, runtime.max_bytes)
        try:
            load_peft_adapter(folder, name, 1, self.engine.model_config, self.lora_config.max_lora_rank)
        except (TypeError, ValueError, OSError) as e:
            raise self._invalid(e, folder, given) from None
        return folder

    @staticmethod
    def _invalid(error: Exception, folder: Path, given: str) -> APIError:
        """400 for an adapter the loader refused, its message naming the path as the client gave it."""
        message = str(error).replace(repr(str(folder)), repr(given)).replace(str(folder), given)
        return bad_request(f"lora_path: {message}", "lora_path", "invalid_lora_adapter")

    # ----------------------------------------------------------------------------------------------- unload
    async def unload(self, name: str) -> bool:
        """Stop serving adapter `name`: new requests naming it get 404 from now on; requests running under it
        finish under it, and the engine drops its weights after them. True if the weights went at once; 404 for
        a name not served."""
        self.check_runtime()
        adapter = self._served.get(name)
        if adapter is None:
            if name == self.base_name:
                raise bad_request(f"lora_name {name!r} is the base model, which cannot be unloaded", "lora_name",
                                  "invalid_lora_name")
            raise APIError(404, f"The LoRA adapter {name!r} cannot be found (it is not loaded).", param="lora_name",
                           code="lora_adapter_not_found")
        del self._served[name]  # before the engine hears of it: no new request can name it
        try:
            removed = await self.engine.remove_lora(adapter.request.lora_int_id)
        except EngineStoppedError as e:
            raise APIError(503, f"The server is not taking requests: {e}", code="unavailable") from None
        logger.info("unloaded LoRA adapter %s (id %d)%s", name, adapter.request.lora_int_id,
                    "" if removed else ": its running requests finish first")
        return removed
