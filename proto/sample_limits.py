"""How many per-iteration timings and telemetry samples one run keeps, and what its message says when it had
more: shared by the wire (proto/wire.py, for any driver's result) and the sim's script mode, which keeps no more
than this from the first line it reads (agents/harness/script_runner.py). No pydantic, no protobuf: the harness
imports it inside the sandbox."""

from __future__ import annotations

# Per-iteration timings and telemetry samples a run keeps (the summary is computed from all).
MAX_SAMPLES = 100_000


def kept_note(total: int, what: str) -> str:
    """`kept the first 100000 of 2200000 per-iteration timings`: one part of a run's message."""
    return f"kept the first {MAX_SAMPLES} of {total} {what}"


def notes_message(message: str, notes: list[str]) -> str:
    """A run's message with the notes on what was cut after it."""
    if not notes:
        return message
    note = "; ".join(notes) + " (the summary covers them all)"
    return f"{message}; {note}" if message else note
