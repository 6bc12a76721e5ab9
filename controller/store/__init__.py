"""The lab's store: repositories of jobs, leases, runs, devices, calibrations and artifacts behind one
interface (interface.py), with typed rows (rows.py). SQLite (sqlite.py) is the embedded default;
PostgreSQL (postgres.py, the `postgresql` extra) holds a lab that several controllers share. `open_store`
picks one from --db: a file path, or a postgresql:// URL.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from farm.controller.store.interface import (
        ArtifactRepository, CalibrationRepository, DeviceRepository, JobRepository, LabReadRepository, LeaseRepository,
        RunRepository, Store, StoreError, StoreUnavailable, VisibleTo)
    from farm.controller.store.metrics import METRIC_UNITS, UnknownMetric
    from farm.controller.store.sqlite import BUSY_TIMEOUT_S, SQLiteStore, store_error_message

DB_ENV = "FARM_DB"

# What the package re-exports, by the module that defines it: loaded on first use (PEP 562), so importing a light
# module of the package (schema, job_listing) or db_location does not build the rows' dataclasses and the results'
# models (`farm jobs` on an up-to-date store reads it without them, issue 34 item 5)
_LAZY = {
    **dict.fromkeys(("ArtifactRepository", "CalibrationRepository", "DeviceRepository", "JobRepository", "LabReadRepository",
                     "LeaseRepository", "RunRepository", "Store", "StoreError", "StoreUnavailable", "VisibleTo"),
                    "farm.controller.store.interface"),
    **dict.fromkeys(("METRIC_UNITS", "UnknownMetric"), "farm.controller.store.metrics"),
    **dict.fromkeys(("BUSY_TIMEOUT_S", "SQLiteStore", "store_error_message"), "farm.controller.store.sqlite"),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'farm.controller.store' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

__all__ = [
    "ArtifactRepository", "BUSY_TIMEOUT_S", "CalibrationRepository", "DB_ENV", "DeviceRepository", "JobRepository",
    "LabReadRepository", "LeaseRepository", "METRIC_UNITS", "RunRepository", "SQLiteStore", "Store", "StoreError",
    "StoreUnavailable", "UnknownMetric", "VisibleTo", "db_location", "default_db_path", "is_store_error", "is_url",
    "lost_connection", "open_store", "redact_url", "store_error_message"]
# --db schemes a store is opened from (psycopg takes both spellings, as libpq does)
POSTGRES_SCHEMES = ("postgresql", "postgres")


def default_db_path() -> Path:
    if os.environ.get(DB_ENV):
        return Path(os.environ[DB_ENV])
    from platformdirs import user_data_dir
    return Path(user_data_dir("farm", appauthor=False)) / "farm.db"


def is_url(location: Path | str) -> bool:
    """A database address (scheme://...) rather than a file path."""
    return isinstance(location, str) and "://" in location


def redact_url(url: str) -> str:
    """The address without its password: what logs and messages may show."""
    from farm.controller.store.postgres import redact_url as redact

    return redact(url)


def lost_connection(error: BaseException) -> bool:
    """Whether `error` says the store's database is out of reach for now (a connection the server dropped, a
    server that refuses or is restarting), as opposed to a refused statement or a bug: worth a retry."""
    import sys

    from farm.controller.store.interface import StoreUnavailable

    if isinstance(error, StoreUnavailable):
        return True
    psycopg = sys.modules.get("psycopg")
    return psycopg is not None and isinstance(error, psycopg.OperationalError)


def is_store_error(error: BaseException) -> bool:
    """An error raised by a store's database (SQLite's, or psycopg's), rather than by farm's own code."""
    import sqlite3

    return isinstance(error, sqlite3.Error) or type(error).__module__.startswith("psycopg.")


def db_location(db: str | None) -> Path | str:
    """Where --db (or $FARM_DB, or the user data folder) points: a file path, or a URL kept as text (a Path
    would fold its `//`)."""
    text = db or os.environ.get(DB_ENV) or None
    if text is not None and is_url(text):
        return text
    return Path(text) if text else default_db_path()


def open_store(path: Path | str, *, create_folder: bool = False) -> Store:
    """The store at `path`: an SQLite file (or ":memory:") created and brought to the current schema when needed,
    or a PostgreSQL database at a postgresql:// URL (its schema created when the database is empty)."""
    from farm.controller.store.interface import StoreError

    if is_url(path):
        assert isinstance(path, str)
        scheme = path.split("://", 1)[0].lower()
        shown = redact_url(path)
        if scheme not in POSTGRES_SCHEMES:
            raise StoreError(f"--db {shown[:80]!r}: farm keeps a lab in an SQLite file (a path such as ~/farm.db) "
                             f"or in PostgreSQL (postgresql://user@host:5432/farm); {scheme[:20]!r} is neither.")
        try:
            urlsplit(path).port  # a port that is not a number in 0-65535 (issue 32: a traceback before)
        except ValueError:
            raise StoreError(f"--db {shown[:120]!r}: the port after the host must be a number from 1 to 65535 "
                             "(postgresql://user@host:5432/farm).") from None
        from farm.controller.store.postgres import PostgresStore

        return PostgresStore(path)
    from farm.controller.store.sqlite import SQLiteStore

    return SQLiteStore(path, create_folder=create_folder)
