"""Which extra of `pip install farm[...]` brings which module, and the message when one is missing.

The base install runs an agent; the store and controller, calibration and reports, the dashboard and
pandas are extras (pyproject.toml's [project.optional-dependencies]). A command needs an extra only
for what it does here: `farm calibrate --controller HOST` fits on the controller and needs nothing
local, so the check is made when an import fails, not up front.
"""

from __future__ import annotations

# Top-level module -> the extra that installs it (keep in step with pyproject.toml).
MODULE_EXTRA = {
    "sqlite_utils": "controller", "croniter": "controller", "prometheus_client": "controller",
    "grpc_health": "controller", "grpc_reflection": "controller",
    "scipy": "analysis", "matplotlib": "analysis",
    "pandas": "pandas",
    "docker": "docker",
    "psycopg": "postgresql",  # a store at --db postgresql://...
}
# What a command needs when it runs here (embedded or serving), beyond the extra of the module that failed:
# so `farm calibrate` in a base install names both the store and the fitting stack at once.
COMMAND_EXTRAS = {
    "calibrate": ("controller", "analysis"), "calibrations": ("controller", "analysis"),
    "predict": ("controller", "analysis"), "rank": ("controller", "analysis"), "report": ("controller", "analysis"),
    "refresh": ("controller", "analysis"), "drift": ("controller", "analysis"),
    "web": ("web",), "controller": ("controller", "analysis"),
}
EXTRA_MODULES = {extra: [m for m, e in MODULE_EXTRA.items() if e == extra] for extra in set(MODULE_EXTRA.values())}
# the dashboard is standard-library HTTP over the store, with the calibration fits its pages show
EXTRA_MODULES["web"] = EXTRA_MODULES["controller"] + EXTRA_MODULES["analysis"]
# Extras that install others (pyproject's "farm[controller]" lines): naming the outer one is enough.
EXTRA_INCLUDES = {"analysis": {"controller"}, "web": {"controller", "analysis"}, "postgresql": {"controller"}}


def extra_for(module: str | None) -> str | None:
    """The extra that installs `module` (a dotted name is fine), or None when no extra does."""
    return MODULE_EXTRA.get((module or "").split(".")[0])


def _installed(module: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing_extras(command: str, module: str | None) -> list[str]:
    """The extras `command` needs here that this install lacks, the failed module's first."""
    wanted = [e for e in (extra_for(module), *COMMAND_EXTRAS.get(command, ())) if e]
    missing: list[str] = []
    for extra in wanted:
        if extra not in missing and (extra == extra_for(module) or not all(map(_installed, EXTRA_MODULES[extra]))):
            missing.append(extra)
    covered = set().union(*(EXTRA_INCLUDES.get(e, set()) for e in missing))
    return [e for e in missing if e not in covered]


def missing_extra_message(command: str, module: str | None) -> str:
    """One paragraph: which extras `farm COMMAND` needs and the pip line that installs them."""
    extras = missing_extras(command, module)
    names = " and ".join(f"'{e}'" for e in extras)
    noun = "extra" if len(extras) == 1 else "extras"
    return (f"`farm {command}` needs the {names} {noun} (this install has no {module}): "
            f"pip install 'farm[{','.join(extras)}]' (or 'farm[all]' for everything).")
