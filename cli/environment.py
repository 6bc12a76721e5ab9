"""Every environment variable farm reads, with what it does: `farm --help`'s ENVIRONMENT section and the
docs/reference/command-line.md's list come from here (tests/test_cli_conventions.py checks the source reads
no other)."""

from __future__ import annotations

ENVIRONMENT: dict[str, str] = {
    "FARM_DB": "the SQLite store (default: the user data directory's farm.db); --db wins",
    "FARM_CONTROLLER": "HOST:PORT of the controller clients and agents talk to (else the config file, else embedded)",
    "FARM_TOKEN": "the client or agent token (removed from the environment at start: no child inherits it)",
    "FARM_TLS_CA": "the CA certificate a client or agent trusts for the controller's TLS",
    "FARM_TLS_CERT": "the client certificate for mutual TLS (with FARM_TLS_KEY)",
    "FARM_TLS_KEY": "the client certificate's private key",
    "FARM_CONFIG": "the config file (default: the user config directory's farm/config.toml)",
    "FARM_TOKENS": "the controller's tokens file (`ROLE TOKEN [AGENT_NAME]` a line); --tokens wins",
    "FARM_DEVICES": "the lab's device list (YAML) for device targets; --devices wins",
    "FARM_DEVICE_TYPES": "extra folders of device-type YAML files, ':'-separated (later ones override by name)",
    "FARM_REFERENCE_SUITE": "the reference suite `farm refresh` runs (default: the one farm ships); --suite wins",
    "FARM_HEALTH_MAX_AGE_H": "hours before a device's health check is stale and re-run before user work (24)",
    "FARM_STORE_WAIT_S": "seconds a write waits for an SQLite store another process holds locked before it gives up (30)",
    "FARM_WEBHOOK_URL": "where drift and quarantine alerts are POSTed",
    "FARM_CGROUP_VERSION": "2: the cgroup sandbox uses cgroup v2 even where a usable v1 hierarchy is mounted",
    "FARM_CGROUP_PARENT": "the cgroup v2 folder sim runs are made under (default: <mount>/farm)",
    "FARM_WARM_HARNESS": "0: every sim run starts its harness cold (default: runs fork from a kept, warm interpreter per runtime)",
    "FARM_RUN_UIDS": "FIRST:COUNT, the uid range an agent's runs take one uid each from (default 2046820352:65536)",
    "FARM_ISOLATE": "set by the agent for a cold run's own harness (its isolation settings); never set it yourself",
    "DOCKER_HOST": "the Docker engine the docker sandbox talks to (the Docker SDK's own variable)",
    "COLUMNS": "the width of tables when output is piped (default 160)",
    "PATH": "where a script job's and the sandbox's tools are found (passed on to runs)",
}


def environment_help() -> str:
    """The ENVIRONMENT section of `farm --help`."""
    width = max(map(len, ENVIRONMENT))
    return "ENVIRONMENT:\n" + "\n".join(f"  {name:<{width}}  {text}" for name, text in ENVIRONMENT.items())
