"""The one error type of ``st-ext train``'s input checks, kept apart so every module can raise it."""

from __future__ import annotations


class ConfigError(ValueError):
    """A setting that cannot work; the message says which and what to do, in one line."""
