"""CLI conventions (issue 23 item 4): help text on every option and positional, -v/--log-level on every
command, remote flags only where a controller is used, shell completion generated from the parser, and
every environment variable farm reads listed in `farm --help` and docs/reference/command-line.md."""

from __future__ import annotations

import argparse
import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from farm.cli.environment import ENVIRONMENT
from farm.cli.main import _leaf_parsers, build_parser

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_FOLDERS = ("agents", "cli", "client", "controller", "farm", "models", "proto", "web")
LOCAL_ONLY = ("backends", "models generate", "schema", "inspect", "quantize", "completion", "manpage", "import auptimizer", "web")


def _commands() -> dict[str, argparse.ArgumentParser]:
    found: dict[str, argparse.ArgumentParser] = {}

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        found[path] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    walk(child, f"{path} {name}".strip())
    walk(build_parser(), "")
    return found


def test_every_option_and_positional_has_help() -> None:
    missing = [f"farm {path} {a.option_strings or a.dest}" for path, parser in _commands().items()
               for a in parser._actions
               if not isinstance(a, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction))
               and not (a.help and a.help.strip())]
    assert missing == []


def test_every_command_takes_verbose_and_log_level() -> None:
    leaves = _leaf_parsers(build_parser())
    assert len(leaves) > 25
    for leaf in leaves:
        flags = {o for a in leaf._actions for o in a.option_strings}
        assert {"-v", "--verbose", "--log-level"} <= flags, leaf.prog
    args = build_parser().parse_args(["jobs", "--log-level", "info"])
    assert args.log_level == "info" and not args.verbose
    with pytest.raises(SystemExit):
        build_parser().parse_args(["jobs", "--log-level", "loud"])


def test_remote_flags_only_on_commands_that_use_a_controller() -> None:
    commands = _commands()
    for path in LOCAL_ONLY:
        flags = {o for a in commands[path]._actions for o in a.option_strings}
        assert "--controller" not in flags and "--token" not in flags, path
    for path in ("submit", "jobs", "results", "calibrate", "devices", "agent"):
        assert "--controller" in {o for a in commands[path]._actions for o in a.option_strings}, path


def _farm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "farm.cli.main", *args], capture_output=True, text=True, timeout=120)


def test_bash_completion_is_valid_and_completes_commands_options_and_choices(tmp_path: Path) -> None:
    p = _farm("completion", "bash")
    assert p.returncode == 0, p.stderr
    script = tmp_path / "farm.bash"
    script.write_text(p.stdout)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True).returncode == 0

    def complete(*words: str) -> list[str]:
        probe = (f"source {script}; complete -p farm; COMP_WORDS=(farm {' '.join(words)} ''); "
                 f"COMP_CWORD={len(words) + 1}; _farm; printf '%s\\n' \"${{COMPREPLY[@]}}\"")
        r = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        registration, *replies = r.stdout.splitlines()
        assert registration == "complete -o default -F _farm farm"
        return replies

    assert {"submit", "calibrate", "completion", "controller"} <= set(complete())
    assert complete("models") == ["generate", "-h", "--help"]
    assert {"--limit", "--log-level", "--controller"} <= set(complete("jobs"))
    assert complete("submit", "job.yaml", "--priority") == ["interactive", "normal", "low"]
    assert complete("controller") == ["serve", "-h", "--help"]
    assert "--sim-slots" in complete("agent", "--name", "x")


@pytest.mark.parametrize("shell", ["zsh", "fish"])
def test_zsh_and_fish_scripts_are_generated(shell: str, tmp_path: Path) -> None:
    p = _farm("completion", shell)
    assert p.returncode == 0, p.stderr
    for word in ("submit", "calibrate", "log-level", "generate"):
        assert word in p.stdout, word
    if shutil.which(shell):  # a syntax check where the shell is installed
        script = tmp_path / f"farm.{shell}"
        script.write_text(p.stdout)
        assert subprocess.run([shell, "-n", str(script)], capture_output=True).returncode == 0


def _shell_or_skip(shell: str) -> str:
    found = shutil.which(shell)
    if found is None:
        pytest.skip(f"needs Debian's {shell} (.ci/run installs it)")
    return found


