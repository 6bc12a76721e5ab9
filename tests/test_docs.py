"""The docs stay true (issue 35 item 6): every relative link and anchor in README.md, BENCHMARKS.md and docs/
resolves, the generated reference pages (tools/gen_reference.py) are what the command tree and the job model give
today, and the tutorial's shell blocks run as written, in order, in one shell in a temporary folder."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TUTORIAL = ROOT / "docs" / "tutorial.md"
FENCE = re.compile(r"^(```|~~~)")
LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md")),
            *sorted((ROOT / "benchmarks" / "results").glob("*.md"))]


def _prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code, with inline code spans removed."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, re.sub(r"`[^`]*`", "", line)))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation but '-' and '_' removed, spaces '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.replace("`", "").replace("*", "").strip().lower()
    return "".join(c for c in text if c.isalnum() or c in " -_").replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    fenced = False
    for line in page.read_text().splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
        if fenced:
            continue
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = counts.get(base, 0)
            counts[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
        found.update(re.findall(r'<a (?:name|id)="([^"]+)"', line))
    return found


def broken_links(pages: list[Path], root: Path = ROOT) -> list[str]:
    broken = []
    for page in pages:
        for number, line in _prose(page.read_text()):
            for target in LINK.findall(line):
                if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ... : not ours to check
                    continue
                path_part, _, anchor = target.partition("#")
                dest = (page.parent / path_part).resolve() if path_part else page
                where = f"{page.relative_to(root)}:{number}: {target}"
                if not dest.exists():
                    broken.append(f"{where}: no such file")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    broken.append(f"{where}: no heading #{anchor} in {dest.relative_to(root)}")
    return broken


def test_every_relative_link_and_anchor_resolves() -> None:
    assert broken_links(_pages()) == []


def test_the_link_check_catches_a_missing_file_and_a_missing_anchor(tmp_path: Path) -> None:
    (tmp_path / "b.md").write_text("# Title\n\n## `--json` and time\n\n## Contention: was the run's CPU its own?\n")
    good = tmp_path / "a.md"
    good.write_text("[x](b.md#--json-and-time) [y](b.md#contention-was-the-runs-cpu-its-own) [z](#top)\n\n# Top\n"
                    "```\n[not a link](nowhere.md)\n```\n`[code](nowhere.md)` [web](https://example.org/x.md)\n")
    bad = tmp_path / "c.md"
    bad.write_text("[gone](missing.md)\n[no anchor](b.md#json-and-time)\n")
    assert broken_links([good], tmp_path) == []
    problems = broken_links([bad], tmp_path)
    assert len(problems) == 2 and "no such file" in problems[0] and "no heading #json-and-time" in problems[1]


def _gen_reference():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "tools" / "gen_reference.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_generated_reference_is_current() -> None:
    gen = _gen_reference()
    for page, make in gen.PAGES.items():
        assert page.exists(), f"{page.relative_to(ROOT)} is missing: run python tools/gen_reference.py"
        assert page.read_text() == make(), f"{page.relative_to(ROOT)} is stale: run python tools/gen_reference.py"


def test_the_reference_names_every_command_and_job_field() -> None:
    from farm.cli.main import build_parser
    from farm.proto.spec import job_json_schema
    cli = (ROOT / "docs" / "reference" / "cli.md").read_text()
    gen = _gen_reference()
    for path, _, _ in gen._walk(build_parser(), ("farm",)):
        assert f"\n## {' '.join(path)}\n" in cli, path
    schema = (ROOT / "docs" / "reference" / "job-schema.md").read_text()
    for field in job_json_schema()["properties"]:
        assert f"| `{field}` |" in schema, field
    for nested in ("workload.iterations", "sim.on_contention", "matrix.threads", "timeouts.run"):
        assert f"| `{nested}` |" in schema, nested


def tutorial_script(text: str) -> tuple[str, int]:
    """The tutorial as one bash script: each `<!-- test: run -->` sh block as written, each `<!-- test: file NAME -->`
    block written to NAME; every sh block must be marked (a block the test does not run could rot)."""
    parts = ["set -euo pipefail"]
    marker, block, lang, fenced, count = None, [], "", False, 0
    for line in text.splitlines():
        if not fenced and FENCE.match(line):
            fenced, lang, block = True, line.strip("`~ ").strip(), []
            continue
        if fenced and FENCE.match(line):
            fenced = False
            if marker and marker.startswith("run"):
                assert lang == "sh", f"a run marker on a {lang!r} block"
                count += 1
                parts += [f"echo '@@ tutorial block {count}' >&2", *block]
            elif marker and marker.startswith("file "):
                name = marker.split(" ", 1)[1].strip()
                parts += [f"cat > {name} <<'FARM_TUTORIAL_EOF'", *block, "FARM_TUTORIAL_EOF"]
            else:
                assert lang != "sh", f"an sh block without <!-- test: run -->: {block[:1]}"
            marker = None
            continue
        if fenced:
            block.append(line)
            continue
        m = re.match(r"<!--\s*test:\s*(.*?)\s*-->", line.strip())
        if m:
            marker = m.group(1)
        elif line.strip():
            marker = None  # prose between a marker and its block: the marker is not for that block
    return "\n".join(parts) + "\n", count


def test_the_tutorial_script_is_every_marked_block() -> None:
    script, count = tutorial_script("<!-- test: run -->\n```sh\necho a\n```\ntext\n<!-- test: file x.yaml -->\n"
                                    "```yaml\nk: v\n```\n```python\nprint(1)\n```\n")
    assert count == 1 and "echo a" in script and "cat > x.yaml" in script and "k: v" in script
    with pytest.raises(AssertionError, match="without"):
        tutorial_script("```sh\nrm -rf /\n```\n")


def test_every_tutorial_block_runs(tmp_path: Path) -> None:
    script, count = tutorial_script(TUTORIAL.read_text())
    assert count >= 8
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env.update(HOME=str(tmp_path / "home"), COLUMNS="120", FARM_DB=str(tmp_path / "farm.db"),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    failed_block = ([ln for ln in done.stderr.splitlines() if ln.startswith("@@ tutorial block")] or ["none"])[-1]
    assert done.returncode == 0, f"{failed_block} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    work = tmp_path / "farm-tutorial"
    # what the tutorial says it made is there: its own store, two jobs' CSV, a prediction checked, a report
    assert (work / "tutorial.db").exists() and not (tmp_path / "farm.db").exists()
    assert (work / "sim.csv").read_text().count("\n") >= 5
    check = json.loads((work / "check.json").read_text())
    assert check["job"] == 4 and [r["model"]["name"] for r in check["results"]] == ["mobilenetv2_w1.4_r96"], check
    assert "<html" in (work / "report.html").read_text().lower()
