"""AsyncEngine: the engine's step loop in its own thread, streams of outputs for asyncio callers.

The step loop never waits on the caller: add and abort are queued as commands that the loop
applies between steps, and outputs go back to each caller's asyncio queue through
call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from dataclasses import dataclass
from collections.abc import Callable
from typing import AsyncIterator

from loraplex.config import EngineConfig

from .engine_core import EngineCore, EngineStats
from .request import RequestOutput
from .sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    adapter: str | None
    sink: "_Sink"
    # Runs on the engine thread just before the add and returns the adapter name to use: this is how
    # a store adapter, already decoded off the loop, is installed in the engine without a lock.
    prepare: Callable[[], str | None] | None = None
    tenant: str | None = None
    share: float = 1.0
    ttft_deadline: float | None = None


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Call:
    """A function to run on the engine thread between steps (e.g. drop a deleted adapter)."""

    fn: Callable[[], object]


class _Sink:
    """Delivers outputs from the engine thread to one asyncio queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is left to read this
            pass


class EngineDeadError(RuntimeError):
    """The step loop crashed or was shut down; no further request can be served."""


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, engine: EngineCore | None = None):
        """From a config, the EngineCore is built on the step loop's own thread, which then runs every step:
        on the CPU an engine stepped on another thread than the one that built it ran 1.4-1.7x slower per
        decode step (two OpenMP teams; kernels/cpu_threads.py). An engine passed in, already built, runs
        on the loop's thread as it is. Raises what building the engine raised."""
        self.engine: EngineCore = engine  # type: ignore[assignment]  (set by the loop's thread when None)
        self._config = config or EngineConfig()
        self.built_on: int | None = None  # the thread ident that built the engine, when this did
        self._commands: queue.Queue = queue.Queue()
        self._sinks: dict[str, _Sink] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._built = threading.Event()
        # Set (under the lock) once the step loop has ended: commands sent later are answered at once
        # instead of waiting forever in a queue that nobody reads.
        self._lock = threading.Lock()
        self._closed = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="loraplex-engine", daemon=True)
        self._thread.start()
        self._built.wait()
        if self.engine is None:
            self._thread.join()
            raise self.error  # type: ignore[misc]  (the build's error)
        # A snapshot taken by the engine thread after every step: readers on other threads (metrics,
        # readiness, admission) must not walk the scheduler's lists while the step changes them.
        self.stats: EngineStats = self.engine.stats()

    # -- caller side (event loop) --------------------------------------------------------------
    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        adapter: str | None = None,
        request_id: str | None = None,
        prepare: Callable[[], str | None] | None = None,
        tenant: str | None = None,
        share: float = 1.0,
        ttft_deadline: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs step by step; the last one has finished=True. If the
        caller stops iterating (a client hung up), the request is aborted. `prepare`, if given, runs
        on the engine thread before the add and names the adapter (replacing `adapter`)."""
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error!r}")
        rid = request_id or f"async-{uuid.uuid4().hex}"
        sink = _Sink(asyncio.get_running_loop())
        self._send(_Add(rid, prompt, params, adapter, sink, prepare, tenant, share, ttft_deadline))
        finished = False
        try:
            while True:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    # Refused at add, or the engine is gone: nothing of ours is in the engine, and an
                    # abort by this id would hit another request that holds it (a duplicate id).
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        self._send(_Abort(request_id))

    def call_soon(self, fn: Callable[[], object]) -> None:
        """Run fn on the engine thread before the next step (errors are logged, never raised there)."""
        self._send(_Call(fn))

    def _send(self, cmd) -> None:
        with self._lock:
            if not self._closed:
                self._commands.put(cmd)
                self._wake.set()
                return
        if isinstance(cmd, _Add):
            cmd.sink.put(EngineDeadError(self._dead_message()))

    def _dead_message(self) -> str:
        return f"the engine stopped: {self.error!r}" if self.error is not None else "the engine was shut down"

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # -- engine side (thread) ------------------------------------------------------------------
    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                try:
                    adapter = cmd.prepare() if cmd.prepare is not None else cmd.adapter
                    self.engine.add_request(cmd.prompt, cmd.params, adapter, cmd.request_id, cmd.tenant, cmd.share,
                                            cmd.ttft_deadline)
                    self._sinks[cmd.request_id] = cmd.sink
                except Exception as e:  # refused: the caller gets the error, the engine is unchanged
                    cmd.sink.put(e)
            elif isinstance(cmd, _Call):
                try:
                    cmd.fn()
                except Exception:
                    log.exception("engine-thread call %r failed", cmd.fn)
            else:
                out = self.engine.abort_request(cmd.request_id)
                sink = self._sinks.pop(cmd.request_id, None)
                if sink is not None and out is not None:
                    sink.put(out)

    def _loop(self) -> None:
        try:
            if self.engine is None:
                self.engine = EngineCore(self._config)
                self.built_on = threading.get_ident()
                # Before any request: the memory of the largest step is touched now, not in the first
                # requests served (EngineCore.warmup).
                log.info("engine warm-up took %.2f s", self.engine.warmup())
        except BaseException as e:
            self.error = e
            return
        finally:
            self._built.set()  # the constructor waits for this, built or not
        try:
            while not self._stop.is_set():
                # Clear before reading commands: a command sent after this point wakes the wait.
                self._wake.clear()
                self._apply_commands()
                if not self.engine.has_unfinished():
                    self.stats = self.engine.stats()
                    self._wake.wait(0.5)
                    continue
                outs = self.engine.step()
                self.stats = self.engine.stats()
                for out in outs:
                    sink = self._sinks.get(out.request_id)
                    if sink is not None:
                        sink.put(out)
                        if out.finished:
                            del self._sinks[out.request_id]
        except BaseException as e:  # a dead engine must be visible, never a silent hang
            log.exception("engine step loop crashed")
            self.error = e
        finally:
            self._close()

    def _close(self) -> None:
        """The loop has ended (shutdown or crash): every open stream, and every request sent too late to
        be added, gets EngineDeadError; after a shutdown, requests still in the engine are aborted."""
        with self._lock:
            self._closed = True
        message = self._dead_message()
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                cmd.sink.put(EngineDeadError(message))
        for rid, sink in self._sinks.items():
            if self.error is None:
                self.engine.abort_request(rid)
            sink.put(EngineDeadError(message))
        self._sinks.clear()
