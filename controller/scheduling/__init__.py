"""Scheduling: job files and jobs from the wire, task expansion, leases and results (the
Controller), the artifact store and the SQLite store under them all."""
