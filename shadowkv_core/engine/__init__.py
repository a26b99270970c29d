"""The engine: sequence and scheduler (CPU bookkeeping), runner (the device step), sampler, and the request API."""
from .llm_engine import LLMEngine
from .sampling import SamplingParams
from .sequence import RequestOutput

__all__ = ["LLMEngine", "RequestOutput", "SamplingParams"]
