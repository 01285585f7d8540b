"""The errors of fetching a model or adapter source (shared by sources.py and the source policy)."""

from __future__ import annotations


class SourceError(ValueError):
    """A source that cannot be used; the message says which and why."""


class SourceNotFound(SourceError):
    """The source answered, but the file is not there."""


class SourceUnreachable(SourceError):
    """The source did not answer (network error, timeout, 5xx): worth retrying later."""


class ChecksumMismatch(SourceError):
    """The weights' sha256 differs from the one asked for."""


class SourceRefused(SourceError):
    """The source policy forbids this destination or local path (not worth retrying)."""
