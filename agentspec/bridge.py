"""Shared clients on a background event loop, for frameworks that call a model from anywhere.

An ``agentspec.Client`` and its streams belong to the asyncio loop that uses them (the engine hands
events over with ``loop.call_soon_threadsafe``). Agent frameworks (LangChain, LlamaIndex) call a
model from plain threads, from the caller's own event loop, and from sync methods inside a running
loop (Jupyter), so no caller's loop can own the client. Instead one daemon thread runs a private
loop; every request runs there as a task, and its events are handed to the caller:

- ``iterate`` (sync): a thread-safe queue the calling thread blocks on. Never ``asyncio.run``, so it
  works inside a running loop.
- ``aiterate`` (async): the caller's loop gets each event through ``call_soon_threadsafe``.

Cancellation: closing either iterator (break, ``aclose()``, a cancelled consumer task, garbage
collection of an abandoned generator) cancels the request's task on the background loop, which
closes the agentspec stream, which stops decoding before the engine's next step.

Clients are shared per ``ClientKey`` (model, device, dtype; or a server's base_url and key) across
every integration in the process: the weights load once and one engine worker serves them all.
Nothing starts until first use.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import queue
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, NamedTuple, TypeVar

from .client import Client

__all__ = ["Backend", "ClientKey", "backend"]

T = TypeVar("T")
_END = object()  # the request's task finished; its result (or error) is in the future
CLOSE_TIMEOUT_S = 5.0


class ClientKey(NamedTuple):
    """What identifies a shared client: ``agentspec.Client(model, device=..., dtype=...)``, or with
    ``base_url`` a client of that server (``model`` is then the server's model id)."""

    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    base_url: str | None = None
    api_key: str | None = None

    def __repr__(self) -> str:  # the key stays out of logs and tracebacks
        shown = ("***" if name == "api_key" and value is not None else value for name, value in zip(self._fields, self))
        return f"ClientKey({', '.join(f'{name}={value!r}' for name, value in zip(self._fields, shown))})"

    def client(self) -> Client:
        if self.base_url is not None:
            return Client(self.model, base_url=self.base_url, api_key=self.api_key)
        return Client(self.model, device=self.device, dtype=self.dtype)


class Backend:
    """A daemon thread running the event loop that owns every shared client."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._starts: dict[ClientKey, asyncio.Future[Client]] = {}  # read and written on self.loop only
        self._thread = threading.Thread(target=self.loop.run_forever, name="agentspec-bridge", daemon=True)
        self._thread.start()

    async def client(self, key: ClientKey) -> Client:
        """The started client for ``key`` (on the background loop). Loads the model on first use; a
        failed start is retried by the next caller; one caller giving up does not abort the load."""
        start = self._starts.get(key)
        if start is None or (start.done() and (start.cancelled() or start.exception() is not None)):
            start = self._starts[key] = asyncio.ensure_future(key.client().start())
        return await asyncio.shield(start)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the background loop, blocking the calling thread for its result."""
        future = self._submit(coro)
        try:
            return future.result()
        finally:
            future.cancel()  # e.g. KeyboardInterrupt while waiting

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("agentspec's bridge was called from its own background loop; call it from your code instead.")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def _pump(self, key: ClientKey, messages: Any, params: dict[str, Any], emit: Callable[[Any], None]) -> None:
        client = await self.client(key)
        async with client.stream(messages, **params) as stream:
            async for event in stream:
                emit(event)

    def _start_request(self, key: ClientKey, messages: Any, params: dict[str, Any], emit: Callable[[Any], None]) -> concurrent.futures.Future[None]:
        future = self._submit(self._pump(key, messages, params, emit))
        future.add_done_callback(lambda _: emit(_END))  # after every event the task emitted
        return future

    def iterate(self, key: ClientKey, messages: Any, params: dict[str, Any]) -> Iterator[Any]:
        """agentspec events of one request, for a synchronous caller (blocks this thread, not a loop)."""
        events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        future = self._start_request(key, messages, params, events.put)
        try:
            while (event := events.get()) is not _END:
                yield event
            future.result()  # done: raises the request's error, if any
        finally:
            future.cancel()  # no-op when done; otherwise stops decoding

    async def aiterate(self, key: ClientKey, messages: Any, params: dict[str, Any]) -> AsyncIterator[Any]:
        """agentspec events of one request, delivered on the caller's event loop."""
        caller = asyncio.get_running_loop()
        events: asyncio.Queue[Any] = asyncio.Queue()
        future: concurrent.futures.Future[None] | None = None

        def emit(item: Any) -> None:  # runs on the background thread
            try:
                caller.call_soon_threadsafe(events.put_nowait, item)
            except RuntimeError:  # the caller's loop is closed: nobody will read this request
                if future is not None:
                    future.cancel()

        future = self._start_request(key, messages, params, emit)
        try:
            while (event := await events.get()) is not _END:
                yield event
            future.result()
        finally:
            future.cancel()

    def close(self) -> None:
        """Close every client and stop the loop (at interpreter exit)."""

        async def close_clients() -> None:
            starts, self._starts = list(self._starts.values()), {}
            clients = [s.result() for s in starts if s.done() and not s.cancelled() and s.exception() is None]
            await asyncio.gather(*(c.aclose() for c in clients), return_exceptions=True)

        if self.loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(close_clients(), self.loop).result(CLOSE_TIMEOUT_S)
            except Exception:  # exiting anyway; the engine threads are daemons
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
            # Let the loop thread finish dropping the clients before the interpreter shuts down: a
            # daemon thread still freeing tensors then aborts the process.
            self._thread.join(CLOSE_TIMEOUT_S)


_backend: Backend | None = None
_backend_lock = threading.Lock()


def backend() -> Backend:
    """The process-wide backend, started on first use (constructing a framework model starts nothing)."""
    global _backend
    with _backend_lock:
        if _backend is None:
            _backend = Backend()
            atexit.register(_backend.close)
        return _backend
