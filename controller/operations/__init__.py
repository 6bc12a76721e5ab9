"""Operations: keeping the farm healthy over time — the nightly reference suite and its refresh,
drift and quarantine, alerts and Prometheus metrics."""
