"""StopChecker: stop strings across deltas, hold-back of possible stop prefixes, release at the end."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.engine.stop_checker import StopChecker, StopUpdate


def _reference(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Output cut where a stop string is first complete (ties: the earlier-starting one)."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
            best = (i + len(s), i, s)
    return (text, None) if best is None else (text[: best[1]], best[2])


def _split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in zip(points, points[1:])] or [""]


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet="abcé🦊 ", max_size=40),
    stops=st.lists(st.text(alphabet="abcé🦊 ", min_size=1, max_size=5), min_size=0, max_size=4),
    cuts=st.lists(st.integers(0, 100), max_size=12),
)
def test_streamed_output_equals_reference_for_any_split(text, stops, cuts):
    expected, expected_stop = _reference(text, stops)
    checker = StopChecker(stops)
    streamed, consumed = "", ""
    for delta in _split(text, cuts):
        update = checker.push(delta)
        consumed += delta
        streamed += update.emit
        assert expected.startswith(streamed), "emitted text that a stop string later removed"
        if update.stopped:
            break
        # Held back: exactly the longest suffix that could still begin a stop string, nothing more.
        held = checker.held
        assert streamed + held == consumed
        assert held == "" or any(s.startswith(held) and len(held) < len(s) for s in stops)
        for k in range(len(held) + 1, len(consumed) + 1):
            assert not any(s.startswith(consumed[-k:]) and k < len(s) for s in stops)
    if not checker.stopped:
        streamed += checker.finish()
    assert streamed == checker.text == expected
    assert checker.stop_string == expected_stop


def test_tail_that_may_begin_a_stop_string_is_held_then_released():
    checker = StopChecker(["abc", "xyz"])
    assert checker.push("hello ab") == StopUpdate("hello ")
    assert checker.held == "ab"
    assert checker.push("d") == StopUpdate("abd")  # "abd" can no longer become "abc"
    assert checker.held == "" and checker.text == "hello abd"


def test_stop_string_spanning_three_deltas_is_cut_out():
    checker = StopChecker(["<|end|>"])
    emitted = [checker.push(d).emit for d in ["The answer is 42.<", "|en", "d|> junk"]]
    assert emitted == ["The answer is 42.", "", ""]
    assert checker.stopped and checker.stop_string == "<|end|>"
    assert checker.text == "The answer is 42."
    assert checker.push("more") == StopUpdate("", True, "<|end|>")  # the output has ended
    assert checker.finish() == ""


def test_finish_releases_the_held_tail():
    checker = StopChecker(["STOP"])
    assert checker.push("all good ST").emit == "all good "
    assert checker.finish() == "ST"
    assert checker.text == "all good ST" and not checker.stopped


def test_earliest_completed_stop_wins_whatever_the_deltas():
    # "y" completes before "xyz" does, so the output is "x" both in one delta and in two.
    for deltas in (["xyz"], ["xy", "z"], ["x", "y", "z"]):
        checker = StopChecker(["xyz", "y"])
        out = "".join(checker.push(d).emit for d in deltas if not checker.stopped)
        assert (out, checker.stop_string) == ("x", "y")


def test_without_stop_strings_everything_streams_at_once():
    checker = StopChecker([])
    assert checker.push("abc") == StopUpdate("abc")
    assert checker.push("") == StopUpdate("")
    assert checker.finish() == "" and checker.text == "abc"


def test_non_ascii_stop_strings():
    checker = StopChecker(["日本", "🦊!"])
    assert checker.push("今日は日").emit == "今日は"
    assert checker.push("曜日 🦊").emit == "日曜日 "
    update = checker.push("! after")
    assert update.stopped and update.stop_string == "🦊!" and update.emit == ""
    assert checker.text == "今日は日曜日 "


def test_update_is_frozen_and_empty_stop_refused():
    with pytest.raises(dataclasses.FrozenInstanceError):
        StopUpdate("x").emit = "y"  # type: ignore[misc]
    with pytest.raises(ValueError, match="stop"):
        StopChecker(["ok", ""])
