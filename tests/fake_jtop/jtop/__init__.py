"""A stand-in for jetson-stats' client on the test board: the `with jtop() as j: while j.ok(): j.stats`
shape of the real API (see shared/reference/native_tools.md), with a Jetson Nano's figures."""

import time


class jtop:  # noqa: N801 (the real class is lower case)
    def __init__(self, interval=0.5):
        self.interval = interval
        self._first = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def ok(self):
        if not self._first:
            time.sleep(self.interval)
        self._first = False
        return True

    @property
    def stats(self):
        return {"time": time.time(), "uptime": 1234.5, "CPU1": 97, "CPU2": 12, "CPU3": "OFF", "CPU4": 3,
                "RAM": 0.41, "SWAP": 0.0, "GPU": 0, "Temp CPU": 41.5, "Power POM_5V_IN": 4211,
                "Power TOT": 4211, "jetson_clocks": "OFF", "nvp model": "MAXN"}
