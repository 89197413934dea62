"""specserve: a speculative-decoding-first LLM serving engine."""
import sys

from specserve import cpu_threads

# OpenMP threads sleep at once between parallel regions where the machine is already busy
# (see cpu_threads): chosen before torch loads its OpenMP runtime, which reads it once.
if "torch" not in sys.modules:
    cpu_threads.choose_wait_policy()

from specserve.config import EngineConfig  # noqa: E402
from specserve.engine import LLM, LLMEngine  # noqa: E402
from specserve.outputs import RequestOutput  # noqa: E402
from specserve.sampling_params import SamplingParams  # noqa: E402

__version__ = "0.1.0"

__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams", "__version__"]
