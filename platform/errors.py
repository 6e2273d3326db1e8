"""Errors that loraplex raises to its callers.

Every refusal of user input is a ``LoraplexError`` subclass with a message that names what was wrong,
so that the HTTP layer can map it to a status code and a user can fix the input.
"""


class LoraplexError(Exception):
    """Base class of every error loraplex raises on purpose."""


class ConfigError(LoraplexError, ValueError):
    """An engine or model configuration that loraplex cannot run."""


class ModelLoadError(LoraplexError):
    """A base-model checkpoint that is missing, malformed or unsupported."""


class AdapterError(LoraplexError, ValueError):
    """An adapter that is refused: unsupported PEFT feature, wrong shapes, rank, file format."""


class AdapterNotFoundError(LoraplexError, KeyError):
    """A request names an adapter that is not loaded."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "adapter not found"


class RequestError(LoraplexError, ValueError):
    """A request that can never be served as given (prompt too long, bad sampling parameters)."""


class CapacityError(LoraplexError):
    """The page pool is too small to ever hold what a request or adapter needs."""
