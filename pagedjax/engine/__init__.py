"""The engine: the scheduler (host) and the model runner (device) in one loop, and what runs on top of it.

  llm_engine.py     LLMEngine: requests in, one step at a time, RequestOutputs out; recovery from failed steps
  runner.py         ModelRunner: the device state (weights, KV cache) and the jitted step and fused decode
  beam_search.py    beam search over forked requests
  data_parallel.py  DataParallelEngine: replicas behind one LLMEngine-shaped front
"""

from pagedjax.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSequence
from pagedjax.engine.data_parallel import DataParallelEngine, DataParallelStats
from pagedjax.engine.llm_engine import EngineStats, LLMEngine

__all__ = ["BeamSearchOutput", "BeamSearchParams", "BeamSequence", "DataParallelEngine", "DataParallelStats",
           "EngineStats", "LLMEngine"]
