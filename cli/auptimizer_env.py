"""Auptimizer profiler env files (env.template) read without running them, and mapped to a farm job.

Auptimizer `source`d the file in bash; farm reads it as data: `[export] NAME=VALUE` lines with
shell quoting ('...', "...", backslashes), comments, and $NAME / ${NAME} expansion. Anything a
shell would have to run (command substitution, pipes, a second word) is refused with its file
and line, never executed.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from farm.proto.spec import SimBuild, parse_memory

MAX_ENV_BYTES = 1 << 20
MAX_LIST_BYTES = 1 << 20
MAX_MODELS = 10_000
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# A character that would make a shell do something other than assign (a pipe, a redirect, a subshell).
_SHELL_ACTIONS = set("|&;<>()`")

KNOWN = ("IMAGEREPO", "APTREQUIREMENTS", "PIPREQUIREMENTS", "PRERUN", "DIR", "SCRIPT", "COMMAND",
         "SAMPLETIME", "OUTPUTFILE", "DOCFILE", "DOCKCPUS", "DOCKMEMORY", "DOCK_ARGS")
# Auptimizer's code read DOCKER_ARGS where its docs say DOCK_ARGS: farm takes either.
ALIASES = {"DOCKER_ARGS": "DOCK_ARGS"}


class EnvFileError(Exception):
    """The env file (or a file it names) cannot be converted; problems are file:line: variable: message."""

    def __init__(self, problems: list["Problem"]) -> None:
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


@dataclass
class Problem:
    file: str
    line: int | None
    variable: str
    message: str

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        return ": ".join(p for p in (where, self.variable, self.message) if p)

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "line": self.line, "field": self.variable or None, "message": self.message}


@dataclass
class Assignment:
    name: str
    value: str
    line: int


@dataclass
class EnvFile:
    path: Path
    values: dict[str, Assignment] = field(default_factory=dict)
    notes: list[Problem] = field(default_factory=list)  # what was read but changes meaning or is dropped


def read_bounded(path: Path, limit: int, what: str) -> str:
    """A small text file, or an EnvFileError naming it: missing, a folder, too big, binary, not UTF-8."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except FileNotFoundError:
        raise EnvFileError([Problem(str(path), None, "", f"no such {what}.")]) from None
    except IsADirectoryError:
        raise EnvFileError([Problem(str(path), None, "", f"is a folder; give the {what} itself.")]) from None
    except OSError as e:
        raise EnvFileError([Problem(str(path), None, "", f"cannot read the {what}: {e.strerror}.")]) from None
    if len(data) > limit:
        raise EnvFileError([Problem(str(path), None, "", f"is over {limit >> 20} MiB; an {what} is a few lines of text.")])
    if b"\0" in data:
        line = data[: data.index(b"\0")].count(b"\n") + 1
        raise EnvFileError([Problem(str(path), line, "", f"holds a NUL byte: this is not a text {what}.")])
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise EnvFileError([Problem(str(path), line, "", f"is not UTF-8 text (byte {e.start}).")]) from None


