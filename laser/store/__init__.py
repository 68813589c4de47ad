"""Durable state of the Batch API: jobs, per-request state and results in SQLite (stdlib
``sqlite3``), file contents in a data directory. See :class:`BatchStore`."""

from .db import BatchStore, DataDirInUseError, UnknownCursorError

__all__ = ["BatchStore", "DataDirInUseError", "UnknownCursorError"]
