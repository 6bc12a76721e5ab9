"""The lab's store: repositories of jobs, leases, runs, devices, calibrations and artifacts behind one
interface (interface.py), with typed rows (rows.py). SQLite (sqlite.py) is the implementation today;
`open_store` is where a second database plugs in.
"""

from __future__ import annotations

import os
from pathlib import Path

from farm.controller.store.interface import (
    ArtifactRepository, CalibrationRepository, DeviceRepository, JobRepository, LabReads, LeaseRepository,
    RunRepository, Store, StoreError, VisibleTo)
from farm.controller.store.metrics import METRIC_UNITS, UnknownMetric
from farm.controller.store.sqlite import BUSY_TIMEOUT_S, SQLiteStore, store_error_message

DB_ENV = "FARM_DB"

__all__ = [
    "ArtifactRepository", "BUSY_TIMEOUT_S", "CalibrationRepository", "DB_ENV", "DeviceRepository", "JobRepository",
    "LabReads", "LeaseRepository", "METRIC_UNITS", "RunRepository", "SQLiteStore", "Store", "StoreError",
    "UnknownMetric", "VisibleTo", "default_db_path", "open_store", "store_error_message"]


def default_db_path() -> Path:
    if os.environ.get(DB_ENV):
        return Path(os.environ[DB_ENV])
    from platformdirs import user_data_dir
    return Path(user_data_dir("farm", appauthor=False)) / "farm.db"


def open_store(path: Path | str, *, create_folder: bool = False) -> Store:
    """The store at `path` (a file, or ":memory:"), created and brought to the current schema when needed."""
    if "://" in str(path):
        raise StoreError(f"--db {str(path)[:80]!r}: this farm stores a lab in an SQLite file only; give a file "
                         "path such as ~/farm.db")
    return SQLiteStore(path, create_folder=create_folder)
