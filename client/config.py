"""Which farm a client talks to: --controller, else $FARM_CONTROLLER, else `controller = ...` in the
config file ($FARM_CONFIG, default ~/.config/farm/config.toml); the same for the token and TLS files.
With no controller named anywhere the farm is embedded: a local store ($FARM_DB or --db)."""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from farm.client.errors import FarmError

from farm.proto.addresses import DEFAULT_PORT as DEFAULT_PORT  # re-exported: the CLI's --listen default


def config_path() -> Path:
    if os.environ.get("FARM_CONFIG"):
        return Path(os.environ["FARM_CONFIG"])
    from platformdirs import user_config_dir
    return Path(user_config_dir("farm", appauthor=False)) / "config.toml"


def read_config() -> dict[str, Any]:
    path = config_path()
    if not path.is_file():
        return {}
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise FarmError(f"{path}: cannot read the farm config file: {e}") from None


def setting(given: str | None, name: str, env: str) -> str | None:
    """The value given (a flag), else $ENV, else the config file's key."""
    value = given or os.environ.get(env)
    return value or read_config().get(name)


def address_of(given: str | None) -> str | None:
    """The controller's HOST:PORT (the default port when only a host is named), or None: embedded.

    A list (`a:1,b:2`, for agents that fail over between controllers on one PostgreSQL) gives its first
    entry, so one FARM_CONTROLLER serves agents and clients alike."""
    address = setting(given, "controller", "FARM_CONTROLLER")
    if not address:
        return None
    return checked_addresses(address)[0]


def addresses_of(given: str | None) -> list[str]:
    """Every controller of the list address_of takes the first of (empty: embedded): a client whose
    controller goes away carries on through the next (a watch, `farm submit` waiting for its job)."""
    address = setting(given, "controller", "FARM_CONTROLLER")
    return checked_addresses(address) if address else []


WHERE_CONTROLLER = "--controller (or FARM_CONTROLLER, or the config file's controller)"


def checked_addresses(text: str) -> list[str]:
    """Every controller of `a:1,b:2`, checked by the one parser agents use too (farm.proto.addresses): a port
    outside 1-65535 is a usage error naming the flag and the entry, never dialled as what grpc makes of it."""
    from farm.proto.addresses import controller_addresses

    try:
        return controller_addresses(text, DEFAULT_PORT)
    except ValueError as e:
        raise FarmError(f"{WHERE_CONTROLLER}: {e}") from None


@dataclass(frozen=True)
class Credentials:
    token: str | None = None
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None

    @classmethod
    def resolve(cls, token: str | None = None, tls_ca: str | None = None, tls_cert: str | None = None,
                tls_key: str | None = None) -> "Credentials":
        ca = setting(tls_ca, "tls_ca", "FARM_TLS_CA")
        cert, key = setting(tls_cert, "tls_cert", "FARM_TLS_CERT"), setting(tls_key, "tls_key", "FARM_TLS_KEY")
        return cls(setting(token, "token", "FARM_TOKEN"), Path(ca) if ca else None,
                   Path(cert) if ca and cert else None, Path(key) if ca and key else None)
