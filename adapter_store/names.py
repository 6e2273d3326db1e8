"""The character set for tenant and adapter names: safe in URLs, file names, log lines and cache keys."""

from __future__ import annotations

import re

from loraplex.errors import AdapterError

MAX_NAME_LENGTH = 64
# Starts with a letter or digit; then letters, digits, '.', '_' or '-'. No '/', no spaces, no '..'.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def check_name(name: object, what: str = "adapter name") -> str:
    """The name itself, or AdapterError saying which rule it breaks."""
    if not isinstance(name, str):
        raise AdapterError(f"{what} must be a string, got {type(name).__name__}")
    if not name:
        raise AdapterError(f"{what} is empty")
    if len(name) > MAX_NAME_LENGTH:
        raise AdapterError(f"{what} {name[:MAX_NAME_LENGTH]!r}... is longer than {MAX_NAME_LENGTH} characters")
    if not _NAME.match(name) or ".." in name:
        raise AdapterError(
            f"{what} {name!r} is not allowed: use letters, digits, '.', '_' and '-', starting with a letter "
            f"or digit, without '..'"
        )
    return name
