"""farm: profile ML models under a device's budget, pair with real devices, calibrate."""

__version__ = "0.1.0"
