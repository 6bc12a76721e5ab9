"""Auptimizer profiler env files (env.template) read without running them, and mapped to a farm job.

Auptimizer `source`d the file in bash; farm reads it as data: `[export] NAME=VALUE` lines with
shell quoting ('...', "...", backslashes), comments, and $NAME / ${NAME} expansion from the file's
own earlier lines (never from the importer's environment). Anything a
shell would have to run (command substitution, pipes, a second word) is refused with its file
and line, never executed.
"""

from __future__ import annotations

import os
import re
import shlex
import stat
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import JsonValue, ValidationError

from farm.proto.spec import SimBuild, parse_memory

MAX_ENV_BYTES = 1 << 20
MAX_LIST_BYTES = 1 << 20
MAX_MODELS = 10_000
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_IMAGE_RE = re.compile(r"[a-z0-9][a-z0-9._/-]{0,199}(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?")
# A character that would make a shell do something other than assign (a pipe, a redirect, a subshell).
_SHELL_ACTIONS = set("|&;<>()`")

KNOWN = ("IMAGEREPO", "APTREQUIREMENTS", "PIPREQUIREMENTS", "PRERUN", "DIR", "SCRIPT", "COMMAND",
         "SAMPLETIME", "OUTPUTFILE", "DOCFILE", "DOCKCPUS", "DOCKMEMORY", "DOCK_ARGS")
# Auptimizer's code read DOCKER_ARGS where its docs say DOCK_ARGS: farm takes either.
ALIASES = {"DOCKER_ARGS": "DOCK_ARGS"}


class EnvFileError(Exception):
    """The env file (or a file it names) cannot be converted; problems are file:line: variable: message."""

    def __init__(self, problems: list["EnvProblem"]) -> None:
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


@dataclass
class EnvProblem:
    file: str
    line: int | None
    variable: str
    message: str

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        return ": ".join(p for p in (where, self.variable, self.message) if p)

    def to_json(self) -> dict[str, str | int | None]:
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
    notes: list[EnvProblem] = field(default_factory=list)  # what was read but changes meaning or is dropped


def read_bounded(path: Path, limit: int, what: str) -> str:
    """A small text file, or an EnvFileError naming it: missing, a folder, too big, binary, not UTF-8."""
    try:
        if path.exists() and not path.is_dir() and not stat.S_ISREG(path.stat().st_mode):
            raise EnvFileError([EnvProblem(str(path), None, "", f"is not a regular file (a FIFO or device would block "
                                        f"or never end); give the {what} itself.")])
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except FileNotFoundError:
        raise EnvFileError([EnvProblem(str(path), None, "", f"no such {what}.")]) from None
    except IsADirectoryError:
        raise EnvFileError([EnvProblem(str(path), None, "", f"is a folder; give the {what} itself.")]) from None
    except OSError as e:
        raise EnvFileError([EnvProblem(str(path), None, "", f"cannot read the {what}: {e.strerror}.")]) from None
    if len(data) > limit:
        raise EnvFileError([EnvProblem(str(path), None, "", f"is over {limit >> 20} MiB; an {what} is a few lines of text.")])
    if b"\0" in data:
        line = data[: data.index(b"\0")].count(b"\n") + 1
        raise EnvFileError([EnvProblem(str(path), line, "", f"holds a NUL byte: this is not a text {what}.")])
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise EnvFileError([EnvProblem(str(path), line, "", f"is not UTF-8 text (byte {e.start}).")]) from None


