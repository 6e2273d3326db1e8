"""SamplingParams: defaults, normalisation, and refusals that name the bad field."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loraplex.engine.sampling_params import SamplingParams
from loraplex.errors import RequestError


def test_defaults_and_positional_order():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (16, 1.0, 1.0, 0, None)
    assert p.stop == () and p.stop_token_ids == ()
    assert not p.ignore_eos and not p.return_logits
    q = SamplingParams(7, 0.5, 0.9, 40, 3, "x", [5], True, True)
    assert (q.max_tokens, q.temperature, q.top_p, q.top_k, q.seed) == (7, 0.5, 0.9, 40, 3)
    assert q.stop == ("x",) and q.stop_token_ids == (5,) and q.ignore_eos and q.return_logits


def test_normalisation_makes_it_immutable_and_hashable():
    p = SamplingParams(stop=["a", "bc", "a"], stop_token_ids=(3, 4), temperature=1, top_p=1)
    assert p.stop == ("a", "bc")
    assert p.stop_token_ids == (3, 4)
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert hash(p) == hash(SamplingParams(stop=("a", "bc"), stop_token_ids=[3, 4]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.max_tokens = 3  # type: ignore[misc]


def test_greedy_and_filter_flags():
    assert SamplingParams(temperature=0).is_greedy
    assert not SamplingParams(temperature=0.3).is_greedy
    assert not SamplingParams(top_k=0).top_k_enabled and not SamplingParams(top_k=-1).top_k_enabled
    assert SamplingParams(top_k=5).top_k_enabled
    assert SamplingParams(top_p=0.5).top_p_enabled and not SamplingParams(top_p=1.0).top_p_enabled


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 2.5), ("max_tokens", True), ("max_tokens", "8"),
        ("temperature", -0.1), ("temperature", math.inf), ("temperature", math.nan), ("temperature", "1"),
        ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.2), ("top_p", math.nan), ("top_p", None),
        ("top_k", -2), ("top_k", 1.5), ("top_k", False),
        ("seed", 1.0), ("seed", "7"), ("seed", True),
        ("stop", ""), ("stop", ["ok", ""]), ("stop", [3]), ("stop", 5),
        ("stop_token_ids", [1, -1]), ("stop_token_ids", ["a"]), ("stop_token_ids", 3), ("stop_token_ids", "12"),
        ("ignore_eos", 1), ("return_logits", "yes"),
    ],
)
def test_bad_values_are_refused_naming_the_field(field, value):
    with pytest.raises(RequestError, match=field):
        SamplingParams(**{field: value})


@given(
    max_tokens=st.integers(1, 10**6),
    temperature=st.floats(0, 100, allow_nan=False),
    top_p=st.floats(0, 1, exclude_min=True),
    top_k=st.integers(-1, 10**6),
    seed=st.none() | st.integers(-(2**70), 2**70),
    stop=st.none() | st.text(min_size=1) | st.lists(st.text(min_size=1), max_size=4),
)
def test_any_valid_combination_is_accepted(max_tokens, temperature, top_p, top_k, seed, stop):
    p = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop)
    assert isinstance(p.stop, tuple) and all(isinstance(s, str) and s for s in p.stop)
    expected = () if stop is None else (stop,) if isinstance(stop, str) else tuple(dict.fromkeys(stop))
    assert p.stop == expected
