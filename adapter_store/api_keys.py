"""API key secrets: made from the OS's random source, stored only as their sha256.

A key carries 256 random bits, so a plain (unsalted, fast) hash is safe: nobody can guess a key
from its hash by trying candidates, and a fast hash keeps authentication to one indexed lookup.
"""

from __future__ import annotations

import hashlib
import secrets

KEY_PREFIX = "lpx_"
DISPLAY_PREFIX_LEN = 12  # "lpx_" + 8 characters: enough to tell keys apart in a listing


def new_secret() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def display_prefix(secret: str) -> str:
    return secret[:DISPLAY_PREFIX_LEN]
