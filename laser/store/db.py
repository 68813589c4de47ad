"""SQLite store of Batch API files, jobs and per-request results (stdlib ``sqlite3``).

Layout of ``data_dir``: ``laser.sqlite3`` (WAL journal) and ``files/<file id>`` (the bytes of
uploaded and generated files, written to a temporary name, fsynced, then renamed).

Durability rule: a request's result is one row update committed the moment it finishes, and
output/error files are written only when a job is finalized, from the rows in line order. So a
server killed at any point (SIGKILL included) loses at most the requests in flight, which are
still ``pending`` and run again after a restart; no line can appear twice in an output file.
One connection, guarded by a lock (calls come from the event loop; each is a few rows).

One process per data directory: the store holds an exclusive ``flock`` on ``data_dir/laser.lock``
for its lifetime (released by the kernel when the process dies, SIGKILL included), so a second
server started on the same directory is refused (:class:`DataDirInUseError`) instead of running
the same batch lines again.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import sqlite3
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, status TEXT NOT NULL, created_at INTEGER NOT NULL, obj TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS requests (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT, body TEXT,
    state TEXT NOT NULL,          -- pending | completed | failed
    record TEXT,                  -- the output/error file line (JSON) once not pending
    prompt_tokens INTEGER, max_tokens INTEGER,
    PRIMARY KEY (batch_id, line)
);
CREATE INDEX IF NOT EXISTS requests_state ON requests (batch_id, state);
"""

STATES = ("pending", "completed", "failed")
LOCK_FILE = "laser.lock"


class DataDirInUseError(RuntimeError):
    """Another live process holds the data directory (its store's lock file)."""


