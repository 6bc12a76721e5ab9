"""What every front end shares before it asks anything: farm's exit codes, the refusal (`FarmError`) and a job's
progress. No pydantic and no question table here (issue 34): `farm --version` and `farm --help` import the CLI's
consoles, which import this, and build no answer model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # an answer model (pydantic): loaded by whoever builds the problems, never here
    from farm.proto.questions import Problem

# farm's exit codes, the one set: every command's, and the code a FarmError carries (README.md: "Exit codes").
EXIT_OK, EXIT_RUNS_FAILED, EXIT_BAD_INPUT, EXIT_ENVIRONMENT, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


class FarmError(Exception):
    """A refusal said so a person can act on it; exit_code is the CLI's (2 bad input, 3 environment)."""

    def __init__(self, message: str, exit_code: int = EXIT_BAD_INPUT, problems: list[Problem] | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.problems = problems or []  # file / line / field / message, for scripts


@dataclass(frozen=True)
class Progress:
    """One step of a job being run or watched; `last` names the run that just finished, when known."""

    job: int
    status: str
    total: int
    completed: int
    failed: int
    running: int
    canceled: int = 0
    last: str | None = None

    @property
    def done(self) -> int:
        return self.completed + self.failed + self.canceled


__all__ = ["EXIT_BAD_INPUT", "EXIT_ENVIRONMENT", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_RUNS_FAILED", "FarmError",
           "Progress"]
