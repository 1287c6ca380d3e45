"""Building an engine from a parallel layout: one `LLMEngine`, or a `DataParallelEngine` of several.

    engine = pagedjax.load_engine("path/to/model", tensor_parallel_size=4, data_parallel_size=2)
"""

from __future__ import annotations

from pagedjax.config.parallel import ParallelConfig, parallel_layout
from pagedjax.engine.data_parallel import DataParallelEngine
from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.engine.protocol import Engine


def make_engine(model_config=None, cache_config=None, scheduler_config=None, params=None, seed: int = 0, *,
                parallel_config: ParallelConfig | None = None, tensor_parallel_size: int | None = None,
                data_parallel_size: int | None = None, **kwargs) -> Engine:
    """`LLMEngine(...)`, or a `DataParallelEngine` when the layout has `data_parallel_size` > 1; every other
    argument is `LLMEngine`'s."""
    config = parallel_layout(parallel_config, tensor_parallel_size, data_parallel_size)
    cls = DataParallelEngine if config is not None and config.data_parallel_size > 1 else LLMEngine
    return cls(model_config, cache_config, scheduler_config, params, seed, parallel_config=config, **kwargs)


def load_engine(path=None, *, parallel_config: ParallelConfig | None = None, tensor_parallel_size: int | None = None,
                data_parallel_size: int | None = None, **kwargs) -> Engine:
    """`LLMEngine.from_pretrained(path, ...)`, or `DataParallelEngine.from_pretrained` when the layout has
    `data_parallel_size` > 1; every other argument is `from_pretrained`'s."""
    config = parallel_layout(parallel_config, tensor_parallel_size, data_parallel_size)
    cls = DataParallelEngine if config is not None and config.data_parallel_size > 1 else LLMEngine
    return cls.from_pretrained(path, parallel_config=config, **kwargs)