def test_fish_completes_commands_options_and_choices(tmp_path: Path) -> None:
    fish = _shell_or_skip("fish")
    script = tmp_path / "farm.fish"
    script.write_text(_farm("completion", "fish").stdout)

    def complete(line: str) -> list[str]:
        # `complete -C` asks fish's own completion machinery what it would offer after the line
        r = subprocess.run([fish, "--no-config", "-c", f"source {script}; complete -C {line!r}"], capture_output=True,
                           text=True, timeout=60, env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
        assert r.returncode == 0, r.stderr
        return [out.split("\t")[0] for out in r.stdout.splitlines()]

    assert complete("farm models ") == ["generate"]
    assert sorted(complete("farm submit job.yaml --priority ")) == ["interactive", "low", "normal"]
    assert "--limit" in complete("farm jobs --li")
    assert {"submit", "calibrate", "manpage", "completion"} <= set(complete("farm "))


def test_zsh_completes_through_bashcompinit(tmp_path: Path) -> None:
    zsh = _shell_or_skip("zsh")
    script = tmp_path / "farm.zsh"
    script.write_text(_farm("completion", "zsh").stdout)

    def complete(*words: str) -> list[str]:
        # zsh calls the function from bashcompinit's wrapper with ksharrays set; the probe does the same
        probe = (f"autoload -U compinit && compinit -u -d {tmp_path}/zcompdump; source {script}; "
                 "print -r -- ${_comps[farm]}; setopt ksharrays; "
                 f"COMP_WORDS=(farm {' '.join(words)} ''); COMP_CWORD={len(words) + 1}; _farm; "
                 'print -l -- "${COMPREPLY[@]}"')
        r = subprocess.run([zsh, "-f", "-c", probe], capture_output=True, text=True, timeout=60,
                           env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
        assert r.returncode == 0, r.stderr
        registration, *replies = r.stdout.splitlines()
        assert registration == "_bash_complete -o default -F _farm"  # registered with zsh's completion system
        return replies

    assert complete("models") == ["generate", "-h", "--help"]
    assert complete("submit", "job.yaml", "--priority") == ["interactive", "normal", "low"]
    assert {"--limit", "--log-level"} <= set(complete("jobs"))


def _env_reads(tree: ast.AST, constants: dict[str, str]) -> set[str]:
    """Names of environment variables a module reads: os.environ.get/pop/[...], os.getenv, `in os.environ`,
    and client.config's setting(given, key, "FARM_X"); a module-level NAME = "..." constant is followed."""
    def name_of(node: ast.AST | None) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name):
            return constants.get(node.id, f"?{node.id}")
        return None

    def is_environ(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            if (node.func.attr in ("get", "pop") and is_environ(node.func.value)) or node.func.attr == "getenv":
                found.add(name_of(node.args[0]) or "?")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setting":
            found.add(name_of(node.args[2]) or "?")
        if isinstance(node, ast.Subscript) and is_environ(node.value) and isinstance(node.ctx, ast.Load):
            found.add(name_of(node.slice) or "?")
        if isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            found.add(name_of(node.left) or "?")
    return found


def test_every_environment_variable_farm_reads_is_listed() -> None:
    sources = {path: ast.parse(path.read_text()) for folder in PACKAGE_FOLDERS for path in (ROOT / folder).rglob("*.py")
               if "generated" not in path.parts and "board_harness" not in path.parts}  # protoc's; runs on a board
    # module-level NAME = "..." constants of the whole package (DB_ENV is defined in the store, read elsewhere)
    constants = {t.id: n.value.value for tree in sources.values() for n in tree.body if isinstance(n, ast.Assign)
                 and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                 for t in n.targets if isinstance(t, ast.Name)}
    reads: dict[str, list[str]] = {}
    for path, tree in sources.items():
        for name in _env_reads(tree, constants):
            where = str(path.relative_to(ROOT))
            if (where, name) == ("client/config.py", "?env"):  # setting(given, key, env): its callers are read above
                continue
            reads.setdefault(name, []).append(where)
    unnamed = {name: where for name, where in reads.items() if name.startswith("?")}
    assert unnamed == {}, "an environment read this test cannot name"
    assert {"FARM_DB", "FARM_CONTROLLER", "FARM_TOKEN", "FARM_WEBHOOK_URL"} <= set(reads)
    unlisted = {name: where for name, where in reads.items() if name not in ENVIRONMENT}
    assert unlisted == {}, "read but not in cli/environment.py's ENVIRONMENT"
    assert set(ENVIRONMENT) - set(reads) == set(), "listed but never read"

    help_text = _farm("--help").stdout
    readme = (ROOT / "docs" / "reference" / "command-line.md").read_text()
    assert "ENVIRONMENT:" in help_text
    for name in ENVIRONMENT:
        assert name in help_text, name
        assert f"`{name}`" in readme, f"{name} is not in docs/reference/command-line.md's environment list"


def test_a_hostile_choice_or_help_never_becomes_shell_code(tmp_path: Path) -> None:
    from farm.cli.completion import bash_script, fish_script
    p = argparse.ArgumentParser(prog="farm")
    sub = p.add_subparsers(dest="command")
    s = sub.add_parser("go", help="it's `$(touch pwned)`")
    s.add_argument("--mode", choices=["fast", f"$(touch {tmp_path}/pwned)", "a;b"], help="x'; touch pwned; '")
    script = tmp_path / "farm.bash"
    script.write_text(bash_script(p))
    probe = f"source {script}; COMP_WORDS=(farm go --mode ''); COMP_CWORD=3; _farm; printf '%s\\n' \"${{COMPREPLY[@]}}\""
    r = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "pwned").exists()
    assert "$(touch" not in script.read_text() and "a;b" not in script.read_text()
    fish = fish_script(p)
    assert "-d 'x\\'; touch pwned; \\''" in fish  # quoted as one fish string


@pytest.mark.parametrize("flags, level", [(["--log-level", "error"], "ERROR"), (["-v"], "DEBUG"), ([], "WARNING")])
def test_the_log_level_reaches_the_logging_of_a_command(flags: list[str], level: str) -> None:
    code = ("import contextlib, io, logging, sys\nfrom farm.cli.main import main\n"
            f"with contextlib.redirect_stdout(io.StringIO()): main(['schema', *{flags!r}])\n"
            "print(logging.getLevelName(logging.getLogger().level))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == level


@pytest.mark.skipif(shutil.which("groff") is None, reason="needs groff to render the manual page")
def test_the_manual_page_documents_every_command_option_variable_and_exit_code(tmp_path: Path) -> None:
    from farm.client import api
    p = _farm("manpage")
    assert p.returncode == 0, p.stderr
    page = tmp_path / "farm.1"
    page.write_text(p.stdout)
    assert p.stdout.isascii()  # troff reads bytes: anything else is written as a \[uXXXX] escape
    rendered = subprocess.run(["groff", "-man", "-Tutf8", "-ww", "-P-cbou", str(page)], capture_output=True, text=True,
                              timeout=60, env={"LC_ALL": "C.UTF-8", "PATH": "/usr/bin:/bin"})
    assert rendered.returncode == 0 and rendered.stderr == "", rendered.stderr  # -ww: every warning shown
    text = rendered.stdout
    for path, parser in _commands().items():
        if path and not any(isinstance(a, argparse._SubParsersAction) for a in parser._actions):
            assert f"farm {path}" in text, path
            for action in parser._actions:
                for option in [] if isinstance(action, argparse._HelpAction) else action.option_strings:
                    assert option in text, (path, option)
    for name in ENVIRONMENT:
        assert name in text
    codes = {api.EXIT_OK, api.EXIT_RUNS_FAILED, api.EXIT_BAD_INPUT, api.EXIT_ENVIRONMENT, api.EXIT_INTERRUPTED}
    exit_section = text[text.index("EXIT STATUS"):text.index("FILES")]
    assert {int(line.split()[0]) for line in exit_section.splitlines() if line.strip()[:1].isdigit()} == codes
    assert "≈" in text  # the calibrate help's "device ≈ a·sim + b" survives as the character it was


def test_help_text_never_becomes_a_roff_request(tmp_path: Path) -> None:
    from farm.cli.manpage import manpage
    p = argparse.ArgumentParser(prog="farm", description="x")
    sub = p.add_subparsers(dest="command")
    s = sub.add_parser("go", help=".so /etc/passwd")
    s.add_argument("--mode", help="'bp\n.sy touch pwned\n\\fBloud")
    roff = manpage(p, "0")
    lines = roff.splitlines()
    assert ".so /etc/passwd" not in lines and ".sy touch pwned" not in lines and "'bp" not in lines
    assert "\\&.so /etc/passwd" in lines and "\\efBloud" in lines
    if shutil.which("groff"):
        out = subprocess.run(["groff", "-man", "-Tutf8", "-ww", "-P-cbou"], input=roff, capture_output=True, text=True,
                             timeout=60, cwd=tmp_path).stdout
        assert ".so /etc/passwd" in out and "\\fBloud" in out and not (tmp_path / "pwned").exists()
