"""Engines shared by the tests of a module (CI time: an engine compiles its own step programs, ~0.5 s each, and
that, not what its steps compute, is most of an engine test's time).

`EnginePool(make)` hands out an engine of a configuration (`make(**config)`) that a test before left idle, else a
new one. An engine goes back only from a test that got through its `with pool.engine(...)` block, and only idle:
no request unfinished, no block held or lent, its KV cache not lost; handed out again, its prefix cache is
emptied first, so its scheduling is a new engine's (the programs it compiled stay: that is the point). What stays
is what a test must not read as its own: the cumulative statistics (`engine.stats()`) and the compiled programs
(`compilations`, `num_programs`); a test that counts them borrows with `fresh=True` or counts the difference.
A module drops its pool's engines when its tests are done (`clear`, from a module-scoped fixture).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator


class EnginePool:
    def __init__(self, make: Callable[..., object]):
        self.make = make
        self._idle: dict[tuple, list] = {}

    def key(self, config: dict) -> tuple:
        """`config` with `make`'s defaults filled in, as a dictionary key."""
        bound = inspect.signature(self.make).bind(**config)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        for name, param in bound.signature.parameters.items():
            if param.kind is inspect.Parameter.VAR_KEYWORD:
                arguments.update(arguments.pop(name))
        return tuple(sorted(arguments.items()))

    @contextlib.contextmanager
    def engine(self, fresh: bool = False, **config) -> Iterator:
        idle = self._idle.setdefault(self.key(config), [])
        if idle and not fresh:
            engine = idle.pop()
            assert engine.scheduler.reset_prefix_cache(), "an idle engine holds no block"
        else:
            engine = self.make(**config)
        yield engine
        if is_idle(engine):
            idle.append(engine)

    def clear(self) -> None:
        for engines in self._idle.values():
            for engine in engines:
                engine.close()
        self._idle.clear()


def is_idle(engine) -> bool:
    kv = engine.scheduler.kv_cache_manager
    return (not engine.has_unfinished_requests() and kv.block_pool.num_used == 0 and not kv.lent_block_ids
            and not engine.runner.kv_cache_lost)
