"""How one request wants its tokens chosen and when its output ends (the public request API)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass

from loraplex.errors import RequestError

# Below this temperature a row is sampled greedily: dividing logits by a tiny temperature only
# reproduces argmax while risking overflow, so such rows take the exact (and cheaper) argmax path.
GREEDY_TEMPERATURE_EPS = 1e-5


def _is_int(value: object) -> bool:
    # bool is an int subclass, but `top_k=True` is a mistake, not a request for k=1.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping settings of one request.

    top_k 0 or -1 disables top-k; top_p 1.0 disables nucleus sampling; temperature 0 is greedy.
    ``stop`` is normalised to a tuple of strings and ``stop_token_ids`` to a tuple of ints, so that
    the object is immutable and hashable once built.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | Iterable[str] | None = None
    stop_token_ids: Iterable[int] | None = None
    ignore_eos: bool = False
    return_logits: bool = False  # keep prompt and per-step logits (parity tests, debugging)

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise RequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise RequestError(f"top_k must be an integer >= -1 (0 or -1 disable it), got {self.top_k!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise RequestError(f"seed must be an integer or None, got {self.seed!r}")
        for name in ("ignore_eos", "return_logits"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"{name} must be a bool, got {getattr(self, name)!r}")
        # Frozen dataclass: normalised values are written through object.__setattr__.
        set_ = object.__setattr__
        set_(self, "max_tokens", int(self.max_tokens))
        set_(self, "temperature", float(self.temperature))
        set_(self, "top_p", float(self.top_p))
        set_(self, "top_k", int(self.top_k))
        set_(self, "seed", None if self.seed is None else int(self.seed))
        set_(self, "stop", _normalise_stop(self.stop))
        set_(self, "stop_token_ids", _normalise_stop_token_ids(self.stop_token_ids))

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    @property
    def top_p_enabled(self) -> bool:
        return self.top_p < 1.0


def _normalise_stop(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    try:
        items = list(items)  # type: ignore[arg-type]
    except TypeError:
        raise RequestError(f"stop must be a string or a list of strings, got {stop!r}") from None
    for i, s in enumerate(items):
        if not isinstance(s, str):
            raise RequestError(f"stop[{i}] must be a string, got {s!r}")
        if not s:
            raise RequestError(f"stop[{i}] is an empty string; stop strings must be non-empty")
    # Duplicates change nothing; dropping them (keeping order) keeps per-step stop checks minimal.
    return tuple(dict.fromkeys(items))


def _normalise_stop_token_ids(ids: object) -> tuple[int, ...]:
    if ids is None:
        return ()
    if isinstance(ids, (str, bytes)) or _is_int(ids):
        raise RequestError(f"stop_token_ids must be a list of integers, got {ids!r}")
    try:
        items = list(ids)  # type: ignore[call-overload]
    except TypeError:
        raise RequestError(f"stop_token_ids must be a list of integers, got {ids!r}") from None
    for i, t in enumerate(items):
        if not _is_int(t) or t < 0:
            raise RequestError(f"stop_token_ids[{i}] must be an integer >= 0, got {t!r}")
    return tuple(int(t) for t in items)
