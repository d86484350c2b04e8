"""Errors that cross the seam between the engine and its callers, as types.

The server maps each type once to a /ws error code and to an OpenAI error object
(app.server.errors); nothing parses a message string to tell them apart. Messages are
written for the person who sent the request.
"""

from __future__ import annotations


class BadParameter(ValueError):
    """A request parameter is invalid. `name` is the parameter as the client spelled it
    (e.g. "temperature", "max_tokens"), or None when the request as a whole is wrong."""

    def __init__(self, message: str, name: str | None = None) -> None:
        super().__init__(message)
        self.name = name

    def __reduce__(self):  # pickled across processes (engine replicas) with its fields
        return type(self), (str(self), self.name)


class ContextTooLong(BadParameter):
    """The prompt does not fit the context window (or the whole KV cache) with room for
    at least one generated token."""

    def __init__(self, message: str, num_tokens: int, limit: int) -> None:
        super().__init__(message, None)
        self.num_tokens = num_tokens
        self.limit = limit

    def __reduce__(self):
        return type(self), (str(self), self.num_tokens, self.limit)


class Overloaded(RuntimeError):
    """More requests are in flight than the engine will queue: retry later."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self):
        return type(self), (str(self), self.retry_after_s)


class EngineDead(RuntimeError):
    """The engine loop is not running; no request can be served until it is."""
