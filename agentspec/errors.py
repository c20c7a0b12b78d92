"""The agentspec exception tree.

Every error agentspec raises derives from :class:`AgentSpecError`, and every message says how to fix
its cause::

    AgentSpecError
    ├── InvalidRequestError (also ValueError)   bad request input, raised before any work starts
    │   ├── ContextLengthError                  the prompt does not fit the model's context window
    │   ├── LimitExceededError                  the request would cost more than a ``Limits`` field allows
    │   └── UnsupportedFeatureError             a valid OpenAI-shaped option this build cannot serve yet
    ├── ModelLoadError                          the model or a package it needs is missing or unsafe
    ├── ClientClosedError                       the client is not started, or already closed
    ├── EngineOverloadedError                   the request queue is full; retry later
    ├── RequestTimeoutError (also TimeoutError) the request ran past its `timeout`; text streamed so far stands
    └── EngineError                             decoding failed for one request; others are unaffected
        └── RemoteError                         the server (``Client(base_url=...)``) failed it or could not be reached
"""

from __future__ import annotations

__all__ = [
    "AgentSpecError",
    "InvalidRequestError",
    "ContextLengthError",
    "LimitExceededError",
    "UnsupportedFeatureError",
    "ModelLoadError",
    "ClientClosedError",
    "EngineOverloadedError",
    "RequestTimeoutError",
    "EngineError",
    "RemoteError",
]


class AgentSpecError(Exception):
    """Root of every error raised by agentspec."""


class InvalidRequestError(AgentSpecError, ValueError):
    """The request is malformed; nothing was run. The message names the parameter and the fix."""


class ContextLengthError(InvalidRequestError):
    """The prompt leaves no room to generate within the model's context window."""


class LimitExceededError(InvalidRequestError):
    """The request would cost more than the client allows (a grammar too large or too slow to build, a
    chat template too slow to render); nothing was run. ``limit`` names the ``Limits`` field that
    sets the bound, ``code`` the refusal (``agentspec serve`` sends it as the error's code)."""

    def __init__(self, message: str, *, limit: str, code: str) -> None:
        super().__init__(message)
        self.limit = limit
        self.code = code


class UnsupportedFeatureError(InvalidRequestError):
    """A well-formed option that this build of agentspec does not serve yet."""


class ModelLoadError(AgentSpecError):
    """The model could not be found or loaded; the message says what to install or pass instead."""


class ClientClosedError(AgentSpecError):
    """The client is not running: start it with ``async with Client()`` or ``await client.start()``."""


class EngineOverloadedError(AgentSpecError):
    """The engine's request queue is full; retry after some requests finish."""


class RequestTimeoutError(AgentSpecError, TimeoutError):
    """The request did not finish within its ``timeout`` (queueing included). Events already received
    were verified and stand; raise ``timeout`` or lower ``max_tokens``."""


class EngineError(AgentSpecError):
    """Decoding failed for one request (the cause is chained). Other requests keep running."""


class RemoteError(EngineError):
    """The server of a ``Client(base_url=...)`` failed the request, refused the key, or could not be
    reached; the message carries the server's. ``status`` is its HTTP status, when it sent one."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