class _Scanner:
    """Reads the file's assignments one character at a time, the way a POSIX shell splits them."""

    def __init__(self, text: str, source: str, environ: dict[str, str]) -> None:
        self.text, self.source, self.environ = text, source, environ
        self.pos, self.line = 0, 1
        self.values: dict[str, Assignment] = {}
        self.notes: list[Problem] = []

    def error(self, message: str, variable: str = "", line: int | None = None) -> EnvFileError:
        return EnvFileError([Problem(self.source, line or self.line, variable, message)])

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def take(self) -> str:
        char = self.peek()
        self.pos += 1
        if char == "\n":
            self.line += 1
        return char

    def skip_comment(self) -> None:
        while self.peek() not in ("", "\n"):
            self.take()

    def run(self) -> None:
        while self.pos < len(self.text):
            char = self.peek()
            if char in " \t\r\n;":
                self.take()
            elif char == "#":
                self.skip_comment()
            else:
                self.assignment()

    def assignment(self) -> None:
        start = self.line
        match = _NAME_RE.match(self.text, self.pos)
        if match and match.group() == "export" and self.text[match.end():match.end() + 1] in (" ", "\t"):
            self.pos = match.end()
            while self.peek() in (" ", "\t"):
                self.take()
            match = _NAME_RE.match(self.text, self.pos)
        if not match or self.text[match.end():match.end() + 1] != "=":
            word = self.text[self.pos:].split(None, 1)[0][:40] if self.text[self.pos:].strip() else ""
            raise self.error(f"{word!r} is not an assignment; an env file holds NAME=VALUE lines (farm reads it, "
                             "it does not run it as a script).")
        name = match.group()
        self.pos = match.end() + 1
        value = self.word(name)
        while self.peek() in (" ", "\t"):
            self.take()
        if self.peek() == "#":
            self.skip_comment()
        elif self.peek() not in ("", "\n", "\r", ";"):
            raise self.error(f"a space ends the value and more follows ({self.text[self.pos:self.pos + 30]!r}); "
                             "quote the whole value (in a shell, A=b c runs the command c).", name)
        if name in self.values:
            self.notes.append(Problem(self.source, start, name, f"set again (first on line {self.values[name].line}); "
                                      "the last value is used, as in a shell."))
        self.values[name] = Assignment(name, value, start)

    def word(self, name: str) -> str:
        out: list[str] = []
        while True:
            char = self.peek()
            if char in ("", " ", "\t", "\n", "\r"):
                return "".join(out)
            if char == "'":
                opened = self.line
                self.take()
                end = self.text.find("'", self.pos)
                if end < 0:
                    raise self.error("a single quote is never closed.", name, opened)
                while self.pos < end:
                    out.append(self.take())
                self.take()
            elif char == '"':
                out.append(self.double_quoted(name))
            elif char == "\\":
                self.take()
                escaped = self.take()
                if escaped != "\n":  # backslash-newline continues the line
                    out.append(escaped)
            elif char == "$":
                out.append(self.expansion(name))
            elif char in _SHELL_ACTIONS:
                if char == "`":
                    raise self.error("command substitution (`...`) is not run by farm; write the value itself.", name)
                if char == ";":
                    return "".join(out)
                raise self.error(f"an unquoted {char!r} would make a shell run something; quote the value.", name)
            else:
                out.append(self.take())

    def double_quoted(self, name: str) -> str:
        opened = self.line
        self.take()
        out: list[str] = []
        while True:
            char = self.peek()
            if char == "":
                raise self.error("a double quote is never closed.", name, opened)
            if char == '"':
                self.take()
                return "".join(out)
            if char == "\\":
                self.take()
                nxt = self.take()
                if nxt in ('"', "\\", "$", "`"):
                    out.append(nxt)
                elif nxt != "\n":
                    out += ["\\", nxt]
            elif char == "$":
                out.append(self.expansion(name))
            elif char == "`":
                raise self.error("command substitution (`...`) is not run by farm; write the value itself.", name)
            else:
                out.append(self.take())

    def expansion(self, name: str) -> str:
        self.take()  # $
        if self.peek() == "(":
            raise self.error("command substitution $(...) is not run by farm; write the value itself.", name)
        if self.peek() == "{":
            end = self.text.find("}", self.pos)
            inner = self.text[self.pos + 1:end] if end > 0 else ""
            if end < 0 or not _NAME_RE.fullmatch(inner):
                raise self.error("only $NAME and ${NAME} are expanded (no defaults, no substrings); write the value.", name)
            self.pos = end + 1
            other = inner
        else:
            match = _NAME_RE.match(self.text, self.pos)
            if not match:
                return "$"  # a lone $ is literal in a shell too
            self.pos = match.end()
            other = match.group()
        if other in self.values:
            return self.values[other].value
        if other in self.environ:
            self.notes.append(Problem(self.source, self.line, name, f"${other} is not set in the file; taken from your "
                                      f"environment ({self.environ[other][:80]!r}), as a shell would."))
            return self.environ[other]
        raise self.error(f"${other} is set neither earlier in the file nor in your environment; write the value.", name)


def parse_env(path: Path, environ: dict[str, str] | None = None) -> EnvFile:
    """The assignments of an env file, or EnvFileError at the first thing a shell would not simply assign."""
    text = read_bounded(path, MAX_ENV_BYTES, "env file")
    scanner = _Scanner(text, str(path), dict(os.environ) if environ is None else environ)
    scanner.run()
    return EnvFile(path, scanner.values, scanner.notes)


