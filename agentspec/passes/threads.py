"""Whose threads a pass on the GGUF kernels runs on: the kernels' own, and the calling thread alone
for torch's operations between their calls.

The kernels share a pass's products and attention among threads of their own (``blocks.c``:
``run_threads``). torch's operations around them (the kept rows' index, the final norm, a
verification's softmax over the vocabulary) run on torch's OpenMP team once they pass a few
thousand elements, and the team's threads then spin-wait for milliseconds (libgomp's
``GOMP_SPINCOUNT``) on the cores the kernels' threads need: on 2 cores a verification cost up to
1.4 times what it does with torch's operations on the calling thread alone (docs/kernels.md).

``kernel_scope`` does that for the calling thread: its OpenMP thread count (a per-thread setting,
which torch's ``get_num_threads`` reads) is 1 within the scope, and the kernels take the count it
had (``kernel_threads``). Other threads keep theirs. Where torch has no OpenMP runtime this module
can reach (another threading backend, a runtime under another name), the scope changes nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from contextlib import contextmanager
from typing import Iterator

import torch

__all__ = ["controls_openmp", "kernel_scope", "kernel_threads"]

log = logging.getLogger("agentspec")

# the OpenMP runtimes torch's builds link (GNU's in the Linux wheels, LLVM's and Intel's in others)
OPENMP_RUNTIMES = ("libgomp.so.1", "libomp.so", "libiomp5.so")

_local = threading.local()


def _loaded_runtimes() -> list[str]:
    """The OpenMP runtimes this process has mapped, by path (a wheel may carry one under a name of its
    own, e.g. ``libgomp-a34b3233.so.1``), then by their usual names."""
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                path = fields[5].strip() if len(fields) == 6 else ""
                if os.path.basename(path).startswith(("libgomp", "libomp", "libiomp5")) and path not in paths:
                    paths.append(path)
    except OSError:  # no /proc (macOS): the usual names only
        pass
    return [*paths, *OPENMP_RUNTIMES]


def _openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime torch already loaded (none is loaded here), or None."""
    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    no_load = getattr(os, "RTLD_NOLOAD", None)
    if no_load is None:
        return None
    for name in _loaded_runtimes():
        try:
            runtime = ctypes.CDLL(name, mode=no_load | os.RTLD_LAZY)
        except OSError:
            continue
        if hasattr(runtime, "omp_set_num_threads") and hasattr(runtime, "omp_get_max_threads"):
            return runtime
    log.debug("torch's OpenMP runtime is none of %s: torch's operations between the kernels' calls keep its threads", OPENMP_RUNTIMES)
    return None


_runtime = _openmp_runtime()


def controls_openmp() -> bool:
    """Whether ``kernel_scope`` reaches torch's OpenMP runtime here (else it changes nothing)."""
    return _runtime is not None


def kernel_threads() -> int:
    """How many threads the kernels share a call among: the count ``kernel_scope`` took from the
    calling thread, else torch's for it."""
    return getattr(_local, "threads", None) or torch.get_num_threads()


@contextmanager
def kernel_scope() -> Iterator[None]:
    """Within it, the calling thread's torch operations run on that thread alone and the kernels on
    the thread count torch had for it. Nested scopes are the outer one; the count is restored on
    leaving."""
    if _runtime is None or getattr(_local, "threads", None) is not None:
        yield
        return
    threads = torch.get_num_threads()  # also torch's per-thread set-up, which would reset the count below
    _local.threads = threads
    _runtime.omp_set_num_threads(1)
    try:
        yield
    finally:
        _runtime.omp_set_num_threads(threads)
        _local.threads = None
