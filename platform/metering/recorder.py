"""UsageRecorder: request handlers queue UsageRecords; one background thread writes them in batches.

Lifecycle of an event: record() appends it to an in-memory FIFO (never blocks on the database, never
raises because of it) → the writer thread takes up to max_batch events from the head every
flush_interval_s (at once when a full batch is waiting, or on flush()/close()) → writer.write_batch
commits them with their rollups in one transaction → only then are they removed from the FIFO.

Failures:
- database unreachable, locked, not migrated yet (transient): the batch stays at the head; the thread
  logs and retries with exponential backoff (up to max_backoff_s). Nothing is lost, unless more than
  max_pending events pile up: record() then drops new events and counts them (stats().dropped).
- a row the database refuses (IntegrityError/DataError, e.g. a tenant deleted meanwhile), or any
  non-database error: the batch is retried one event at a time, and the events that still fail are
  logged and counted as rejected, so that one bad event never blocks the others.

close(timeout) writes everything recorded before it (retrying through outages until the timeout), then
stops the thread. Events recorded after close() are dropped (counted).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from sqlalchemy.exc import DataError, DBAPIError, IntegrityError

from .records import UsageRecord
from .source import RegistryOrEngine, engine_of
from .writer import write_batch

log = logging.getLogger("loraplex.metering")

_FIRST_BACKOFF_S = 0.05


@dataclass(frozen=True)
class RecorderStats:
    pending: int  # recorded, not written yet
    written: int  # committed to the database
    failed_flushes: int  # batch writes that failed and will be (or were) retried
    dropped: int  # never queued: the queue held max_pending events, or the recorder was closed
    rejected: int  # refused by the database row by row (see the module docstring); logged


def _is_transient(error: Exception) -> bool:
    """Worth retrying the same batch: the database, not the rows, is the problem."""
    return isinstance(error, DBAPIError) and not isinstance(error, (IntegrityError, DataError))


class UsageRecorder:
    def __init__(self, registry_or_engine: RegistryOrEngine, flush_interval_s: float = 0.5,
                 max_batch: int = 1000, max_pending: int = 1_000_000, max_backoff_s: float = 5.0):
        if flush_interval_s <= 0 or max_batch < 1 or max_pending < 1 or max_backoff_s <= 0:
            raise ValueError("flush_interval_s and max_backoff_s must be > 0, max_batch and max_pending >= 1")
        self._engine = engine_of(registry_or_engine)
        self._flush_interval_s = flush_interval_s
        self._max_batch = max_batch
        self._max_pending = max_pending
        self._max_backoff_s = max_backoff_s
        self._cond = threading.Condition()
        self._pending: deque[UsageRecord] = deque()
        self._appended = 0  # events ever queued
        self._removed = 0  # events ever taken off the head (written or rejected)
        self._written = 0
        self._rejected = 0
        self._dropped = 0
        self._failed_flushes = 0
        self._flush_through = 0  # flush() waits for _removed to reach this: write without waiting meanwhile
        self._flush_requests = 0  # bumped by flush()/close(): one immediate attempt, even while backing off
        self._closing = False
        self._close_deadline = 0.0
        self._thread = threading.Thread(target=self._run, name="loraplex-metering", daemon=True)
        self._thread.start()

    # -- the request path -------------------------------------------------------------------------
    def record(self, rec: UsageRecord) -> None:
        """Queue one event (O(1), no I/O). Stamps created_at with the current time if it is None."""
        if rec.created_at is None:
            rec = _stamped(rec)
        with self._cond:
            if self._closing or len(self._pending) >= self._max_pending:
                self._dropped += 1
                if self._dropped == 1 or self._dropped % 10_000 == 0:
                    why = "the recorder is closed" if self._closing else f"{self._max_pending} events are pending"
                    log.error("usage event dropped (%d so far): %s", self._dropped, why)
                return
            self._pending.append(rec)
            self._appended += 1
            if len(self._pending) == 1 or len(self._pending) >= self._max_batch:
                self._cond.notify_all()

    # -- control ------------------------------------------------------------------------------------
    def flush(self, timeout: float | None = 10.0) -> bool:
        """Write every event recorded before this call; True when done within timeout (None: no limit)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            target = self._appended
            self._flush_through = max(self._flush_through, target)
            self._flush_requests += 1
            self._cond.notify_all()
            while self._removed < target and self._thread.is_alive():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return self._removed >= target

    def close(self, timeout: float = 10.0) -> bool:
        """Flush (retrying through outages for up to timeout seconds) and stop the thread.

        True when every recorded event was written (or rejected) and the thread has stopped."""
        with self._cond:
            if not self._closing:
                self._closing = True
                self._close_deadline = time.monotonic() + timeout
            self._flush_requests += 1
            self._cond.notify_all()
        self._thread.join(timeout)
        with self._cond:
            done = not self._pending and not self._thread.is_alive()
            if self._pending and not self._thread.is_alive():
                log.error("metering closed with %d usage events unwritten (database unavailable)",
                          len(self._pending))
            return done

    def stats(self) -> RecorderStats:
        with self._cond:
            return RecorderStats(pending=len(self._pending), written=self._written,
                                 failed_flushes=self._failed_flushes, dropped=self._dropped,
                                 rejected=self._rejected)

    def __enter__(self) -> UsageRecorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the writer thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        backoff = 0.0  # > 0 while the database is failing
        seen_requests = 0
        last_write = time.monotonic()
        while True:
            with self._cond:
                while True:
                    now = time.monotonic()
                    if self._closing and (not self._pending or now >= self._close_deadline):
                        self._cond.notify_all()  # flush() waiters see the thread gone
                        return
                    wait_until = last_write + (backoff or self._flush_interval_s)
                    urgent = (len(self._pending) >= self._max_batch or self._removed < self._flush_through
                              or self._closing)
                    if self._pending and (now >= wait_until or (urgent and not backoff)
                                          or self._flush_requests != seen_requests):  # a new call retries now
                        break
                    if not self._pending:
                        self._cond.wait()  # record() wakes us when the queue stops being empty
                        continue
                    if self._closing:
                        wait_until = min(wait_until, self._close_deadline)
                    self._cond.wait(max(0.0, wait_until - now))
                seen_requests = self._flush_requests
                batch = list(itertools.islice(self._pending, self._max_batch))
            written, rejected, error = self._write(batch)
            last_write = time.monotonic()
            with self._cond:
                for _ in range(written + rejected):
                    self._pending.popleft()
                self._removed += written + rejected
                self._written += written
                self._rejected += rejected
                if error is not None:
                    self._failed_flushes += 1
                self._cond.notify_all()
            if error is None:
                if backoff:
                    log.warning("metering: database writable again; %d usage events written", written)
                backoff = 0.0
            else:
                backoff = min(self._max_backoff_s, max(_FIRST_BACKOFF_S, 2 * backoff))
                log.warning("metering: cannot write %d usage events (kept, retrying in %.2fs): %s",
                            len(batch) - written - rejected, backoff, _one_line(error))

    def _write(self, batch: list[UsageRecord]) -> tuple[int, int, Exception | None]:
        """(written, rejected, transient error or None) for events taken from the head of batch, in order."""
        try:
            return write_batch(self._engine, batch), 0, None
        except Exception as e:  # noqa: BLE001 - classified below; the thread must survive anything
            if _is_transient(e):
                return 0, 0, e
            first = e
        # Some row is refused: write one by one so that the others still get in.
        written = rejected = 0
        for rec in batch:
            try:
                write_batch(self._engine, [rec])
                written += 1
            except Exception as e:  # noqa: BLE001
                if _is_transient(e):
                    return written, rejected, e
                rejected += 1
                log.error("metering: usage event %s of tenant %s rejected: %s", rec.request_id, rec.tenant_id,
                          _one_line(e))
        if not rejected:  # the batch failed but no single event did: count it as a failed attempt
            log.warning("metering: batch write failed, events written one by one: %s", _one_line(first))
        return written, rejected, None


def _stamped(rec: UsageRecord) -> UsageRecord:
    return replace(rec, created_at=datetime.now(UTC))


def _one_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
