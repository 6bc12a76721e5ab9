"""The lab dashboard in a browser: devices, jobs, calibrations and drift, served by the controller or `farm web`."""
