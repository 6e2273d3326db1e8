"""The engine: requests, scheduler, model runner, sampler, and its Python APIs."""

from .async_engine import AsyncEngine, EngineDeadError
from .engine_core import EngineCore
from .llm import LLM
from .request import RequestOutput, RequestStatus
from .sampling_params import SamplingParams

__all__ = ["LLM", "AsyncEngine", "EngineCore", "EngineDeadError", "RequestOutput", "RequestStatus", "SamplingParams"]
