"""specserve: a speculative-decoding-first LLM serving engine."""
from specserve.config import EngineConfig
from specserve.engine import LLM, LLMEngine
from specserve.outputs import RequestOutput
from specserve.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams", "__version__"]
