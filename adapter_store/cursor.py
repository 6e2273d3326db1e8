"""Opaque keyset-pagination cursors: the sort key of the last row of a page, base64url JSON."""

from __future__ import annotations

import base64
import json

from loraplex.errors import RequestError


def encode_cursor(*key: object) -> str:
    return base64.urlsafe_b64encode(json.dumps(list(key), separators=(",", ":")).encode()).decode().rstrip("=")


def decode_cursor(cursor: str, arity: int) -> list:
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        key = json.loads(base64.urlsafe_b64decode(padded.encode()))
    except (ValueError, UnicodeError) as e:
        raise RequestError(f"pagination cursor {cursor!r} is not valid") from e
    if not isinstance(key, list) or len(key) != arity:
        raise RequestError(f"pagination cursor {cursor!r} is not valid")
    return key
