"""Errors that name the problem. The server maps each class to one gRPC status code."""

from __future__ import annotations


class LucekvError(Exception):
    """Base class of every error lucekv raises on purpose."""


class ModelError(LucekvError):
    """A model file or name that cannot be loaded (missing, not GGUF, truncated, corrupt)."""


class UnsupportedModelError(ModelError):
    """A valid GGUF that uses an architecture or quant type lucekv does not implement."""


class InvalidRequestError(LucekvError, ValueError):
    """A request parameter out of range or malformed; `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class ContextOverflowError(InvalidRequestError):
    """Prompt plus max_tokens exceed the model's context."""


class ConfigError(LucekvError):
    """A server or engine setting that cannot work (unknown backend, pool too small, ...)."""


class NotFoundError(LucekvError):
    """A named thing (a session) that does not exist."""


class PreconditionError(LucekvError):
    """A valid request that the current state does not allow (restoring over a session that is generating)."""


class ResourceLimitError(LucekvError):
    """A configured limit is reached (sessions, host memory, queue places); retry later or free something."""
