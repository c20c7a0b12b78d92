"""agentspec: an embedded asyncio SDK for lossless speculative decoding of a local LLM in agents.

Public surface (locked by ``tests/test_public_api.py``)::

    async with agentspec.Client() as client:
        async for ev in client.stream(messages, max_tokens=256): ...
        done = await client.generate(messages)
"""

from .client import Client, Stream
from .errors import (
    AgentSpecError,
    ClientClosedError,
    ContextLengthError,
    EngineError,
    EngineOverloadedError,
    InvalidRequestError,
    ModelLoadError,
    RemoteError,
    RequestTimeoutError,
    UnsupportedFeatureError,
)
from .types import Completion, Done, Event, Limits, SpecConfig, SpecStats, TextDelta, ToolCall, ToolCallDelta, Usage

__version__ = "0.1.0"

__all__ = [
    "Client",
    "Stream",
    "SpecConfig",
    "Limits",
    "SpecStats",
    "Usage",
    "Event",
    "TextDelta",
    "ToolCallDelta",
    "ToolCall",
    "Done",
    "Completion",
    "AgentSpecError",
    "InvalidRequestError",
    "ContextLengthError",
    "UnsupportedFeatureError",
    "ModelLoadError",
    "ClientClosedError",
    "EngineOverloadedError",
    "RequestTimeoutError",
    "EngineError",
    "RemoteError",
]
