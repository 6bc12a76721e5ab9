"""Limits the CLI shows in its help, kept apart from the task models so `farm --help` loads no pydantic."""

# Tasks one job may expand to (models × matrix cells × repeats × target runs) unless the
# submitter or the controller says otherwise: a 1 MiB job file must not allocate 1e8 rows.
DEFAULT_MAX_TASKS = 10_000
