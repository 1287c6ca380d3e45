"""Building an engine from a parallel layout: one `LLMEngine`, or a `DataParallelEngine` of several.

    engine = pagedjax.load_engine("path/to/model",
                                  parallel_config=ParallelConfig(tensor_parallel_size=4, data_parallel_size=2))
"""

from __future__ import annotations

from pagedjax.config.engine import EngineConfig, engine_config, takes_options
from pagedjax.engine.data_parallel import DataParallelEngine
from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.engine.protocol import Engine


def _engine_class(layout) -> type:
    """The engine class of a parallel layout (a `ParallelConfig` or None; anything else its engine refuses)."""
    return DataParallelEngine if getattr(layout, "data_parallel_size", 1) > 1 else LLMEngine


@takes_options()
def make_engine(config: EngineConfig | None = None, *, model=None, params=None, tokenizer=None,
                image_processor=None, devices=None, classifier=None, **options) -> Engine:
    """`LLMEngine(...)`, or a `DataParallelEngine` when the options' `parallel_config` has `data_parallel_size`
    > 1; the arguments are theirs."""
    config = engine_config(config, options, "make_engine")
    return _engine_class(config.parallel_config)(config, model=model, params=params, tokenizer=tokenizer,
                                                 image_processor=image_processor, devices=devices,
                                                 classifier=classifier)


def load_engine(path=None, **kwargs) -> Engine:
    """`LLMEngine.from_pretrained(path, ...)`, or `DataParallelEngine.from_pretrained` when the options'
    `parallel_config` has `data_parallel_size` > 1; the arguments are `from_pretrained`'s."""
    return _engine_class(kwargs.get("parallel_config")).from_pretrained(path, **kwargs)
