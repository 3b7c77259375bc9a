"""forerun: an LLM serving engine whose scheduler runs one step ahead of the model."""

from forerun.engine.llm import LLM
from forerun.outputs import CompletionOutput, RequestOutput
from forerun.sampling_params import SamplingParams
from forerun.structured.spec import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
