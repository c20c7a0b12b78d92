"""agentspec: an embedded asyncio SDK for lossless speculative decoding of a local LLM in agents.

Public surface (locked by ``tests/test_public_api.py``)::

    async with agentspec.Client() as client:
        async for ev in client.stream(messages, max_tokens=256): ...
        done = await client.generate(messages)

The distribution on the package index is ``agentspec-llm`` (``agentspec`` there is an unrelated
project); the import name is ``agentspec``. ``__version__`` is the installed distribution's.
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

DISTRIBUTION = "agentspec-llm"


def _installed_version() -> str:
    """The installed distribution's version; ``0+unknown`` for a source tree that was never installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return "0+unknown"


__version__ = _installed_version()

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
