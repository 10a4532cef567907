"""The engine thread of ``specjax serve``: one background thread owns the synchronous
:class:`~specjax.runtime.engine.Engine` and hands its updates to the asyncio side.

The thread loops ``updates = engine.step()`` while the engine has work, and sleeps on a
:class:`threading.Event` while it is idle (:meth:`EngineWorker.submit` sets the event). Each
:class:`~specjax.runtime.engine.Update` goes to its request's :class:`asyncio.Queue` through
``loop.call_soon_threadsafe`` (the event loop is the only one that touches the queues). A fault
in ``engine.step()`` does not kill the thread: every request in flight gets the exception (its
HTTP request answers 500 with the message) and the thread goes on with new requests.

Stopping (:meth:`EngineWorker.stop`, at the app's lifespan shutdown, after the HTTP requests have
ended): no new request is accepted, any request still in flight is cancelled (``engine.cancel``),
the thread steps until the engine is idle or ``timeout`` seconds have passed, and exits.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import traceback

IDLE_WAIT_S = 0.5  # the idle thread re-checks its stop flag this often (seconds)


class WorkerStopped(RuntimeError):
    """A submit after :meth:`EngineWorker.stop` (the server is shutting down)."""


class EngineFault(RuntimeError):
    """``engine.step()`` raised: delivered to every request in flight (message: the fault's)."""


class EngineWorker:
    """The one thread that runs ``engine.step()``.

    Args:
      engine: a :class:`~specjax.runtime.engine.Engine` (``submit``/``cancel`` thread-safe;
        ``step`` called from this thread only).
      loop: the asyncio loop the HTTP handlers run on (their queues belong to it).
      on_step: ``on_step(updates, seconds)`` called in the thread after each step (metrics), or ``None``.
    """

    def __init__(self, engine, loop: asyncio.AbstractEventLoop, on_step=None):
        self.engine = engine
        self.loop = loop
        self.on_step = on_step
        self._routes: dict[int, asyncio.Queue] = {}
        self._lock = threading.Lock()  # submit + route registration vs. the thread's delivery
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="specjax-engine", daemon=True)
        self.steps = 0
        self.faults = 0

    # ---- the asyncio side
    def start(self) -> None:
        self._thread.start()

    @property
    def in_flight(self) -> int:
        """Requests submitted whose final update has not been delivered yet."""
        return len(self._routes)

    def submit(self, request, queue: asyncio.Queue) -> int:
        """``engine.submit(request)``; the request's updates will be put on ``queue``. Returns its id.

        Raises:
          ValueError: the engine refused the request (its one-line message).
          WorkerStopped: the server is shutting down."""
        with self._lock:
            if self._stopping:
                raise WorkerStopped("the server is shutting down; retry on another server")
            rid = self.engine.submit(request)
            self._routes[rid] = queue
        self._wake.set()
        return rid

    def cancel(self, rid: int) -> None:
        """End a request at the engine's next step (``finish_reason`` ``"cancelled"``); harmless when it
        has ended already."""
        with self._lock:
            live = rid in self._routes
        if live:
            self.engine.cancel(rid)
            self._wake.set()

    def cancel_all(self) -> int:
        """Cancel every request in flight (their final updates, ``"cancelled"``, still arrive).
        Returns how many."""
        with self._lock:
            rids = list(self._routes)
        for rid in rids:
            self.engine.cancel(rid)
        self._wake.set()
        return len(rids)

    def stop(self, timeout: float = 10.0) -> bool:
        """Refuse new requests, cancel the ones in flight, let the thread step until the engine is
        idle (at most ``timeout`` seconds), and join it. Returns whether the thread ended in time."""
        with self._lock:
            self._stopping = True
            rids = list(self._routes)
        for rid in rids:
            try:
                self.engine.cancel(rid)
            except Exception:  # noqa: BLE001  (a request that ended meanwhile)
                pass
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    # ---- the thread
    def _deliver(self, rid: int, item, final: bool) -> None:
        with self._lock:
            q = self._routes.pop(rid, None) if final else self._routes.get(rid)
        if q is not None:
            try:
                self.loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:  # the event loop has closed (shutdown): nobody waits for it
                pass

    def _run(self) -> None:
        while True:
            if self.engine.idle:
                if self._stopping:
                    return
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()
                continue
            t0 = time.perf_counter()
            try:
                updates = self.engine.step()
            except Exception as e:  # noqa: BLE001  (a fault must not kill the server)
                self._fault(e)
                continue
            self.steps += 1
            if self.on_step is not None:
                try:
                    self.on_step(updates, time.perf_counter() - t0)
                except Exception:  # noqa: BLE001  (metrics never stop decoding)
                    traceback.print_exc(file=sys.stderr)
            for u in updates:
                self._deliver(u.request_id, u, u.finish_reason is not None)

    def _fault(self, e: Exception) -> None:
        """``engine.step()`` raised: report it on stderr, fail every request in flight with an
        :class:`EngineFault`, and cancel them in the engine."""
        self.faults += 1
        print(f"specjax serve: error: the engine step failed ({type(e).__name__}: {e}); the requests in flight "
              "are answered with an error", file=sys.stderr, flush=True)
        with self._lock:
            routes, self._routes = self._routes, {}
        for rid, q in routes.items():
            try:
                self.engine.cancel(rid)
            except Exception:  # noqa: BLE001
                pass
            try:
                self.loop.call_soon_threadsafe(q.put_nowait, EngineFault(f"the engine failed: {type(e).__name__}: {e}"))
            except RuntimeError:  # the event loop has closed
                pass
        time.sleep(0.05)  # a fault that repeats at once does not spin a core
