"""Finds stop strings in a request's growing output text and decides what is safe to stream.

Text arrives in deltas (one per detokenizer step); a stop string may span several of them. Text
that could still turn out to be the start of a stop string is held back, and released as soon as
the next delta shows that it cannot be. The output stops at the first point where any stop string
is complete; the text is cut before that stop string, which is itself never emitted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopUpdate:
    """What one delta did: the text now safe to stream, and whether a stop string ended the output."""

    emit: str  # new text to stream; never contains or begins a stop string
    stopped: bool = False
    stop_string: str | None = None  # the stop string that matched, when stopped


class StopChecker:
    """Stateful stop-string check over one request's output text.

    ``text`` is everything emitted so far; after a stop it is the final output (cut before the stop
    string). When the output ends for another reason, :meth:`finish` releases the held-back tail.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")  # SamplingParams refuses them earlier
        self._stop = tuple(dict.fromkeys(stop))
        self._chunks: list[str] = []
        self._held = ""  # a suffix of the output so far that is a proper prefix of some stop string
        self._stop_string: str | None = None

    @property
    def text(self) -> str:
        """The output text released so far (final once stopped or finished)."""
        joined = "".join(self._chunks)
        self._chunks = [joined] if joined else []
        return joined

    @property
    def held(self) -> str:
        """Text received but held back because it may be the start of a stop string."""
        return self._held

    @property
    def stopped(self) -> bool:
        return self._stop_string is not None

    @property
    def stop_string(self) -> str | None:
        return self._stop_string

    def push(self, delta: str) -> StopUpdate:
        """Add a delta of output text; return what can be streamed now and whether the output stopped."""
        if self._stop_string is not None:
            return StopUpdate("", True, self._stop_string)  # the output already ended
        if not self._stop:
            return self._release(delta)
        # A stop string cannot start in released text: any suffix of it that begins a stop string is
        # held. So searching the held tail plus the delta finds every new match.
        buf = self._held + delta
        match = self._first_match(buf)
        if match is not None:
            start, stop_string = match
            self._held = ""
            self._stop_string = stop_string
            if start:
                self._chunks.append(buf[:start])
            return StopUpdate(buf[:start], True, stop_string)
        keep = self._longest_stop_prefix_suffix(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return self._release(buf[: len(buf) - keep])

    def finish(self) -> str:
        """The output ended without a stop string: the held tail can no longer begin one, release it."""
        if self._stop_string is not None:
            return ""
        tail, self._held = self._held, ""
        return self._release(tail).emit

    def _release(self, text: str) -> StopUpdate:
        if text:
            self._chunks.append(text)
        return StopUpdate(text)

    def _first_match(self, buf: str) -> tuple[int, str] | None:
        # The output ends where a stop string is first complete (smallest end), whatever way the text
        # was split into deltas; at equal ends the longer (earlier-starting) stop string wins.
        best: tuple[int, int, str] | None = None
        for s in self._stop:
            i = buf.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        return None if best is None else (best[1], best[2])

    def _longest_stop_prefix_suffix(self, buf: str) -> int:
        # Length of the longest suffix of buf that is a proper prefix of a stop string.
        longest = 0
        for s in self._stop:
            for k in range(min(len(buf), len(s) - 1), longest, -1):
                if buf.endswith(s[:k]):
                    longest = k
                    break
        return longest
