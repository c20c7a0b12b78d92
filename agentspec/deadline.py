"""Work a caller's input decides the cost of, run with a time limit.

A chat template is a program (sandboxed Jinja) that a model file brings and a request's messages
drive; a loop in it, or a prompt of megabytes, can take as long as it likes. ``call_with_deadline``
runs such work on a thread of its own and, when the time limit passes, raises the caller's typed
error at once and stops the thread: an exception is raised inside it
(``PyThreadState_SetAsyncExc``, CPython's way to interrupt another thread), which ends Python code
(Jinja's loops) at its next instruction. Code inside a C extension (a tokenizer) runs to its end
first; its input is bounded by the request body's size.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Callable, TypeVar

__all__ = ["call_with_deadline"]

T = TypeVar("T")


class _Interrupted(BaseException):
    """Raised inside a thread whose time ran out (a BaseException: ``except Exception`` in a
    template's own code cannot swallow it)."""


def _interrupt(thread: threading.Thread) -> None:
    if thread.ident is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(_Interrupted))


def call_with_deadline(fn: Callable[[], T], timeout_s: float, on_timeout: Callable[[], BaseException], *, name: str = "agentspec-deadline") -> T:
    """``fn()``, or ``on_timeout()`` raised once ``timeout_s`` seconds pass (``fn`` is then stopped as
    described above). What ``fn`` raises is raised here. Blocks the calling thread: call it off the
    event loop where that matters."""
    outcome: dict[str, object] = {}
    lock = threading.Lock()
    finished = False

    def run() -> None:
        nonlocal finished
        try:
            try:
                value = fn()
            finally:
                with lock:
                    finished = True
            outcome["value"] = value
        except _Interrupted:
            pass
        except BaseException as exc:  # handed to the caller
            outcome["error"] = exc

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(timeout_s)
    with lock:
        late = not finished
        if late:
            _interrupt(thread)  # under the lock: never after ``fn`` returned
    if late:
        raise on_timeout()
    thread.join()  # finished: only the bookkeeping above is left
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]
