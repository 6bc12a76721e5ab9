"""Clients of a farm: `open_farm` picks the embedded store or a controller, never both."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from farm.client.api import Farm, FarmError
from farm.client.config import Credentials, address_of


def open_farm(controller: str | None = None, *, db: Path | str | None = None,
              credentials: Credentials | None = None, **embedded: Any) -> Farm:
    """The controller named by `controller`, $FARM_CONTROLLER or the config file; else the local store.

    A named controller is always the answer, reachable or not: nothing falls back to a local store."""
    address = address_of(controller)
    if address:
        from farm.client.remote import RemoteFarm
        return RemoteFarm(address, credentials or Credentials.resolve())
    from farm.client.embedded import EmbeddedFarm
    return EmbeddedFarm(db, **embedded)


__all__ = ["Credentials", "Farm", "FarmError", "open_farm"]
