"""The worker thread that owns an engine, and the hand-off between it and the event loop.

Threading contract (anyio's ``to_thread`` semantics, made explicit):
- The event loop never runs torch. It submits ``RequestHandle``s and reads each request's
  ``Channel``; cancelling is setting a flag, which the worker honours before the sequence's next step.
- The worker never touches asyncio objects directly: it hands results over with
  ``loop.call_soon_threadsafe``. If that loop is gone, the request is cancelled.
- Back-pressure: a request whose consumer has ``Limits.max_pending_events`` undelivered outputs is not stepped
  (its KV cache just waits). If it stays stalled for ``abandon_after_s`` the stream is treated as
  abandoned and freed. Streams dropped without ``aclose`` are caught earlier by a finalizer.
- Batching: every active request that can take a step takes it in the same engine pass
  (``Engine.step_many``), one step each per cycle, so no stream starves. At most ``max_batch``
  requests decode at once; the rest wait in a bounded queue (``max_queued``, then
  ``EngineOverloadedError``), admitted in order as room and the keys/values budget allow.
- Deadlines: a request with a ``timeout`` that runs past it (queueing included) ends with
  ``RequestTimeoutError``; what it streamed before stands.
- Shadow checks (``shadow``) decode one step at a time, only while no request is active or queued;
  so do the pass shapes calibration left (``Engine.calibrate(idle=True)``), one pass at a time, first.
- All torch work of a client runs on this one thread, model loading and calibration included
  (``call``). With libgomp, every thread that runs a parallel torch op keeps its own OpenMP team,
  and once a process has more OpenMP threads than cores, every team stops spin-waiting, which slows
  torch's parallel ops. The GGUF kernels' passes share their work among threads of their own
  (blocks.c: ``run_threads``), which keep spin-waiting whatever other threads the process has;
  an engine's steps on them run torch's operations on this thread alone (``passes/threads.py``),
  so that torch's team does not spin on the cores the kernels' threads need.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import logging
import threading
import time
import weakref
from typing import Any, Callable

from .engine import Engine, Sequence, StepOutput
from .errors import ClientClosedError, EngineError, EngineOverloadedError, RequestTimeoutError
from .types import Limits

__all__ = ["Runtime", "RequestHandle", "Channel"]

log = logging.getLogger("agentspec.runtime")

# Runtimes whose worker may still be inside torch at interpreter exit. A daemon thread killed in the
# middle of a torch op aborts the process ("terminate called without an active exception", seen 1 in
# 3 exits with a stream left running), so exit stops them first: each finishes its step in flight.
_LIVE: weakref.WeakSet[Runtime] = weakref.WeakSet()
EXIT_JOIN_TIMEOUT_S = 10.0
# Admission estimates a request's keys/values as its prompt plus this many output tokens (or its
# max_tokens if fewer): most agent replies are shorter, and a long one keeps its room once admitted.
ESTIMATED_OUTPUT_TOKENS = 256
# How long the worker sleeps when no request could step (all waiting for their consumers): short
# enough that a consumer catching up resumes its stream within a few milliseconds.
STALLED_WAIT_S = 0.005
# Shadow checks waiting for idle time: a sample, so beyond this many a new one is dropped. Under
# constant load none runs, and an unbounded queue would keep every sampled request's prompt forever.
MAX_QUEUED_SHADOWS = 16


@atexit.register
def _stop_live_runtimes() -> None:
    for runtime in list(_LIVE):
        runtime.stop(timeout=EXIT_JOIN_TIMEOUT_S)


class Channel:
    """One request's outputs, worker → event loop. Each counter has a single writer thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.produced = 0  # written by the worker only
        self.consumed = 0  # written by the event loop only

    @property
    def pending(self) -> int:
        return self.produced - self.consumed

    def send(self, item: Any) -> bool:
        """Worker side. False when the event loop is closed (nobody will ever read this)."""
        self.produced += 1
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            return False
        return True

    async def receive(self) -> Any:
        item = await self.queue.get()
        self.consumed += 1
        return item


class RequestHandle:
    """What the event loop and the worker share about one request."""

    def __init__(self, seq: Sequence, channel: Channel, runtime: "Runtime") -> None:
        self.seq = seq
        self.channel = channel
        self._runtime = runtime
        self.cancelled = threading.Event()
        self.stalled_since: float | None = None  # worker only

    def cancel(self) -> None:
        """Stop decoding this request before its next step. Safe from any thread, idempotent."""
        if not self.cancelled.is_set():
            self.cancelled.set()
            self._runtime.wake()


