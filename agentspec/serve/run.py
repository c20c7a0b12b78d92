"""``agentspec serve``: start one ``Client``, serve it over HTTP with uvicorn, close it on exit.

The model loads before the port opens, so a caller that can connect finds the model ready; the
command prints one line when it is. SIGINT/SIGTERM stop accepting connections, give open replies
``SHUTDOWN_GRACE_S`` to finish, then close the client (cancelling what still decodes).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
from typing import Any, Iterator

import uvicorn

from ..client import Client
from ..types import Limits
from .app import create_app

__all__ = ["serve", "main", "API_KEY_ENV", "AnnouncingServer"]

API_KEY_ENV = "AGENTSPEC_API_KEY"
SHUTDOWN_GRACE_S = 5
LOOPBACK = ("127.0.0.1", "::1", "localhost")


class AnnouncingServer(uvicorn.Server):
    """uvicorn's server, printing ``announce`` (with ``{url}``: its base URL) once listening; SIGINT/SIGTERM
    end it cleanly (exit code 0), and ``serve`` returns to its caller."""

    def __init__(self, config: uvicorn.Config, announce: str) -> None:
        super().__init__(config)
        self.announce = announce

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            host = f"[{host}]" if ":" in host else host
            print(self.announce.format(url=f"http://{host}:{port}/v1"), flush=True)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises the signal after shutting down, which would end the process before the
        # client closes; here a signal only asks the server to exit, and `serve` returns normally.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.handle_exit, sig, None)
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)


async def serve(
    model: str | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    model_name: str | None = None,
    draft: str | None = None,
    device: str = "auto",
    dtype: str = "auto",
    weights: str = "auto",
    limits: Limits = Limits(),
    log_level: str = "warning",
) -> None:
    """Serve ``model`` (as ``Client`` takes it) until SIGINT/SIGTERM. ``model_name`` is the id
    callers send (default: the loaded model's name); ``api_key`` makes every route but /health need
    ``Authorization: Bearer <api_key>``."""
    async with Client(model, draft=draft, device=device, dtype=dtype, weights=weights, limits=limits) as client:
        name = model_name or client.loaded.name
        app = create_app(client, model_name=name, api_key=api_key)
        config = uvicorn.Config(
            app, host=host, port=port, log_level=log_level, access_log=False, lifespan="off", timeout_graceful_shutdown=SHUTDOWN_GRACE_S
        )
        key = "API key required" if api_key else "no API key"
        await AnnouncingServer(config, f"agentspec serve: {name} on {client.loaded.device}, ready at {{url}} ({key})").serve()


async def main(args: Any) -> int:
    """The ``agentspec serve`` command (arguments from ``agentspec.cli``)."""
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if api_key is None and args.host not in LOOPBACK:
        print(f"agentspec serve: warning: {args.host} without an API key: anyone who reaches this port can use the model "
              f"(pass --api-key or set {API_KEY_ENV}).", file=sys.stderr)
    await serve(
        args.model,
        host=args.host,
        port=args.port,
        api_key=api_key,
        model_name=args.served_model_name,
        draft=args.draft,
        device=args.device,
        dtype=args.dtype,
        weights=args.weights,
        limits=Limits(max_batch=args.max_batch, max_queued=args.max_queued, prefix_cache_mb=args.prefix_cache_mb),
        log_level=args.log_level,
    )
    return 0
