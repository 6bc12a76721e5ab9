"""Clients of a farm: `open_farm` picks the embedded store or a controller, never both.

`Farm` and `Credentials` load on first use (PEP 562), so importing farm.client.errors (the CLI's start-up)
builds no answer model."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from farm.client.errors import FarmError

if TYPE_CHECKING:
    from farm.client.api import Farm
    from farm.client.config import Credentials


def open_farm(controller: str | None = None, *, db: Path | str | None = None,
              credentials: Credentials | None = None, **embedded: Any) -> Farm:
    """The controller named by `controller`, $FARM_CONTROLLER or the config file; else the local store.

    A named controller is always the answer, reachable or not: nothing falls back to a local store."""
    from farm.client.config import Credentials, addresses_of

    addresses = addresses_of(controller)
    if addresses:
        from farm.client.remote import RemoteFarm
        return RemoteFarm(addresses[0], credentials or Credentials.resolve(), others=addresses[1:])
    from farm.client.compose import EmbeddedSettings, build_embedded
    return build_embedded(EmbeddedSettings(db=db, **embedded))


def __getattr__(name: str) -> object:  # PEP 562: the client API (pydantic answer models) loads on first use
    if name == "Farm":
        from farm.client.api import Farm
        return Farm
    if name == "Credentials":
        from farm.client.config import Credentials
        return Credentials
    raise AttributeError(f"module 'farm.client' has no attribute {name!r}")


__all__ = ["Credentials", "Farm", "FarmError", "open_farm"]
