"""Build farm-agent, the agent-only distribution, from farm's own wheel.

`pip install farm` is the whole farm: controller, calibration, reports. A host that only runs
`farm agent` (a rack host with phones on USB, a board) needs none of the controller's stack
(scipy, matplotlib, SQLite tooling, cron, Prometheus) nor Docker's client unless it uses the
docker sandbox. farm-agent is the same code under another name with only the agent's
requirements; `farm-agent[docker]` adds the docker backend, `farm-agent[usb]` phones on USB.
Commands that need the rest say so and exit 3.

    python deploy/agent_wheel.py dist/farm-0.1.0-py3-none-any.whl -o dist/
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import re
import sys
import zipfile
from pathlib import Path

AGENT_NAME = "farm-agent"
# What an agent imports: the task vocabulary, the wire, the sandboxes, the harness's runtimes, the
# device transports and the CLI that starts it. Every other requirement of farm is left out.
AGENT_REQUIRES = {
    "pydantic", "pyyaml", "psutil", "numpy", "rich", "onnx", "onnxruntime", "ai-edge-litert", "flatbuffers",
    "platformdirs", "grpcio", "protobuf", "paramiko", "adb-shell", "cryptography",
}
# Requirements that become extras of farm-agent (name -> extra).
AGENT_EXTRAS = {"docker": "docker"}
KEPT_EXTRAS = {"usb"}


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def agent_metadata(metadata: str) -> str:
    """farm's METADATA with farm-agent's name, summary and requirements."""
    out: list[str] = []
    headers, _, body = metadata.partition("\n\n")
    extras_added: set[str] = set()
    for line in headers.splitlines():
        key, _, value = line.partition(": ")
        if key == "Name":
            line = f"Name: {AGENT_NAME}"
        elif key == "Summary":
            line = "Summary: farm's agent only: runs tasks from a farm controller on this host's sandbox and devices."
        elif key == "Provides-Extra":
            if value not in KEPT_EXTRAS:
                continue
        elif key == "Requires-Dist":
            requirement, _, marker = value.partition(";")
            name = _name(requirement)
            if marker.strip():  # an extra's requirement: keep only the extras an agent has
                if not any(f'extra == "{e}"' in marker for e in KEPT_EXTRAS):
                    continue
            elif name in AGENT_EXTRAS:
                extra = AGENT_EXTRAS[name]
                if extra not in extras_added:
                    out.append(f"Provides-Extra: {extra}")
                    extras_added.add(extra)
                line = f'Requires-Dist: {requirement.strip()}; extra == "{extra}"'
            elif name not in AGENT_REQUIRES:
                continue
        out.append(line)
    return "\n".join(out) + "\n\n" + body


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build_agent_wheel(farm_wheel: Path, out_dir: Path) -> Path:
    """farm-agent's wheel beside farm's: same files, renamed .dist-info, METADATA and RECORD rewritten."""
    match = re.match(r"^farm-([^-]+)-(.+)\.whl$", farm_wheel.name)
    if not match:
        raise ValueError(f"{farm_wheel.name} is not a farm wheel (farm-VERSION-TAGS.whl)")
    version, tags = match.groups()
    old_info, new_info = f"farm-{version}.dist-info/", f"farm_agent-{version}.dist-info/"
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"farm_agent-{version}-{tags}.whl"
    record: list[str] = []
    with zipfile.ZipFile(farm_wheel) as source, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as wheel:
        for info in source.infolist():
            name = info.filename
            if name == old_info + "RECORD":
                continue
            data = source.read(info)
            if name.startswith(old_info):
                name = new_info + name[len(old_info):]
                if name == new_info + "METADATA":
                    data = agent_metadata(data.decode()).encode()
            wheel.writestr(name, data)
            record.append(_record_line(name, data))
        record.append(f"{new_info}RECORD,,")
        wheel.writestr(new_info + "RECORD", "\n".join(record) + "\n")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path, help="farm's wheel (pip wheel --no-deps . -w dist)")
    parser.add_argument("-o", "--out", type=Path, default=Path("dist"), help="folder for farm-agent's wheel")
    args = parser.parse_args(argv)
    try:
        print(build_agent_wheel(args.wheel, args.out))
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        print(f"agent_wheel: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