class _Scanner:
    """Reads the file's assignments one character at a time, the way a POSIX shell splits them."""

    def __init__(self, text: str, source: str) -> None:
        self.text, self.source = text, source
        self.pos, self.line = 0, 1
        self.values: dict[str, Assignment] = {}
        self.notes: list[EnvProblem] = []

    def error(self, message: str, variable: str = "", line: int | None = None) -> EnvFileError:
        return EnvFileError([EnvProblem(self.source, line or self.line, variable, message)])

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
            self.notes.append(EnvProblem(self.source, start, name, f"set again (first on line {self.values[name].line}); "
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
        # Never the importer's own environment: a hostile file could copy a secret (${FARM_TOKEN}) into the job
        # or a note. Kept as written, and the note never shows a value.
        self.notes.append(EnvProblem(self.source, self.line, name, f"${{{other}}} is not set earlier in the file; kept "
                                  "as written (farm never reads your environment into a job); write the value."))
        return "${" + other + "}"


def parse_env(path: Path) -> EnvFile:
    """The assignments of an env file, or EnvFileError at the first thing a shell would not simply assign."""
    text = read_bounded(path, MAX_ENV_BYTES, "env file")
    scanner = _Scanner(text, str(path))
    scanner.run()
    return EnvFile(path, scanner.values, scanner.notes)


def read_model_list(path: Path) -> list[tuple[str, int]]:
    """-f models.txt: one model a line (blank lines and # comments skipped), with its line number."""
    text = read_bounded(path, MAX_LIST_BYTES, "model list")
    models = [(line.strip(), number) for number, line in enumerate(text.splitlines(), start=1)
              if line.strip() and not line.strip().startswith("#")]
    if len(models) > MAX_MODELS:
        raise EnvFileError([EnvProblem(str(path), None, "", f"lists {len(models):,} models, over {MAX_MODELS:,}; split it.")])
    return models


# --------------------------------------------------------------------------------------------
# mapping to a farm job


@dataclass
class ScriptPart:
    """The job's script workload as the converter writes it (workload.type script)."""

    command: str
    args: list[str] = field(default_factory=list)
    dir: str = "."
    script: str | None = None

    def document(self) -> dict[str, JsonValue]:
        return {"type": "script", "command": self.command, **({"script": self.script} if self.script is not None else {}),
                "args": list(self.args), "dir": self.dir}


@dataclass
class BuildPart:
    """sim.build as the converter writes it: a Dockerfile, or the steps farm runs (and their base)."""

    dockerfile: str | None = None
    apt: list[str] | None = None
    pip: list[str] | None = None
    pip_wheels: str | None = None
    run: list[str] | None = None
    base: str | None = None

    def document(self) -> dict[str, JsonValue]:
        """The fields given, in the order the job file has them (farm's own spelling: the memory sizes as written)."""
        texts = {"dockerfile": self.dockerfile, "pip_wheels": self.pip_wheels, "base": self.base}
        lists = {"apt": self.apt, "pip": self.pip, "run": self.run}
        document: dict[str, JsonValue] = {}
        for name in ("dockerfile", "apt", "pip", "pip_wheels", "run", "base"):
            text, values = texts.get(name), lists.get(name)
            if text is not None:
                document[name] = text
            elif values is not None:
                document[name] = list[JsonValue](values)
        return document


@dataclass
class SimPart:
    """The job's sim section as the converter writes it: the docker backend and the budget, in the order the env
    file gave its parts (DOCKCPUS, DOCKMEMORY, then DOCK_ARGS' options as written), the image, the build."""

    cpus: float | str | None = None  # DOCK_ARGS' --cpus as written until it is read as a number
    cpuset: str | None = None
    memory: str | None = None
    image: str | None = None
    build: BuildPart | None = None
    order: list[str] = field(default_factory=list)  # the budget fields, as they were set

    def given(self, name: str) -> bool:
        return name in self.order

    def set(self, name: str, value: str | float) -> None:
        """One budget field (cpus, cpuset, memory), set once: the first part of the env file that gives it wins."""
        setattr(self, name, value)
        if name not in self.order:
            self.order.append(name)

    def document(self) -> dict[str, JsonValue]:
        budget: dict[str, JsonValue] = {"cpus": self.cpus, "cpuset": self.cpuset, "memory": self.memory}
        return {"backend": "docker", **{name: budget[name] for name in self.order},
                **({"image": self.image} if self.image is not None else {}),
                **({"build": self.build.document()} if self.build is not None else {})}


@dataclass
class Conversion:
    name: str
    models: list[str]
    workload: ScriptPart
    sim: SimPart
    notes: list[EnvProblem]

    @property
    def job(self) -> dict[str, JsonValue]:
        """The job file's document, its keys in the order a person reads them."""
        return {"name": self.name, "models": list(self.models), "workload": self.workload.document(),
                "sim": self.sim.document()}


def _relative(path: Path, out_dir: Path) -> str:
    return os.path.relpath(path, out_dir)


def _literal_braces(text: str) -> str:
    """A script argument kept as written: farm fills {model}-style placeholders, so braces are doubled."""
    return text.replace("{", "{{").replace("}", "}}")


def _package_list(env: EnvFile, variable: str, search: list[Path], root: Path) -> tuple[list[str], list[EnvProblem]]:
    """APTREQUIREMENTS / PIPREQUIREMENTS: the packages themselves, or a requirements file (`-r file` as the
    profiler's `pip install $PIPREQUIREMENTS` took it, or a lone file name). A file is read only when it
    is a regular file under the env file's folder (root): a hostile env file cannot copy /etc/shadow in."""
    item = env.values[variable]
    words = item.value.replace(",", " ").split()
    notes: list[EnvProblem] = []
    named = words[1] if len(words) == 2 and words[0] in ("-r", "--requirement") else (
        words[0] if len(words) == 1 and (words[0].endswith(".txt") or "/" in words[0]) else None)
    if named is not None:
        if named.startswith("~"):
            raise EnvFileError([EnvProblem(str(env.path), item.line, variable, f"{named!r} is outside the env file's "
                                        f"folder {root}; farm reads no file outside it.")])
        candidates = [(d / named).resolve() for d in search]
        outside = [c for c in candidates if not c.is_relative_to(root)]
        if outside:
            raise EnvFileError([EnvProblem(str(env.path), item.line, variable, f"{named!r} is {outside[0]}, outside the "
                                        f"env file's folder {root}; farm reads no file outside it (put the "
                                        "requirements file beside the env file or in DIR).")])
        found = next((c for c in candidates if c.exists() and not c.is_dir()), None)  # a FIFO: read_bounded says so
        if found is None:
            raise EnvFileError([EnvProblem(str(env.path), item.line, variable, f"{named!r} looks like a requirements "
                                        f"file but is not in {', '.join(dict.fromkeys(str(d) for d in search))}.")])
        lines = [line.split("#", 1)[0].strip() for line in read_bounded(found, MAX_LIST_BYTES, "requirements file").splitlines()]
        words = []
        for line in filter(None, lines):
            if line.startswith("-"):
                notes.append(EnvProblem(str(env.path), item.line, variable, f"{found.name}: the pip option {line!r} is "
                                     "not carried; farm installs named packages (give wheels with sim.build.pip_wheels "
                                     "to install offline)."))
            else:
                words.append(line)
    return words, notes


def _dock_args(env: EnvFile, sim: SimPart, notes: list[EnvProblem]) -> list[tuple[str, str]]:
    """The docker-run options farm has a field for; every other one is named in a note. Returns the dropped
    mounts as (what was written, the path inside the container)."""
    item = env.values["DOCK_ARGS"]
    try:
        tokens = shlex.split(item.value)
    except ValueError as e:
        raise EnvFileError([EnvProblem(str(env.path), item.line, item.name, f"cannot split the options: {e}.")]) from None
    fields = {"--cpus": "cpus", "--cpuset-cpus": "cpuset", "--memory": "memory", "-m": "memory"}
    takes_value = {*fields, "-v", "--volume", "--mount"}
    mounts: list[tuple[str, str]] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        option, has_value, value = token.partition("=")
        if option in takes_value and not has_value and i + 1 < len(tokens):
            value, i = tokens[i + 1], i + 1
        i += 1
        key = fields.get(option)
        if option in ("-v", "--volume", "--mount") and not has_value and value:
            token = f"{option} {value}"
        if option in ("-v", "--volume") and value:
            parts = value.split(":")
            if len(parts) >= 2 and parts[1].startswith("/"):
                mounts.append((token, parts[1]))
        elif option == "--mount" and value:
            fields_of = dict(f.split("=", 1) for f in value.split(",") if "=" in f)
            target = fields_of.get("target") or fields_of.get("destination") or fields_of.get("dst") or ""
            if target.startswith("/"):
                mounts.append((token, target))
        if key is None:
            reason = ("farm turns swap off (the limit is the memory)" if option == "--memory-swap"
                      else "farm sets the container's other options itself (no network, its own mounts and user)")
            notes.append(EnvProblem(str(env.path), item.line, item.name, f"{token!r} is not carried: {reason}."))
        elif sim.given(key):
            notes.append(EnvProblem(str(env.path), item.line, item.name, f"{token!r} is not carried: "
                                 f"{'DOCKCPUS' if key == 'cpus' else 'DOCKMEMORY' if key == 'memory' else 'an earlier option'} "
                                 "already sets it."))
        else:
            sim.set(key, value)
            notes.append(EnvProblem(str(env.path), item.line, item.name, f"{token!r} becomes sim.{key}."))
    return mounts


def _given_dockerfile(env: EnvFile, env_dir: Path, source: str, notes: list[EnvProblem]) -> Path | None:
    """DOCFILE when the file is there (the profiler's cwd, the env file's folder, is where it looked). When it
    is missing the profiler wrote it itself from IMAGEREPO and the requirement lines: farm builds those steps."""
    item = env.values.get("DOCFILE")
    if item is None or not item.value.strip():
        return None
    if item.value.startswith("~"):
        raise EnvFileError([EnvProblem(source, item.line, "DOCFILE", f"{item.value!r} is outside the env file's folder "
                                    f"{env_dir}; the build's context is that folder.")])
    path = (env_dir / item.value).resolve()
    if not path.is_relative_to(env_dir):
        raise EnvFileError([EnvProblem(source, item.line, "DOCFILE", f"{item.value!r} is {path}, outside the env file's "
                                    f"folder {env_dir}; the build's context is that folder, so move the Dockerfile "
                                    "into it.")])
    if path.is_file():
        return path
    if path.exists():
        raise EnvFileError([EnvProblem(source, item.line, "DOCFILE", f"{item.value!r} is not a file ({path}).")])
    notes.append(EnvProblem(source, item.line, "DOCFILE", f"{item.value!r} does not exist: Auptimizer's profiler writes "
                         "it then (FROM $IMAGEREPO, the APTREQUIREMENTS, PRERUN and PIPREQUIREMENTS lines), and farm "
                         "builds the same steps from those variables."))
    return None


def _from_dropped_mount(env: EnvFile, workload: ScriptPart, mounts: list[tuple[str, str]],
                        notes: list[EnvProblem]) -> None:
    """An interpreter that existed only through a `-v` mount farm does not carry would fail every run: a Python
    one becomes the image's `python`, anything else is kept; either way a note names the mount and the fix."""
    command = workload.command
    for written, inside in mounts:
        if not Path(command).is_relative_to(inside):
            continue
        item = env.values.get("COMMAND")
        line = item.line if item is not None else None
        if Path(command).name.startswith("python"):
            workload.command = "python"
            fix = ("farm runs `python` instead (the image's own with sim.image, else the agent's); install what "
                   "that environment held with PIPREQUIREMENTS or build it into the image (sim.image)")
        else:
            fix = "put the program into the image (a Dockerfile or sim.image) and name it there, or every run fails"
        notes.append(EnvProblem(str(env.path), line, "COMMAND", f"{command} existed only through the mount {written!r}, "
                             f"which farm does not carry (runs see no host folders): {fix}."))
        return


def _memory(value: str) -> str:
    """Docker's memory size (a bare number is bytes there) in farm's spelling, which wants a unit."""
    text = value.strip().lower()
    return f"{text}b" if text.isdigit() else text


def _resolve_models(named: list[ModelName], script_dir: Path, notes: list[EnvProblem]) -> list[Path]:
    """-m/-f names as the profiler passed them to the script running in DIR: a relative name is a file
    inside DIR; one that is not there but is beside the list file (or the cwd, for -m) is taken with a note."""
    found: list[Path] = []
    problems: list[EnvProblem] = []
    for item in named:
        path = Path(item.name).expanduser()
        if path.is_absolute():
            candidates = [path]
        else:
            candidates = [script_dir / path, item.fallback / path]
        hit = next((c for c in candidates if c.is_file()), None)
        if hit is None:
            looked = " or ".join(str(c) for c in dict.fromkeys(candidates))
            problems.append(EnvProblem(item.where, None, "", f"model file {item.name!r} does not exist (looked for {looked})."))
            continue
        if not path.is_absolute() and hit != candidates[0]:
            notes.append(EnvProblem(item.where, None, "models", f"{item.name!r} is not in DIR ({script_dir}), where "
                                 f"Auptimizer's script looked; taken from {hit}."))
        found.append(hit.resolve())
    if problems:
        raise EnvFileError(problems)
    return found


@dataclass
class ModelName:
    """One -m/-f model name, where it was given (for messages), and the folder tried after DIR."""
    name: str
    where: str
    fallback: Path


@dataclass
class _Reading:
    """One env file being converted: its variables, the notes gathered so far, and how a variable's error reads."""

    env: EnvFile
    notes: list[EnvProblem]

    @property
    def source(self) -> str:
        return str(self.env.path)

    @property
    def env_dir(self) -> Path:
        return self.env.path.parent.resolve()

    def value(self, name: str) -> str | None:
        item = self.env.values.get(name)
        return item.value if item is not None and item.value.strip() else None

    def line(self, name: str) -> int | None:
        return self.env.values[name].line

    def note(self, line: int | None, name: str, message: str) -> None:
        self.notes.append(EnvProblem(self.source, line, name, message))

    def fail(self, name: str, message: str) -> EnvFileError:
        item = self.env.values.get(name)
        return EnvFileError([EnvProblem(self.source, item.line if item else None, name, message)])


def _read_aliases(r: _Reading) -> None:
    """The variables' other spellings become their documented names; a name Auptimizer never read is noted."""
    values = r.env.values
    for name in list(values):
        if name in ALIASES:
            canonical = ALIASES[name]
            if canonical in values:
                r.note(values[name].line, name, f"not carried: {canonical} is set too and wins.")
            else:
                values[canonical] = values[name]
                r.note(values[name].line, name, f"read as {canonical} (Auptimizer's code read {name}, its "
                                                f"documentation says {canonical}).")
        elif name not in KNOWN:
            r.note(values[name].line, name, "not an Auptimizer profiler variable; ignored.")


def _script_dir(r: _Reading) -> Path:
    """DIR: the folder that goes into the container (the profiler's `COPY $DIR .`), relative to the env
    file's folder, where the profiler ran and built from. Nothing outside that folder is sent or read."""
    env_dir = r.env_dir
    written = r.value("DIR")
    if not written:
        r.note(None, "DIR", f"not set: the env file's folder {env_dir} is the script's folder.")
        return env_dir
    if written.startswith("~"):
        raise r.fail("DIR", f"{written!r} is your home folder (or another user's), outside the env file's folder "
                            f"{env_dir}; farm sends only files under it. Point DIR at the script's folder inside it.")
    script_dir = (env_dir / written).resolve()
    if not script_dir.is_relative_to(env_dir):
        raise r.fail("DIR", f"{written!r} is {script_dir}, outside the env file's folder {env_dir}; farm sends only "
                            "files under it. Move the env file up, or the scripts into its folder.")
    if not script_dir.is_dir():
        raise r.fail("DIR", f"{written!r} is not a folder (looked for {script_dir}).")
    return script_dir


def _checked_script(r: _Reading, script_dir: Path) -> str | None:
    """SCRIPT: a file inside DIR, or not set."""
    script = r.value("SCRIPT")
    if script is not None:
        script_path = (script_dir / script).resolve()
        if not script_path.is_relative_to(script_dir):
            raise r.fail("SCRIPT", f"{script!r} is outside DIR ({script_dir}); farm sends DIR only.")
        if not script_path.is_file():
            raise r.fail("SCRIPT", f"{script!r} is not a file in DIR (looked for {script_path}).")
    return script


def _command_tokens(r: _Reading, script: str | None) -> list[str]:
    """COMMAND split as a shell would; without it, the interpreter SCRIPT's suffix asks for."""
    command_text = r.value("COMMAND")
    if command_text is None:
        if script is None:
            raise r.fail("COMMAND", "neither COMMAND nor SCRIPT is set: there is nothing to run.")
        guess = "bash" if script.endswith(".sh") else "python"
        r.note(None, "COMMAND", f"not set: {guess} runs {script}.")
        command_text = guess
    try:
        tokens = shlex.split(command_text)
    except ValueError as e:
        raise r.fail("COMMAND", f"cannot split the command line: {e}.") from None
    if not tokens:
        raise r.fail("COMMAND", "is empty.")
    return tokens


def _workload(r: _Reading, script: str | None, script_dir: Path, models: list[Path], out_dir: Path) -> ScriptPart:
    """The job's script workload: COMMAND's program, SCRIPT where the command names it, and the model last."""
    tokens = _command_tokens(r, script)
    workload = ScriptPart(command=tokens[0])
    rest = [_literal_braces(t) for t in tokens[1:]]
    if script is not None and tokens[1:2] == [script]:
        workload.script, args = script, rest[1:]
    elif script is not None and script in tokens[1:]:
        args = rest
    elif script is not None and not rest:
        workload.script, args = script, []
    else:
        args = rest + ([_literal_braces(script)] if script else [])
    if models:
        args.append("{model}")
        r.note(None, "COMMAND", "each model file is passed as the command's last argument ({model}), one run per "
                                "model.")
    workload.args = args
    workload.dir = _relative(script_dir, out_dir)
    return workload


def _sim_limits(r: _Reading, workload: ScriptPart) -> SimPart:
    """DOCKCPUS, DOCKMEMORY and DOCK_ARGS: the docker backend's CPU and memory budget."""
    sim = SimPart()
    if r.value("DOCKCPUS"):
        try:
            cpus = float(r.value("DOCKCPUS") or "")
        except ValueError:
            raise r.fail("DOCKCPUS", f"{r.value('DOCKCPUS')!r} is not a number of CPUs (like 1 or 0.5).") from None
        if not 0 < cpus < 4096:
            raise r.fail("DOCKCPUS", f"{r.value('DOCKCPUS')!r} must be above 0.")
        sim.set("cpus", cpus)
    if r.value("DOCKMEMORY"):
        try:
            parse_memory(_memory(r.value("DOCKMEMORY") or ""))
        except ValueError as e:
            raise r.fail("DOCKMEMORY", str(e)) from None
        sim.set("memory", _memory(r.value("DOCKMEMORY") or ""))
    if r.value("DOCK_ARGS"):
        _from_dropped_mount(r.env, workload, _dock_args(r.env, sim, r.notes), r.notes)
        if sim.memory is not None:
            try:
                parse_memory(_memory(sim.memory))
            except ValueError as e:
                raise r.fail("DOCK_ARGS", f"--memory: {e}") from None
            sim.memory = _memory(sim.memory)
        if sim.cpus is not None:
            try:
                sim.cpus = float(sim.cpus)
            except ValueError:
                raise r.fail("DOCK_ARGS", f"--cpus {sim.cpus!r} is not a number.") from None
    return sim


def _docfile_build(r: _Reading, dockerfile: Path, script: str | None, script_dir: Path, workload: ScriptPart,
                   out_dir: Path) -> BuildPart:
    """DOCFILE: its Dockerfile builds the image; the other build variables are not carried."""
    env_dir = r.env_dir
    if not dockerfile.is_relative_to(script_dir):
        # The profiler built from the env file's folder (`docker build -f $DOCFILE .`): that folder is the
        # context, so workload.dir becomes it and the script is named from there.
        inner = script_dir.relative_to(env_dir).as_posix()
        if workload.script is not None:
            workload.script = f"{inner}/{workload.script}"
        workload.args = [f"{inner}/{a}" if script is not None and a == _literal_braces(script) else a
                         for a in workload.args]
        workload.dir = _relative(env_dir, out_dir)
        r.note(r.line("DOCFILE"), "DOCFILE", f"{dockerfile.name} is beside the env file, outside DIR: the env file's "
                                             "folder is the build context, as the profiler's `docker build .` had it, "
                                             f"and the script runs from there as {inner}/{script}.")
        context = env_dir
    else:
        context = script_dir
    for name in ("IMAGEREPO", "APTREQUIREMENTS", "PIPREQUIREMENTS", "PRERUN"):
        if r.value(name):
            r.note(r.line(name), name, "not carried: DOCFILE is set, and its Dockerfile builds the image (write this "
                                       "step there).")
    return BuildPart(dockerfile=dockerfile.relative_to(context).as_posix())


def _steps_build(r: _Reading, script_dir: Path, pip_wheels: str | None) -> BuildPart:
    """APTREQUIREMENTS, PIPREQUIREMENTS and PRERUN: the build steps farm runs itself."""
    build = BuildPart()
    search, env_dir = [script_dir, r.env_dir], r.env_dir
    if r.value("APTREQUIREMENTS"):
        build.apt, more = _package_list(r.env, "APTREQUIREMENTS", search, env_dir)
        r.notes += more
        r.note(r.line("APTREQUIREMENTS"), "APTREQUIREMENTS", "packages are unpacked into /opt/farm-build/apt (the "
               "run's /usr is the agent's own); list the libraries they depend on too, and the agent needs the "
               "network to fetch them.")
    if r.value("PIPREQUIREMENTS"):
        build.pip, more = _package_list(r.env, "PIPREQUIREMENTS", search, env_dir)
        r.notes += more
        if pip_wheels is not None:
            wheels = (script_dir / pip_wheels).resolve()
            if not wheels.is_dir() or not wheels.is_relative_to(script_dir):
                raise r.fail("PIPREQUIREMENTS", f"--pip-wheels {pip_wheels!r} is not a folder inside DIR ({script_dir}).")
            build.pip_wheels = wheels.relative_to(script_dir).as_posix()
    if r.value("PRERUN"):
        build.run = [r.value("PRERUN") or ""]
        r.note(r.line("PRERUN"), "PRERUN", "runs once when the image is built, in DIR, not before every run; what it "
                                           "writes outside /usr is in the image.")
    return build


def _image(r: _Reading, sim: SimPart, build: BuildPart, *, keep_image: bool, host_python: bool) -> None:
    """IMAGEREPO: the run's image (sim.image), the build's base (--keep-image), or not carried."""
    image = r.value("IMAGEREPO")
    if not image:
        return
    line = r.line("IMAGEREPO")
    if build.apt is None and not keep_image and not host_python and _IMAGE_RE.fullmatch(image):
        sim.image = image
        steps = (" PIPREQUIREMENTS and PRERUN run in it, at build time, into a venv of the image's own "
                 "Python (as the profiler's `RUN pip install` did, without the PEP 668 refusal)."
                 if build.document() else "")
        r.note(line, "IMAGEREPO", "becomes sim.image: the script runs with the image's own Python and packages; it "
                                  f"must be on the agent's Docker engine (farm never pulls).{steps}")
    elif keep_image:
        build.base = image
        r.note(line, "IMAGEREPO", "the build starts from it; it must be on the agent's Docker engine (farm never "
                                  "pulls), and its /usr is covered by the agent's own.")
    else:
        why = "--host-python" if host_python else "with APTREQUIREMENTS"
        r.note(line, "IMAGEREPO", f"not carried ({why}): farm builds the steps on its own base and runs the script "
                                  "with the agent's own Python (its /usr, mounted read-only), so the image's would be "
                                  "hidden (--keep-image starts the build from it anyway; otherwise IMAGEREPO runs as "
                                  "sim.image).")


def _checked_build(r: _Reading, build: BuildPart) -> None:
    """Checked here, so a bad package names its variable and line, not the job file's."""
    try:
        SimBuild.model_validate(build.document())
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        variable = {"apt": "APTREQUIREMENTS", "pip": "PIPREQUIREMENTS", "run": "PRERUN"}.get(
            str(first["loc"][0]) if first["loc"] else "", "DOCFILE")
        raise r.fail(variable, str(first["msg"]).removeprefix("Value error, ")) from None


def _not_carried(r: _Reading) -> None:
    """SAMPLETIME and OUTPUTFILE: what farm does instead."""
    if r.value("SAMPLETIME"):
        r.note(r.line("SAMPLETIME"), "SAMPLETIME", f"not carried: farm samples every 50 ms and reads the kernel's own "
               f"peak; sampling every {r.value('SAMPLETIME')} s would only miss short peaks (sim.sample_interval_ms "
               "changes it).")
    if r.value("OUTPUTFILE"):
        r.note(r.line("OUTPUTFILE"), "OUTPUTFILE", "not carried: results go to farm's store; `farm results JOB "
               f"--format csv > {r.value('OUTPUTFILE')}` writes them out.")


def _model_paths(r: _Reading, models: list[Path], script: str | None, script_dir: Path, out_dir: Path) -> list[str]:
    """-m/-f's models; without them, the script stands as the job's one model."""
    if models:
        return [_relative(m, out_dir) for m in models]
    if script is not None:
        r.note(None, "models", f"no -m or -f: the script {script} stands as the job's one model (farm runs a "
                               "workload once per model file).")
        return [_relative(script_dir / script, out_dir)]
    raise EnvFileError([EnvProblem(r.source, None, "models", "no -m or -f and no SCRIPT: the job needs a model file "
                                                          "to run for; give -m a.tflite,b.tflite.")])


def convert(env: EnvFile, model_names: list[ModelName], out_path: Path, *, keep_image: bool = False,
            pip_wheels: str | None = None, host_python: bool = False) -> Conversion:
    """The job a converted env file becomes, and a note for each variable that changes meaning or is dropped:
    the env file's parts in the profiler's order (DIR, the models, SCRIPT and COMMAND, the docker budget, the
    image's build, what is not carried), each read by its own step."""
    r = _Reading(env, list(env.notes))
    out_dir = out_path.parent
    _read_aliases(r)
    script_dir = _script_dir(r)
    models = _resolve_models(model_names, script_dir, r.notes)
    script = _checked_script(r, script_dir)
    workload = _workload(r, script, script_dir, models, out_dir)
    sim = _sim_limits(r, workload)
    dockerfile = _given_dockerfile(env, r.env_dir, r.source, r.notes)
    if dockerfile is not None:
        build = _docfile_build(r, dockerfile, script, script_dir, workload, out_dir)
    else:
        build = _steps_build(r, script_dir, pip_wheels)
        _image(r, sim, build, keep_image=keep_image, host_python=host_python)
    if build.document():
        _checked_build(r, build)
        sim.build = build
    _not_carried(r)
    model_paths = _model_paths(r, models, script, script_dir, out_dir)
    return Conversion(env.path.stem, model_paths, workload, sim, sorted(r.notes, key=lambda n: n.line or 0))