def _lock_dir(path: Path) -> int:
    """Take the exclusive lock of ``path`` (created if missing) and write our pid into it; return
    the open descriptor (closing it releases the lock). Raises DataDirInUseError when another open
    file description holds it -- another process, or another store of this one."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        try:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        finally:
            os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise DataDirInUseError(
                f"data directory {str(path.parent)!r} is in use by another laser server (pid {holder}); "
                "one server per --data-dir: stop it, or give this one another --data-dir") from None
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


class BatchStore:
    """Files, batch jobs and their requests under ``data_dir`` (created if missing).

    Batch objects are stored whole as JSON (the OpenAI ``batch`` object without
    ``request_counts``, which :meth:`counts` derives from the request rows).

    The directory is this store's alone while it is open (an exclusive lock on ``laser.lock``,
    released by :meth:`close` or the process's end).

    Raises:
        DataDirInUseError: another process (or another open store) holds ``data_dir``.
        sqlite3.DatabaseError: the database file is corrupt or not a database.
    """

    def __init__(self, data_dir: str | os.PathLike):
        self.dir = Path(data_dir)
        self.files_dir = self.dir / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd: int | None = _lock_dir(self.dir / LOCK_FILE)
        try:
            self.path = self.dir / "laser.sqlite3"
            self._lock = threading.Lock()
            self.db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self.db.row_factory = sqlite3.Row
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")  # durable against a killed process
            self.db.executescript(SCHEMA)
        except BaseException:
            self._unlock()
            raise

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def close(self) -> None:
        """Close the database and release the data directory."""
        with self._lock:
            self.db.close()
        self._unlock()

    def _tx(self, sql_params: list[tuple[str, tuple]]) -> None:
        with self._lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                for sql, params in sql_params:
                    self.db.execute(sql, params)
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")

    def _query(self, sql: str, params: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self.db.execute(sql, params).fetchall()

    # -- files ----------------------------------------------------------------------------------------
    def add_file(self, purpose: str, filename: str, data: bytes) -> dict:
        """Store ``data`` durably; return the OpenAI ``file`` object."""
        fid = f"file-{uuid.uuid4().hex}"
        tmp = self.files_dir / f".{fid}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.files_dir / fid)
        created = int(time.time())
        self._tx([("INSERT INTO files VALUES (?, ?, ?, ?, ?)", (fid, purpose, filename, len(data), created))])
        return self.file_object(fid)

    def file_object(self, fid: str) -> dict | None:
        rows = self._query("SELECT * FROM files WHERE id = ?", (fid,))
        if not rows:
            return None
        return _file_object(rows[0])

    def list_files(self, purpose: str | None = None, after: str | None = None, limit: int = 10000,
                   order: str = "desc") -> tuple[list[dict], bool]:
        """Files (of ``purpose`` when given) in upload order (``order`` ``"asc"``) or newest first
        (``"desc"``), from the one after the file ``after``: (objects, has_more), as OpenAI's
        ``GET /v1/files``. Raises :class:`UnknownCursorError` when ``after`` is not such a file."""
        where, params = ("WHERE purpose = ?", (purpose,)) if purpose is not None else ("", ())
        rows = self._query(f"SELECT * FROM files {where} ORDER BY rowid {'ASC' if order == 'asc' else 'DESC'}", params)
        page, more = _page(rows, after, limit, "file")
        return [_file_object(r) for r in page], more

    def delete_file(self, fid: str) -> bool:
        """Remove a file's record and bytes; False when there is no such file. A batch made from an
        input file keeps running (its requests live in the database); a deleted output file is gone
        for ``files.content``, as in OpenAI's API."""
        with self._lock:
            self.db.execute("BEGIN IMMEDIATE")
            n = self.db.execute("DELETE FROM files WHERE id = ?", (fid,)).rowcount
            self.db.execute("COMMIT")
        if n:
            (self.files_dir / fid).unlink(missing_ok=True)
        return bool(n)

    def file_bytes(self, fid: str) -> bytes:
        """Contents of a stored file. Raises FileNotFoundError."""
        return (self.files_dir / fid).read_bytes()

    # -- batches --------------------------------------------------------------------------------------
    def create_batch(self, obj: dict, rows: list[dict]) -> None:
        """Insert a batch object and its request rows in one transaction.

        ``rows``: dicts with ``line``, ``custom_id``, ``body`` (JSON text or None), ``state``,
        ``record`` (dict or None), ``prompt_tokens``, ``max_tokens``.
        """
        ops = [("INSERT INTO batches VALUES (?, ?, ?, ?)", (obj["id"], obj["status"], obj["created_at"], json.dumps(obj)))]
        for r in rows:
            rec = None if r.get("record") is None else json.dumps(r["record"])
            ops.append(("INSERT INTO requests VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        (obj["id"], r["line"], r["custom_id"], r["body"], r["state"], rec,
                         r.get("prompt_tokens"), r.get("max_tokens"))))
        self._tx(ops)

    def batch(self, bid: str) -> dict | None:
        rows = self._query("SELECT obj FROM batches WHERE id = ?", (bid,))
        return json.loads(rows[0]["obj"]) if rows else None

    def update_batch(self, bid: str, **fields: Any) -> dict:
        """Set fields of a batch object (``status`` included); return the new object. Raises KeyError."""
        with self._lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                row = self.db.execute("SELECT obj FROM batches WHERE id = ?", (bid,)).fetchone()
                if row is None:
                    raise KeyError(bid)
                obj = json.loads(row["obj"])
                obj.update(fields)
                self.db.execute("UPDATE batches SET status = ?, obj = ? WHERE id = ?", (obj["status"], json.dumps(obj), bid))
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")
        return obj

    def list_batches(self, after: str | None = None, limit: int = 20) -> tuple[list[dict], bool]:
        """Newest first, from the one after the batch ``after``: (objects, has_more). Raises
        :class:`UnknownCursorError` when ``after`` is not a batch."""
        rows = self._query("SELECT id, obj FROM batches ORDER BY rowid DESC")
        page, more = _page(rows, after, limit, "batch")
        return [json.loads(r["obj"]) for r in page], more

    def batches_with_status(self, *statuses: str) -> list[dict]:
        marks = ",".join("?" * len(statuses))
        rows = self._query(f"SELECT obj FROM batches WHERE status IN ({marks}) ORDER BY created_at", statuses)
        return [json.loads(r["obj"]) for r in rows]

    # -- requests -------------------------------------------------------------------------------------
    def pending(self, bid: str) -> list[sqlite3.Row]:
        """Rows not finished yet, in line order."""
        return self._query("SELECT * FROM requests WHERE batch_id = ? AND state = 'pending' ORDER BY line", (bid,))

    def finish_request(self, bid: str, line: int, state: str, record: dict) -> bool:
        """Record the result of a pending line (committed at once). False if it was not pending."""
        if state not in ("completed", "failed"):
            raise ValueError(f"state must be completed or failed, got {state!r}")
        with self._lock:
            cur = self.db.execute(
                "UPDATE requests SET state = ?, record = ? WHERE batch_id = ? AND line = ? AND state = 'pending'",
                (state, json.dumps(record), bid, line))
            return cur.rowcount == 1

    def counts(self, bid: str) -> dict[str, int]:
        """OpenAI ``request_counts``: total, completed, failed (pending = total - both)."""
        rows = self._query("SELECT state, COUNT(*) AS n FROM requests WHERE batch_id = ? GROUP BY state", (bid,))
        by = {r["state"]: r["n"] for r in rows}
        return {"total": sum(by.values()), "completed": by.get("completed", 0), "failed": by.get("failed", 0)}

    def records(self, bid: str, state: str) -> Iterator[str]:
        """Records (JSON text) of the lines in ``state``, in line order."""
        for r in self._query("SELECT record FROM requests WHERE batch_id = ? AND state = ? ORDER BY line", (bid, state)):
            yield r["record"]


class UnknownCursorError(KeyError):
    """A list's ``after`` cursor names no object of the list (never created, or deleted)."""

    def __init__(self, what: str, after: str):
        super().__init__(after)
        self.message = f"'after' must be the id of a {what} of this list; there is no {what} {after!r}"


def _page(rows: list[sqlite3.Row], after: str | None, limit: int, what: str) -> tuple[list[sqlite3.Row], bool]:
    """OpenAI's cursor pagination over ``rows`` (in list order): at most ``limit`` rows from the
    one after the row whose ``id`` is ``after`` (from the first when None), and whether more follow.
    Raises :class:`UnknownCursorError`: an unknown cursor is an error, not the first page again
    (a client paging with it would loop)."""
    start = 0
    if after is not None:
        ids = [r["id"] for r in rows]
        if after not in ids:
            raise UnknownCursorError(what, after)
        start = ids.index(after) + 1
    return rows[start:start + limit], start + limit < len(rows)


def _file_object(r: sqlite3.Row) -> dict:
    """OpenAI's ``file`` object of a ``files`` row."""
    return {"id": r["id"], "object": "file", "bytes": r["bytes"], "created_at": r["created_at"],
            "filename": r["filename"], "purpose": r["purpose"], "status": "processed", "status_details": None}
