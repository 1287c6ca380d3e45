"""The engine: the loop that runs every kind of step one way, and what runs on top of it.

  llm_engine.py        LLMEngine: requests in; each step plan -> inputs -> device -> StepResult -> Scheduler.update
                       -> outputs -> proposals; recovery from failed steps
  output_processor.py  sampled tokens -> RequestOutputs: incremental text, stop strings (its decisions returned),
                       log-probabilities
  beam_search.py       beam search over forked requests
  generate.py          a whole batch through any engine
  data_parallel.py     DataParallelEngine: replicas behind one LLMEngine-shaped front
  multihost.py         MultiHostEngine (process 0) and follow (the others): one engine over several processes
  commands.py          what changes an engine's state between steps, and its wire form (multihost's messages)
  protocol.py          Engine: what every engine-shaped class offers; PreparedRequest
  factory.py           make_engine / load_engine: one LLMEngine, or a DataParallelEngine, from a parallel layout
  scoring.py stats.py  score; EngineStats
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
