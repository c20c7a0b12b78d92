"""``agentspec serve``: start one ``Client``, serve it over HTTP with uvicorn, close it on exit.

The model loads before the port opens, so a caller that can connect finds the model ready; the
command prints one line when it is. SIGINT/SIGTERM stop accepting connections, give open replies
``SHUTDOWN_GRACE_S`` to finish, then close the client (cancelling what still decodes).

Safe by default (docs/security.md): loopback only; a non-loopback address without an API key is
refused unless ``allow_unauthenticated``; ``Host`` headers checked against loopback names and the
bound host; uvicorn's h11 protocol with bounded connections (``limit_concurrency``), header size and
keep-alive; shadow checks off (``Limits.max_shadow_rate`` 0), whatever a request asks.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import sys
import threading
from typing import Any, Iterator, Sequence

import uvicorn

from ..client import Client
from ..errors import InvalidRequestError
from ..types import Limits
from .app import BODY_TIMEOUT_S, LOOPBACK_HOSTS, LoopLag, create_app

__all__ = ["serve", "main", "API_KEY_ENV", "AnnouncingServer", "SERVER_LIMITS"]

API_KEY_ENV = "AGENTSPEC_API_KEY"
SHUTDOWN_GRACE_S = 5
LOOPBACK = ("127.0.0.1", "::1", "localhost")
WILDCARDS = ("0.0.0.0", "::", "")
# A server's client: like an embedded one, except that requests (strangers) cannot ask for shadow
# checks, which re-decode a whole request: the operator turns them on with --shadow-rate.
SERVER_LIMITS = Limits(max_shadow_rate=0.0, grammar_processes=2)
# Connections (open or idle keep-alive) beyond the request queue: room for /health and /metrics while
# the queue is full, so a full engine answers 429, and a flood of idle sockets meets uvicorn's 503.
CONNECTION_HEADROOM = 32
# Request line and headers: an OpenAI client sends under 2 KiB; 16 KiB is h11's own default.
MAX_HEADER_BYTES = 16 * 2**10
KEEP_ALIVE_S = 5  # an idle connection is closed after this (uvicorn's default)


def allowed_hosts(host: str, extra: Sequence[str] = ()) -> tuple[str, ...]:
    """The ``Host`` names a server bound to ``host`` answers to: loopback names, ``host`` itself
    (unless it is a wildcard such as 0.0.0.0, which no caller names), and ``extra``."""
    bound = () if host in WILDCARDS else (host,)
    return tuple(dict.fromkeys((*LOOPBACK_HOSTS, *bound, *extra)))


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
    api_keys: Sequence[str] = (),
    share_caches: bool = False,
    model_name: str | None = None,
    draft: str | None = None,
    device: str = "auto",
    dtype: str = "auto",
    weights: str = "auto",
    limits: Limits = SERVER_LIMITS,
    log_level: str = "warning",
    allowed_host: Sequence[str] = (),
    allow_unauthenticated: bool = False,
    limit_concurrency: int | None = None,
    max_header_bytes: int = MAX_HEADER_BYTES,
    timeout_keep_alive: int = KEEP_ALIVE_S,
    body_timeout_s: float = BODY_TIMEOUT_S,
) -> None:
    """Serve ``model`` (as ``Client`` takes it) until SIGINT/SIGTERM. ``model_name`` is the id
    callers send (default: the loaded model's name); ``api_key`` makes every route but /health need
    ``Authorization: Bearer <api_key>``; ``api_keys`` are more keys, each a tenant with caches of its
    own unless ``share_caches`` (``create_app``). ``allowed_host``: more ``Host`` names to answer to (``"*"``:
    any); ``limit_concurrency``: open connections before uvicorn answers 503 (default: the request
    queue plus ``CONNECTION_HEADROOM``). Raises ``InvalidRequestError`` before loading anything when
    ``host`` is not loopback and there is no key, unless ``allow_unauthenticated``."""
    keyed = bool(api_key or api_keys)
    if not keyed and host not in LOOPBACK and not allow_unauthenticated:
        raise InvalidRequestError(
            f"Refusing to serve on {host or 'every address'} without an API key: anyone who reaches the port could use "
            f"the model. Pass --api-key (or set {API_KEY_ENV}), bind 127.0.0.1, or pass --allow-unauthenticated "
            "if the network in front of it already checks who calls."
        )
    async with Client(model, draft=draft, device=device, dtype=dtype, weights=weights, limits=limits) as client:
        # The model, torch and the libraries are ~400,000 objects that live as long as the server: a
        # full collection walks them all (0.3 s on a 2-core Zen 4, holding the GIL: the event loop
        # stalls), and a flood of requests makes the collector run often. Frozen, they are skipped.
        gc.collect()
        gc.freeze()
        lag = LoopLag()
        watcher = asyncio.get_running_loop().create_task(lag.watch())
        name = model_name or client.loaded.name
        app = create_app(
            client,
            model_name=name,
            api_key=api_key,
            api_keys=api_keys,
            share_caches=share_caches,
            allowed_hosts=allowed_hosts(host, allowed_host),
            body_timeout_s=body_timeout_s,
            loop_lag=lag,
        )
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
            http="h11",  # the protocol whose header limit is configurable (httptools, when installed, has none to set)
            h11_max_incomplete_event_size=max_header_bytes,
            limit_concurrency=limit_concurrency or limits.max_queued + CONNECTION_HEADROOM,
            timeout_keep_alive=timeout_keep_alive,
        )
        count = len({*([api_key] if api_key else []), *api_keys})
        key = "no API key" if not keyed else "API key required" if count == 1 else f"{count} API keys (tenants{', caches shared' if share_caches else ''})"
        try:
            await AnnouncingServer(config, f"agentspec serve: {name} on {client.loaded.device}, ready at {{url}} ({key})").serve()
        finally:
            watcher.cancel()


def read_keys(path: str) -> list[str]:
    """The keys of a keys file: one a line; blank lines and ``#`` comments skipped."""
    try:
        with open(path, encoding="utf-8") as file:
            lines = file.read().splitlines()
    except OSError as exc:
        raise InvalidRequestError(f"Cannot read the API keys file {path!r} ({exc.strerror}); pass a readable file of one key a line.") from None
    keys = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    if not keys:
        raise InvalidRequestError(f"The API keys file {path!r} holds no key; write one key a line.")
    return keys


async def main(args: Any) -> int:
    """The ``agentspec serve`` command (arguments from ``agentspec.cli``)."""
    keys = [*args.api_key, *(read_keys(args.api_keys_file) if args.api_keys_file else [])]
    if not keys and os.environ.get(API_KEY_ENV):
        keys = [os.environ[API_KEY_ENV]]
    if not keys and args.host not in LOOPBACK and args.allow_unauthenticated:
        print(f"agentspec serve: warning: {args.host} without an API key: anyone who reaches this port can use the model "
              f"(pass --api-key or set {API_KEY_ENV}).", file=sys.stderr)
    limits = Limits(
        max_batch=args.max_batch,
        max_queued=args.max_queued,
        prefix_cache_mb=args.prefix_cache_mb,
        max_json_depth=args.max_json_depth,
        max_json_values=args.max_json_values,
        max_tags=args.max_tags,
        max_shadow_rate=args.shadow_rate,
        max_grammar_chars=args.max_grammar_chars,
        grammar_timeout_s=args.grammar_timeout_s,
        grammar_cache_mb=args.grammar_cache_mb,
        template_timeout_s=args.template_timeout_s,
        grammar_processes=args.grammar_processes,
    )
    await serve(
        args.model,
        host=args.host,
        port=args.port,
        api_keys=keys,
        share_caches=args.share_caches,
        model_name=args.served_model_name,
        draft=args.draft,
        device=args.device,
        dtype=args.dtype,
        weights=args.weights,
        limits=limits,
        log_level=args.log_level,
        allowed_host=args.allowed_host,
        allow_unauthenticated=args.allow_unauthenticated,
        limit_concurrency=args.limit_concurrency,
        max_header_bytes=args.max_header_bytes,
        timeout_keep_alive=args.timeout_keep_alive,
        body_timeout_s=args.body_timeout_s,
    )
    return 0