class Runtime:
    """Runs ``Engine.step`` for every active request on one worker thread."""

    def __init__(
        self,
        engine: Engine | None = None,
        *,
        limits: Limits = Limits(),
        on_finished: Callable[[Sequence], None] = lambda seq: None,
    ) -> None:
        self.engine = engine
        self.on_finished = on_finished
        self.max_pending = limits.max_pending_events
        self.abandon_after_s = limits.abandon_after_s
        self.max_queued = limits.max_queued
        self.max_batch = limits.max_batch
        self.kv_budget_bytes = int(limits.kv_cache_mb * 2**20)
        self._cond = threading.Condition()
        self._incoming: list[RequestHandle] = []
        self._jobs: list[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = []
        self._active: list[RequestHandle] = []
        self._shadows: collections.deque[tuple[Sequence, Callable[[Sequence], None]]] = collections.deque()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="agentspec-engine", daemon=True)

    # -- event loop side ---------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        _LIVE.add(self)

    def check_room(self) -> None:
        """Raise EngineOverloadedError if ``submit`` would now (a request checks before costly work)."""
        with self._cond:
            self._check_room()

    def _check_room(self) -> None:
        if len(self._incoming) + len(self._active) >= self.max_queued:
            raise EngineOverloadedError(f"{self.max_queued} requests are already queued or running; retry when some finish.")

    def submit(self, handle: RequestHandle) -> None:
        with self._cond:
            if self._stopping:
                raise ClientClosedError("The client is closed; create a new agentspec.Client to send requests.")
            if self.engine is None:
                raise ClientClosedError("The client is not started; `await client.start()` first.")
            self._check_room()
            self._incoming.append(handle)
            self._cond.notify()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run ``fn`` on the worker thread between engine steps (for loading, calibration, baselines)."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._cond:
            if self._stopping:
                raise ClientClosedError("The client is closed; create a new agentspec.Client.")
            self._jobs.append((fn, future))
            self._cond.notify()
        return future

    def wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def stop(self, timeout: float | None = None) -> None:
        """Cancel every request (each gets finish_reason 'cancelled') and join the worker."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def running(self) -> int:
        return len(self._active) + len(self._incoming)

    def shadow(self, seq: Sequence, check: Callable[[Sequence], None]) -> None:
        """Worker side (e.g. from ``on_finished``): decode ``seq`` while the engine is otherwise idle,
        then call ``check(seq)``. Dropped, unchecked, when the runtime stops or when
        ``MAX_QUEUED_SHADOWS`` checks already wait."""
        if len(self._shadows) >= MAX_QUEUED_SHADOWS:
            log.debug("shadow check of request %s dropped: %d already wait for idle time", seq.request_id, len(self._shadows))
            return
        self._shadows.append((seq, check))

    # -- worker side -------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a bug in the runtime itself: fail every request, refuse new ones
            log.exception("the agentspec worker thread failed")
            with self._cond:
                self._stopping = True
                pending, self._incoming = self._incoming + self._active, []
                jobs, self._jobs = self._jobs, []
            for handle in pending:
                handle.channel.send(EngineError(f"The engine's worker thread failed ({exc!r}); create a new Client."))
            for _, future in jobs:
                future.cancel()
            raise

    def _loop(self) -> None:
        while True:
            with self._cond:
                jobs, self._jobs = self._jobs, []
                stopping = self._stopping
                idle = not stopping and not self._incoming and not jobs and not self._active
                calibrating = self.engine is not None and self.engine.calibrating
                if idle and not self._shadows and not calibrating:
                    self._cond.wait()
                    continue
            if idle:  # one pass of what calibration left (Engine.calibrate(idle=True)), else of a shadow check
                self.engine.calibrate_idle() if calibrating else self._shadow_step()
                continue
            for fn, future in jobs:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except BaseException as exc:
                        future.set_exception(exc)
            if self.engine is None:  # still being set up (by a job); clients submit only after that
                if stopping:
                    return
                continue
            if stopping:
                with self._cond:
                    queued, self._incoming = self._incoming, []
                for handle in queued + self._active:
                    self._end(handle, "cancelled")
                self._shadows.clear()
                # Free every key/value tensor here, while the interpreter is certainly alive: a tensor
                # freed by a daemon thread during interpreter shutdown aborts the process.
                self.engine.close()
                return
            for handle in self._admit():  # already among the active ones: a failed start releases it
                try:
                    self.engine.start(handle.seq)
                except Exception as exc:
                    log.exception("could not start a request")
                    self._fail(handle, exc)
            if not self._cycle():
                with self._cond:  # every active request is waiting for its consumer (or none fits yet)
                    self._cond.wait(timeout=STALLED_WAIT_S)

    def _admit(self) -> list[RequestHandle]:
        """Queued requests that fit now, in order: at most ``max_batch`` decoding at once, and their
        keys/values (prompt and ``ESTIMATED_OUTPUT_TOKENS`` of output) within ``kv_budget_bytes``. One
        request is always admitted when none is active. Cancelled or timed-out queued requests end here.

        The admitted ones move from the queue to the active requests in one step under the lock (before
        the engine starts them), so that ``submit`` counts every request against ``max_queued`` at
        every moment: taken out of the queue and not yet active, two requests once let a third in."""
        assert self.engine is not None
        with self._cond:
            waiting = list(self._incoming)
        if not waiting:  # the common case, every cycle: no key/value accounting needed
            return []
        admitted: list[RequestHandle] = []
        ended: list[RequestHandle] = []
        kept = False
        used = self.engine.kv_bytes
        per_token = self.engine.layout.bytes_per_token
        for handle in waiting:
            if handle.cancelled.is_set() or self._past_timeout(handle):
                ended.append(handle)  # ended below, once out of the queue: its consumer may submit again at once
                continue
            need = (len(handle.seq.prompt_ids) + min(handle.seq.max_new_tokens, ESTIMATED_OUTPUT_TOKENS)) * per_token
            alone = not self._active and not admitted
            fits = used + need <= self.kv_budget_bytes
            if len(self._active) + len(admitted) < self.max_batch and (fits or alone) and not kept:
                admitted.append(handle)
                used += need
            else:
                kept = True  # in order: none after the first that waits
        if admitted or ended:
            gone = {id(handle) for handle in (*admitted, *ended)}
            with self._cond:
                self._incoming = [handle for handle in self._incoming if id(handle) not in gone]
                self._active.extend(admitted)
        for handle in ended:
            if handle.cancelled.is_set():
                self._end(handle, "cancelled")
            else:
                self._timed_out(handle)
        return admitted

    @staticmethod
    def _past_timeout(handle: RequestHandle) -> bool:
        timeout = handle.seq.params.timeout
        return timeout is not None and time.perf_counter() - handle.seq.submitted_at > timeout

    def _timed_out(self, handle: RequestHandle) -> bool:
        """End a request that ran past its ``timeout`` (queueing included); True if it did."""
        if not self._past_timeout(handle):
            return False
        self._fail(handle, RequestTimeoutError(
            f"The request ran past its timeout of {handle.seq.params.timeout:g} s; the events received so far stand. "
            "Raise `timeout` or lower `max_tokens`."
        ))
        return True

    def _cycle(self) -> bool:
        """One step of every active request that can take one, all in one engine pass; True if any advanced."""
        now = time.monotonic()
        ready: list[RequestHandle] = []
        for handle in list(self._active):
            if handle.cancelled.is_set():
                self._end(handle, "cancelled")
                continue
            if self._timed_out(handle):
                continue
            if handle.channel.pending >= self.max_pending:
                handle.stalled_since = handle.stalled_since or now
                if now - handle.stalled_since > self.abandon_after_s:
                    log.warning("request abandoned: no events read for %.0f s; freeing it", self.abandon_after_s)
                    self._end(handle, "cancelled")
                continue
            handle.stalled_since = None
            ready.append(handle)
        if not ready:
            return False
        assert self.engine is not None
        results = self.engine.step_many([handle.seq for handle in ready])
        for handle, result in zip(ready, results):
            if isinstance(result, Exception):
                log.error("decoding failed for one request", exc_info=result)
                self._fail(handle, result)
                continue
            if result.finish_reason is not None:
                self._release(handle)  # first, so metrics include the request once its Done is seen
            elif not result.token_ids and not result.text:
                continue  # a prefill chunk: nothing to tell the consumer yet
            if not handle.channel.send(result) and result.finish_reason is None:
                self._end(handle, "cancelled")
        return True

    def _end(self, handle: RequestHandle, reason: str) -> None:
        seq = handle.seq
        if seq.finish_reason is None:
            seq.finish_reason = reason
        self._release(handle)
        handle.channel.send(StepOutput("", [], seq.finish_reason))

    def _fail(self, handle: RequestHandle, exc: Exception) -> None:
        handle.seq.finish_reason = "error"  # internal only: the stream raises the error instead
        if isinstance(exc, RequestTimeoutError):
            error: Exception = exc
        else:
            error = EngineError(f"Decoding failed: {type(exc).__name__}: {exc}. Other requests are unaffected; retry this one.")
            error.__cause__ = exc
        self._release(handle)
        handle.channel.send(error)

    def _shadow_step(self) -> None:
        """One step of the oldest shadow sequence (started on its first step)."""
        seq, check = self._shadows[0]
        try:
            if seq not in self.engine:
                self.engine.start(seq)
            self.engine.step(seq)
        except Exception:
            log.exception("a shadow check failed to decode; dropped")
            seq.finish_reason = seq.finish_reason or "error"
        if seq.finish_reason is None:
            return
        self._shadows.popleft()
        self.engine.release(seq)
        if seq.finish_reason != "error":
            try:
                check(seq)
            except Exception:
                log.exception("shadow check callback failed")

    def _release(self, handle: RequestHandle) -> None:
        self.engine.release(handle.seq)
        if handle in self._active:
            self._active.remove(handle)
        try:
            self.on_finished(handle.seq)
        except Exception:  # metrics must never break decoding
            log.exception("on_finished callback failed")
