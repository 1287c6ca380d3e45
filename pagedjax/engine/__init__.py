"""The engine: the scheduler (host) and the model runner (device) in one loop, and what runs on top of it.

  llm_engine.py     LLMEngine: requests in, one step at a time, RequestOutputs out; recovery from failed steps
  runner.py         ModelRunner: the device state (weights, KV cache) and the jitted step and fused decode
  beam_search.py    beam search over forked requests
  inputs.py         requests -> a step's padded device inputs (sampling, penalties, log-probability targets)
  outputs.py        sampled tokens -> RequestOutputs: incremental text, stop strings, log-probabilities
  generate.py       a whole batch through any engine
  data_parallel.py  DataParallelEngine: replicas behind one LLMEngine-shaped front
  protocol.py       Engine: what every engine-shaped class offers
  factory.py        make_engine / load_engine: one LLMEngine, or a DataParallelEngine, from a parallel layout
"""

from pagedjax.engine.data_parallel import DataParallelEngine
from pagedjax.engine.factory import load_engine, make_engine
from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.engine.protocol import Engine
from pagedjax.engine.stats import EngineStats
from pagedjax.outputs import BeamSearchOutput, BeamSequence
from pagedjax.sampling_params import BeamSearchParams

__all__ = ["BeamSearchOutput", "BeamSearchParams", "BeamSequence", "DataParallelEngine", "Engine",
           "EngineStats", "LLMEngine", "load_engine",
           "make_engine"]
