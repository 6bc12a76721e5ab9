"""The TLS file bundle both ends of the wire name: a server's cert+key (+ the CA it checks
clients with), or a client's/agent's CA (+ its own cert+key for mutual TLS)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


class CredentialFileError(Exception):
    """A token or TLS file that cannot be used; the message names the file."""


@dataclass
class TlsFiles:
    """PEM files: a server's cert+key (+ the CA it checks clients with), or a client's CA (+ cert+key)."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None

    def read(self, which: str) -> bytes | None:
        path = getattr(self, which)
        if path is None:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as e:
            raise CredentialFileError(f"cannot read the TLS {which} file {path}: {e}") from None
