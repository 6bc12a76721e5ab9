"""`farm import auptimizer ENV.template [-m a,b | -f models.txt] -o job.yaml`: an Auptimizer profiler
setup as a farm job, with a note for every variable that changes meaning or cannot be carried."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from typing import TYPE_CHECKING

from rich.text import Text

from farm.cli.console import UserError, err, out, output_file
from farm.proto import strict_json
from farm.proto.escape import printable

if TYPE_CHECKING:
    from farm.cli.auptimizer_env import ModelName


def _model_names(args: argparse.Namespace) -> list[ModelName]:
    """The model names given by -m or -f; each is looked for inside DIR when the env file is read."""
    from farm.cli.auptimizer_env import MAX_MODELS, ModelName, read_model_list
    if args.models:
        items = [m.strip() for m in args.models.split(",") if m.strip()]
        if len(items) > MAX_MODELS:
            raise UserError(f"-m lists {len(items):,} models, over {MAX_MODELS:,}; use -f with a list file.")
        return [ModelName(m, f"-m {m}", Path.cwd()) for m in items]
    if args.model_list:
        list_path = Path(args.model_list)
        return [ModelName(name, f"{list_path}:{line}", list_path.parent.absolute())
                for name, line in read_model_list(list_path)]
    return []


def cmd_import_auptimizer(args: argparse.Namespace) -> int:
    # the job model and its checks load for this command only: `farm --help` builds this parser without them
    import yaml

    from farm.cli.auptimizer_env import EnvFileError, convert, parse_env
    from farm.controller.scheduling.jobfile import JobFileError, load_job_text

    target = output_file(args.output, "-o")
    if target.exists() and not args.force:
        raise UserError(f"-o {args.output}: {target} exists; nothing was written. Give --force to replace it, "
                        "or another file name.")
    try:
        names = _model_names(args)
        env = parse_env(Path(args.env_file))
        conversion = convert(env, names, target, keep_image=args.keep_image, pip_wheels=args.pip_wheels,
                             host_python=args.host_python)
    except EnvFileError as e:
        raise UserError(str(e), [p.to_json() for p in e.problems]) from None
    header = [f"# converted by `farm import auptimizer` from {printable(Path(args.env_file).name)}"]
    header += [f"# note: {printable(str(n), limit=None)}" for n in conversion.notes]  # they stay with the job
    text = "\n".join(header) + "\n" + yaml.safe_dump(conversion.job, sort_keys=False, allow_unicode=True)
    try:  # the job must load as `farm submit` will load it, before anything is written
        load_job_text(text, str(target), target.parent, target)
    except JobFileError as e:
        raise UserError(f"the converted job would not load, so nothing was written:\n{e}",
                        [p.to_json() for p in e.problems]) from None
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    temporary.write_text(text)
    os.replace(temporary, target)
    if args.json:
        print(strict_json.dumps({"job_file": str(target), "job": conversion.job,
                                 "notes": [n.to_json() for n in conversion.notes]}, indent=2))
        return 0
    for note in conversion.notes:
        err.print(Text.assemble(("note: ", "yellow"), printable(str(note), limit=None)), highlight=False)
    out.print(Text(f"wrote {target}: run it with `farm submit {printable(args.output)}`"), highlight=False)
    return 0


def add_commands(sub, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("import", help="convert another tool's setup into a farm job file")
    isub = s.add_subparsers(dest="import_command", required=True, metavar="TOOL")
    # a local conversion: no store and no controller, so only --json of the common options
    a = isub.add_parser("auptimizer", help="an Auptimizer profiler env.template (and its -m/-f models) as a job file")
    a.add_argument("--json", action="store_true", help="machine-readable output: the job and the notes")
    a.add_argument("env_file", metavar="ENV.template", help="the Auptimizer profiler's env.template")
    chosen = a.add_mutually_exclusive_group()
    chosen.add_argument("-m", "--models", help="comma-separated model files, inside DIR as `aup.profiler -m` took them")
    chosen.add_argument("-f", "--model-list", help="a file naming one model a line (inside DIR), as `aup.profiler -f` took it")
    a.add_argument("-o", "--output", required=True, help="the job file to write (e.g. job.yaml)")
    a.add_argument("--force", action="store_true", help="replace the -o file when it exists")
    a.add_argument("--keep-image", action="store_true",
                   help="start the image build from IMAGEREPO (it must be on the agent's engine; farm never pulls)")
    a.add_argument("--host-python", action="store_true",
                   help="do not run in IMAGEREPO (sim.image): run the script with the agent's own Python")
    a.add_argument("--pip-wheels", metavar="FOLDER",
                   help="install PIPREQUIREMENTS offline, only from the wheels in this folder inside DIR")
    a.set_defaults(func=cmd_import_auptimizer)
