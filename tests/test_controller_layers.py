"""The controller is split by role, and the roles stack: scheduling (jobs, leases, results, the
store) at the bottom, analysis (calibration, rankings, reports) on it, operations (refresh,
nightly, alerts, metrics) on both, and the front door on top: grpc_server.py with its servicers in rpc/, auth.py,
async_calls.py (the server's asyncio loop) and service.py (what a user can ask, answered once for the embedded client and the
gRPC servicer).
No module imports its way back up, and no import cycle exists, counting imports inside functions."""

from __future__ import annotations

from pathlib import Path

from test_import_direction import ROOT, imported_modules

CONTROLLER = ROOT / "controller"
LAYER = {"store": -1, "scheduling": 0, "analysis": 1, "operations": 2}  # store: the repositories, under all
# Imports against the stack, each with its reason. None: a quarantine reaches operations' alert through
# scheduling's hook (controller/scheduling/hooks.py, registered in controller/__init__.py).
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}


def _module(path: Path) -> str:
    parts = path.relative_to(CONTROLLER).with_suffix("").parts
    return ".".join(("farm", "controller", *[p for p in parts if p != "__init__"]))


def _graph() -> dict[str, set[str]]:
    modules = {_module(p): p for p in CONTROLLER.rglob("*.py")}
    return {name: {m for _, m in imported_modules(path) if m in modules and m != name} for name, path in modules.items()}


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYER.get(parts[2], 3) if len(parts) > 2 else 3  # a role package or its module; else the front door


def test_every_controller_module_has_a_role() -> None:
    loose = sorted(p.name for p in CONTROLLER.glob("*.py") if p.stem not in ("__init__", "grpc_server", "auth", "async_calls", "service"))
    assert loose == [], f"modules outside scheduling/, analysis/, operations/: {loose}"


def test_no_role_imports_a_role_above_it() -> None:
    upward = [f"{a} imports {b}" for a, deps in _graph().items() for b in deps
              if _layer(b) > _layer(a) and (a, b) not in ALLOWED_UPWARD]
    assert upward == [], "\n".join(upward)


def test_no_import_cycle_in_the_controller() -> None:
    graph, state, cycles = _graph(), {}, []

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                cycles.append(" -> ".join(path[path.index(dep):] + [dep]) if dep in path else f"{node} -> {dep}")
            elif dep not in state:
                visit(dep, [*path, dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == [], "\n".join(cycles)