def read_model_list(path: Path) -> list[tuple[str, int]]:
    """-f models.txt: one model a line (blank lines and # comments skipped), with its line number."""
    text = read_bounded(path, MAX_LIST_BYTES, "model list")
    models = [(line.strip(), number) for number, line in enumerate(text.splitlines(), start=1)
              if line.strip() and not line.strip().startswith("#")]
    if len(models) > MAX_MODELS:
        raise EnvFileError([Problem(str(path), None, "", f"lists {len(models):,} models, over {MAX_MODELS:,}; split it.")])
    return models


# --------------------------------------------------------------------------------------------
# mapping to a farm job


@dataclass
class Conversion:
    job: dict[str, Any]
    notes: list[Problem]


def _relative(path: Path, out_dir: Path) -> str:
    return os.path.relpath(path, out_dir)


def _literal_braces(text: str) -> str:
    """A script argument kept as written: farm fills {model}-style placeholders, so braces are doubled."""
    return text.replace("{", "{{").replace("}", "}}")


def _package_list(env: EnvFile, variable: str, search: list[Path]) -> tuple[list[str], list[Problem]]:
    """APTREQUIREMENTS / PIPREQUIREMENTS: a requirements file (one a line) or the packages themselves."""
    item = env.values[variable]
    words = item.value.replace(",", " ").split()
    notes: list[Problem] = []
    if len(words) == 1 and (words[0].endswith(".txt") or "/" in words[0]):
        found = next((d / words[0] for d in search if (d / words[0]).is_file()), None)
        if found is None:
            raise EnvFileError([Problem(str(env.path), item.line, variable, f"{words[0]!r} looks like a requirements "
                                        f"file but is not in {', '.join(str(d) for d in search)}.")])
        lines = [line.split("#", 1)[0].strip() for line in read_bounded(found, MAX_LIST_BYTES, "requirements file").splitlines()]
        words = []
        for line in filter(None, lines):
            if line.startswith("-"):
                notes.append(Problem(str(env.path), item.line, variable, f"{found.name}: the pip option {line!r} is "
                                     "not carried; farm installs named packages (give wheels with sim.build.pip_wheels "
                                     "to install offline)."))
            else:
                words.append(line)
    return words, notes


def _dock_args(env: EnvFile, sim: dict[str, Any], notes: list[Problem]) -> None:
    """The docker-run options farm has a field for; every other one is named in a note."""
    item = env.values["DOCK_ARGS"]
    try:
        tokens = shlex.split(item.value)
    except ValueError as e:
        raise EnvFileError([Problem(str(env.path), item.line, item.name, f"cannot split the options: {e}.")]) from None
    fields = {"--cpus": "cpus", "--cpuset-cpus": "cpuset", "--memory": "memory", "-m": "memory"}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        option, has_value, value = token.partition("=")
        if option in fields and not has_value and i + 1 < len(tokens):
            value, i = tokens[i + 1], i + 1
        i += 1
        key = fields.get(option)
        if key is None:
            reason = ("farm turns swap off (the limit is the memory)" if option == "--memory-swap"
                      else "farm sets the container's other options itself (no network, its own mounts and user)")
            notes.append(Problem(str(env.path), item.line, item.name, f"{token!r} is not carried: {reason}."))
        elif key in sim:
            notes.append(Problem(str(env.path), item.line, item.name, f"{token!r} is not carried: "
                                 f"{'DOCKCPUS' if key == 'cpus' else 'DOCKMEMORY' if key == 'memory' else 'an earlier option'} "
                                 "already sets it."))
        else:
            sim[key] = value
            notes.append(Problem(str(env.path), item.line, item.name, f"{token!r} becomes sim.{key}."))


def _memory(value: str) -> str:
    """Docker's memory size (a bare number is bytes there) in farm's spelling, which wants a unit."""
    text = value.strip().lower()
    return f"{text}b" if text.isdigit() else text


