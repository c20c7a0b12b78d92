"""Grammar indexes built in child processes: a build past its time limit is killed, not abandoned.

outlines_core builds an index in native code that cannot be interrupted, holds the GIL for part of
the build (a second and more for a large schema: the event loop of a server stalls with it), and
may take seconds and hundreds of megabytes. Built in a child process, a build past
``Limits.grammar_timeout_s`` is killed (its core and memory come back at once), the server's GIL is
never held, and the memory a build used is returned to the system when the child exits. The index
comes back pickled (megabytes at most: the regex is bounded by ``Limits.max_grammar_chars``).

Children are forked from a ``forkserver`` (a clean process started on first use), never from the
server itself, whose threads (the engine worker, the HTTP server) could hold a lock at the fork.
"""

from __future__ import annotations

import multiprocessing
import pickle
import threading
import time
from multiprocessing import forkserver
from typing import Any, Callable

from ..errors import LimitExceededError

__all__ = ["ProcessIndexBuilder", "IndexBuildFailed"]


class IndexBuildFailed(Exception):
    """The compiler refused the regex (or its process died); ``GrammarCompiler.compile`` words it."""


def _build(regex: str, vocabulary: bytes, conn: Any) -> None:
    """In the child: the index of ``regex``, pickled, or ``None`` where the compiler refused it."""
    from outlines_core import Index

    try:
        payload: bytes | None = pickle.dumps(Index(regex, pickle.loads(vocabulary)))
    except Exception:  # its text stays here: the parent words the refusal
        payload = None
    conn.send_bytes(payload if payload is not None else b"")
    conn.close()


class ProcessIndexBuilder:
    """``builder(regex)`` → (an outlines_core ``Index`` over ``vocabulary``, its size serialised),
    built in a child process; at most ``processes`` at once (a build waits for a turn within its time
    limit). Loading the index here holds the GIL (~0.1 s for the 26 MB index of ``{"type":
    "object"}`` on a 2-core Zen 4); its size comes with it, so it is never serialised again."""

    def __init__(self, vocabulary: Any, *, processes: int, timeout_s: float, on_timeout: Callable[[], LimitExceededError]) -> None:
        self.timeout_s = timeout_s
        self.on_timeout = on_timeout
        self._vocabulary = pickle.dumps(vocabulary)
        self._turns = threading.BoundedSemaphore(processes)
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload([__name__])  # children start with outlines_core and this module imported
        forkserver.ensure_running()  # now (a second: it imports outlines_core), not within the first request's time limit

    def __call__(self, regex: str) -> tuple[Any, int]:
        deadline = time.monotonic() + self.timeout_s
        if not self._turns.acquire(timeout=self.timeout_s):
            raise self.on_timeout()
        try:
            receiving, sending = self._context.Pipe(duplex=False)
            child = self._context.Process(target=_build, args=(regex, self._vocabulary, sending), daemon=True, name="agentspec-grammar")
            child.start()
            sending.close()
            try:
                if not receiving.poll(max(deadline - time.monotonic(), 0.0)):
                    child.kill()
                    raise self.on_timeout()
                try:
                    payload = receiving.recv_bytes()
                except EOFError:  # the child died (killed for memory, say)
                    payload = b""
            finally:
                receiving.close()
                child.join(timeout=5)
                if child.is_alive():
                    child.kill()
                    child.join()
            if not payload:
                raise IndexBuildFailed()
            return pickle.loads(payload), len(payload)
        finally:
            self._turns.release()
