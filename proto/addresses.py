"""A controller's address as a person gives it (`--controller`, FARM_CONTROLLER, the config file, the Python API).

One parser for agents and clients: HOST:PORT with the port a number from 1 to 65535, a host alone getting
the default port, an IPv6 host in brackets. Anything else is refused naming the entry, before a channel is
opened: grpc would otherwise dial what it makes of it (`:99999` wraps to 34463, `:-5` to 65531) and a
token would travel to a port nobody named (issue 33, M7).
"""

from __future__ import annotations

import re

from farm.proto.escape import printable

DEFAULT_PORT = 7443  # a controller's port when an address names only its host
MAX_CONTROLLERS = 16  # a list longer than a lab has controllers is a mistake (or hostile)
_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,252})?|\[[0-9A-Fa-f:.]{2,45}\]")


def controller_addresses(text: str, default_port: int) -> list[str]:
    """The controllers of `a:1,b:2` (a host alone gets `default_port`), in order.

    Raises ValueError naming the bad entry: each must be HOST:PORT (an IPv6 host in brackets), port 1-65535.
    """
    entries = text.split(",")
    if len(entries) > MAX_CONTROLLERS:
        raise ValueError(f"{len(entries)} controller addresses: at most {MAX_CONTROLLERS}")
    addresses: list[str] = []
    for number, raw in enumerate(entries, 1):
        entry = raw.strip()
        host, colon, port = entry.rpartition(":") if entry.rfind(":") > entry.rfind("]") else (entry, "", "")
        where = f"controller address {number} ('{printable(entry, limit=80)}')"
        if not entry:
            raise ValueError(f"controller address {number} is empty: give HOST:PORT entries separated by commas")
        if not _HOST.fullmatch(host):
            raise ValueError(f"{where}: '{printable(host, limit=80)}' is not a host name or address "
                             "(letters, digits, '.', '-', '_'; an IPv6 address in brackets)")
        if colon and not (port.isascii() and port.isdigit() and len(port) <= 5 and 1 <= int(port) <= 65535):
            raise ValueError(f"{where}: the port must be a number from 1 to 65535")
        address = entry if colon else f"{host}:{default_port}"
        if address in addresses:
            raise ValueError(f"{where}: named twice")
        addresses.append(address)
    return addresses


def controller_address(text: str, default_port: int) -> str:
    """One controller's HOST:PORT, checked as `controller_addresses` checks each entry of a list."""
    if "," in text:
        raise ValueError(f"'{printable(text, limit=80)}' names several controllers; give one HOST:PORT")
    return controller_addresses(text, default_port)[0]
