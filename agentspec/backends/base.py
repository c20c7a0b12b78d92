"""The cut between ``Client`` and what runs its requests.

``Client`` validates a request and shapes what comes back into events; a backend runs it. A backend
opens a ``BackendStream`` per request, which yields ``Step``s: increments of verified output. The
last step carries the finish reason, usage and statistics, so the client never reads the worker's
state. Two backends exist: ``LocalBackend`` (the embedded engine) and ``RemoteBackend`` (an
OpenAI-compatible server: ``agentspec serve``, vLLM, SGLang, llama.cpp's server).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ..params import GenerationParams
from ..types import SpecStats, Usage

__all__ = ["Backend", "BackendStream", "CallFragment", "Request", "Step"]


@dataclass(frozen=True, slots=True)
class Request:
    """One request as a backend receives it: the chat, the validated decoding parameters, and the
    caller's keyword arguments as given (a remote backend forwards those in the wire format)."""

    messages: Any
    params: GenerationParams
    options: dict[str, Any]


@dataclass(frozen=True, slots=True)
class CallFragment:
    """A structured piece of a tool call, as a server streams it (``id``/``name`` may repeat)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True, slots=True)
class Step:
    """Verified output of one step of a request.

    ``text`` is the reply's text, or with ``is_call`` the raw call text the model wrote (one JSON
    call per line, which the client parses); a server's structured calls come as ``calls``.
    ``token_ids`` are empty where the backend does not report them. The last step has a
    ``finish_reason`` and carries ``usage`` and ``stats``.
    """

    text: str = ""
    token_ids: tuple[int, ...] = ()
    is_call: bool = False
    calls: tuple[CallFragment, ...] = ()
    finish_reason: str | None = None
    usage: Usage | None = None
    stats: SpecStats | None = None


class BackendStream(Protocol):
    """One request in a backend. ``submit`` starts it; ``receive`` returns its next step or raises
    the request's ``AgentSpecError`` (steps already received stand); ``aclose`` stops it and releases
    what it holds (idempotent). A stream dropped without ``aclose`` stops too (its finalizer)."""

    @property
    def request_id(self) -> str: ...

    async def submit(self) -> None: ...

    async def receive(self) -> Step: ...

    async def aclose(self) -> None: ...


class Backend(Protocol):
    """Runs requests. ``open`` validates what only the backend can (the prompt's length against the
    context window) and raises before any work starts."""

    name: str  # "local", or the kind of server: "agentspec", "vllm", "sglang", "llamacpp", "openai"

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...

    def open(self, request: Request) -> BackendStream: ...

    def metrics(self, tag: str | None = None) -> SpecStats: ...

    def metrics_text(self) -> str: ...
