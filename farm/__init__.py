"""farm: profile ML models under a device's budget, pair with real devices, calibrate.

`farm.connect()` opens a farm from Python (see farm.api); it is imported on first use, so
`import farm` stays cheap."""

from farm.version import __version__

_API = ("connect", "Lab", "Job", "Results", "RunRecord", "Prediction", "Calibration", "FarmError")


def __getattr__(name: str) -> object:  # PEP 562: farm.api loads on first use
    if name in _API:
        from farm import api
        return getattr(api, name)
    raise AttributeError(f"module 'farm' has no attribute {name!r}")


__all__ = ["__version__", *_API]
