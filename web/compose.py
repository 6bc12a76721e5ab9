"""The dashboard's composition: farm.client.compose builds the controller, this serves its dashboard beside it.

It lives in web/ because the dashboard is web's and web ranks above client (tests/test_import_direction.py):
client/compose.py cannot import it. Like the others, it is built from typed settings and has start()/stop()."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from farm.client.compose import ControllerServer
from farm.client.errors import EXIT_ENVIRONMENT, FarmError


@dataclass(frozen=True)
class DashboardSettings:
    listen: str  # HOST:PORT (`farm controller serve --web-listen`)


class Dashboard:
    """The lab dashboard of one running controller: its buttons call that controller as the CLI and RPCs do
    (a cancel reaches the agents now, a released device gets tasks at once)."""

    def __init__(self, settings: DashboardSettings, controller: ControllerServer) -> None:
        from farm.controller.auth import is_loopback
        from farm.web.server import WebListenError, parse_web_listen

        try:
            host, port = parse_web_listen(settings.listen)
            if controller.tokens is None and not is_loopback(f"[{host}]:{port}"):
                raise WebListenError(f"--no-auth is only allowed on loopback addresses; the dashboard's --web-listen "
                                     f"{settings.listen} is not one")
        except WebListenError as e:
            raise FarmError(str(e)) from None
        self.settings, self.controller = settings, controller
        self.running: Any = None

    @property
    def url(self) -> str:
        return str(self.running.url) if self.running else ""

    def start(self) -> Dashboard:
        from farm.web.server import Operator, WebListenError, listen_warnings, start_dashboard
        from farm.web.views import agents_now

        server, settings = self.controller, self.settings
        farm = server.farm
        store = server.store
        assert store is not None  # a started controller has its store

        def release(device: str) -> None:
            farm.controller.release(device)
            farm.wake(queue_changed=True)

        for warning in listen_warnings(settings.listen, tokens=server.tokens is not None, tls=server.tls is not None):
            logging.getLogger("farm.web").warning("%s", warning)
        operator = Operator(farm.cancel_job, lambda device, reason, health: farm.controller.quarantine(
            device, reason, health=health), release)
        try:
            self.running = start_dashboard(store, settings.listen, operator, tokens=server.tokens, tls=server.tls,
                                           job_sharing=farm.job_sharing, live=lambda: agents_now(farm.agents))
        except WebListenError as e:
            raise FarmError(str(e), EXIT_ENVIRONMENT) from None
        return self

    def stop(self) -> None:
        if self.running is not None:
            self.running.stop()
            self.running = None

    def __enter__(self) -> Dashboard:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def build_dashboard(settings: DashboardSettings, controller: ControllerServer) -> Dashboard:
    """Checked now (the address, --no-auth off loopback); serving starts at start(), after the controller's."""
    return Dashboard(settings, controller)