def convert(env: EnvFile, models: list[Path], out_path: Path, *, keep_image: bool = False,
            pip_wheels: str | None = None) -> Conversion:
    """The job a converted env file becomes, and a note for each variable that changes meaning or is dropped."""
    source = str(env.path)
    notes = list(env.notes)
    out_dir = out_path.parent
    env_dir = env.path.parent.resolve()
    for name in list(env.values):
        if name in ALIASES:
            canonical = ALIASES[name]
            if canonical in env.values:
                notes.append(Problem(source, env.values[name].line, name, f"not carried: {canonical} is set too and wins."))
            else:
                env.values[canonical] = env.values[name]
                notes.append(Problem(source, env.values[name].line, name, f"read as {canonical} (Auptimizer's code "
                                     f"read {name}, its documentation says {canonical})."))
        elif name not in KNOWN:
            notes.append(Problem(source, env.values[name].line, name, "not an Auptimizer profiler variable; ignored."))

    def value(name: str) -> str | None:
        item = env.values.get(name)
        return item.value if item is not None and item.value.strip() else None

    def fail(name: str, message: str) -> EnvFileError:
        item = env.values.get(name)
        return EnvFileError([Problem(source, item.line if item else None, name, message)])

    # DIR: the folder that goes into the container; Auptimizer ran from the env file's folder
    if value("DIR"):
        script_dir = (env_dir / os.path.expanduser(value("DIR") or "")).resolve()
        if not script_dir.is_dir():
            raise fail("DIR", f"{value('DIR')!r} is not a folder (looked for {script_dir}).")
    else:
        script_dir = env_dir
        notes.append(Problem(source, None, "DIR", f"not set: the env file's folder {env_dir} is the script's folder."))
    script = value("SCRIPT")
    if script is not None:
        script_path = (script_dir / script).resolve()
        if not script_path.is_relative_to(script_dir):
            raise fail("SCRIPT", f"{script!r} is outside DIR ({script_dir}); farm sends DIR only.")
        if not script_path.is_file():
            raise fail("SCRIPT", f"{script!r} is not a file in DIR (looked for {script_path}).")
    command_text = value("COMMAND")
    if command_text is None:
        if script is None:
            raise fail("COMMAND", "neither COMMAND nor SCRIPT is set: there is nothing to run.")
        guess = "bash" if script.endswith(".sh") else "python"
        notes.append(Problem(source, None, "COMMAND", f"not set: {guess} runs {script}."))
        command_text = guess
    try:
        tokens = shlex.split(command_text)
    except ValueError as e:
        raise fail("COMMAND", f"cannot split the command line: {e}.") from None
    if not tokens:
        raise fail("COMMAND", "is empty.")
    workload: dict[str, Any] = {"type": "script", "command": tokens[0]}
    rest = [_literal_braces(t) for t in tokens[1:]]
    if script is not None and tokens[1:2] == [script]:
        workload["script"], args = script, rest[1:]
    elif script is not None and script in tokens[1:]:
        args = rest
    elif script is not None and not rest:
        workload["script"], args = script, []
    else:
        args = rest + ([_literal_braces(script)] if script else [])
    if models:
        args.append("{model}")
        notes.append(Problem(source, None, "COMMAND", "each model file is passed as the command's last argument "
                                                      "({model}), one run per model."))
    workload["args"] = args
    workload["dir"] = _relative(script_dir, out_dir)

    sim: dict[str, Any] = {"backend": "docker"}
    if value("DOCKCPUS"):
        try:
            cpus = float(value("DOCKCPUS") or "")
        except ValueError:
            raise fail("DOCKCPUS", f"{value('DOCKCPUS')!r} is not a number of CPUs (like 1 or 0.5).") from None
        if not 0 < cpus < 4096:
            raise fail("DOCKCPUS", f"{value('DOCKCPUS')!r} must be above 0.")
        sim["cpus"] = cpus
    if value("DOCKMEMORY"):
        try:
            parse_memory(_memory(value("DOCKMEMORY") or ""))
        except ValueError as e:
            raise fail("DOCKMEMORY", str(e)) from None
        sim["memory"] = _memory(value("DOCKMEMORY") or "")
    if value("DOCK_ARGS"):
        _dock_args(env, sim, notes)
        if "memory" in sim:
            try:
                parse_memory(_memory(str(sim["memory"])))
            except ValueError as e:
                raise fail("DOCK_ARGS", f"--memory: {e}") from None
            sim["memory"] = _memory(str(sim["memory"]))
        if "cpus" in sim:
            try:
                sim["cpus"] = float(sim["cpus"])
            except ValueError:
                raise fail("DOCK_ARGS", f"--cpus {sim['cpus']!r} is not a number.") from None

    build: dict[str, Any] = {}
    search = [script_dir, env_dir]
    if value("DOCFILE"):
        dockerfile = (env_dir / (value("DOCFILE") or "")).resolve()
        if not dockerfile.is_file():
            raise fail("DOCFILE", f"{value('DOCFILE')!r} is not a file (looked for {dockerfile}).")
        if not dockerfile.is_relative_to(script_dir):
            raise fail("DOCFILE", f"{dockerfile} is outside DIR ({script_dir}); the build's context is DIR, so "
                                  "move the Dockerfile into it.")
        build["dockerfile"] = dockerfile.relative_to(script_dir).as_posix()
        for name in ("IMAGEREPO", "APTREQUIREMENTS", "PIPREQUIREMENTS", "PRERUN"):
            if value(name):
                notes.append(Problem(source, env.values[name].line, name, "not carried: DOCFILE is set, and its "
                                     "Dockerfile builds the image (write this step there)."))
    else:
        if value("APTREQUIREMENTS"):
            build["apt"], more = _package_list(env, "APTREQUIREMENTS", search)
            notes += more
            notes.append(Problem(source, env.values["APTREQUIREMENTS"].line, "APTREQUIREMENTS",
                                 "packages are unpacked into /opt/farm-build/apt (the run's /usr is the agent's own); "
                                 "list the libraries they depend on too, and the agent needs the network to fetch them."))
        if value("PIPREQUIREMENTS"):
            build["pip"], more = _package_list(env, "PIPREQUIREMENTS", search)
            notes += more
            if pip_wheels is not None:
                wheels = (script_dir / pip_wheels).resolve()
                if not wheels.is_dir() or not wheels.is_relative_to(script_dir):
                    raise fail("PIPREQUIREMENTS", f"--pip-wheels {pip_wheels!r} is not a folder inside DIR ({script_dir}).")
                build["pip_wheels"] = wheels.relative_to(script_dir).as_posix()
        if value("PRERUN"):
            build["run"] = [value("PRERUN")]
            notes.append(Problem(source, env.values["PRERUN"].line, "PRERUN", "runs once when the image is built, "
                                 "in DIR, not before every run; what it writes outside /usr is in the image."))
        if value("IMAGEREPO"):
            line = env.values["IMAGEREPO"].line
            if keep_image:
                build["base"] = value("IMAGEREPO")
                notes.append(Problem(source, line, "IMAGEREPO", "the build starts from it; it must be on the agent's "
                                     "Docker engine (farm never pulls), and its /usr is covered by the agent's own."))
            else:
                notes.append(Problem(source, line, "IMAGEREPO", "not carried: farm runs the script with the agent's own "
                                     "Python and libraries (its /usr, mounted read-only), so the image's would be "
                                     "hidden; packages go in PIPREQUIREMENTS/APTREQUIREMENTS (--keep-image starts "
                                     "the build from it anyway)."))
    if build:
        try:  # checked here, so a bad package names its variable and line, not the job file's
            SimBuild.model_validate(build)
        except ValidationError as e:
            first = e.errors(include_url=False)[0]
            variable = {"apt": "APTREQUIREMENTS", "pip": "PIPREQUIREMENTS", "run": "PRERUN"}.get(
                str(first["loc"][0]) if first["loc"] else "", "DOCFILE")
            raise fail(variable, str(first["msg"]).removeprefix("Value error, ")) from None
        sim["build"] = build
    if value("SAMPLETIME"):
        notes.append(Problem(source, env.values["SAMPLETIME"].line, "SAMPLETIME", f"not carried: farm samples every "
                             f"50 ms and reads the kernel's own peak; sampling every {value('SAMPLETIME')} s would only "
                             "miss short peaks (sim.sample_interval_ms changes it)."))
    if value("OUTPUTFILE"):
        notes.append(Problem(source, env.values["OUTPUTFILE"].line, "OUTPUTFILE", "not carried: results go to farm's "
                             f"store; `farm results JOB --format csv > {value('OUTPUTFILE')}` writes them out."))

    if models:
        model_paths = [_relative(m, out_dir) for m in models]
    elif script is not None:
        model_paths = [_relative(script_dir / script, out_dir)]
        notes.append(Problem(source, None, "models", f"no -m or -f: the script {script} stands as the job's one model "
                                                     "(farm runs a workload once per model file)."))
    else:
        raise EnvFileError([Problem(source, None, "models", "no -m or -f and no SCRIPT: the job needs a model file "
                                                            "to run for; give -m a.tflite,b.tflite.")])
    job = {"name": env.path.stem, "models": model_paths, "workload": workload, "sim": sim}
    return Conversion(job, sorted(notes, key=lambda n: n.line or 0))
