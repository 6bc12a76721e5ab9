"""A cgroup-v2-only Linux for the tests: Debian's cloud kernel under qemu-system-x86_64 (KVM when it
works, else TCG), booted with `cgroup_no_v1=all`, seeing this machine's own files read-only through
virtiofs (so the checkout, its venv and Python are the host's, no image to build).

The kernel package and busybox-static come from the Debian registry with `apt-get download` and are
unpacked with `dpkg-deb -x` (nothing is installed); the initramfs (busybox, the virtio/virtiofs
modules, an init script) is built once into /var/cache/farm-tests/cgroup-v2-vm/<key>/. The init
mounts the share, tmpfs over /tmp and /run, cgroup2 on /sys/fs/cgroup, runs one shell command
in the host's tree and prints its output and exit status on the serial console, then powers off.

    python tests/cgroup_v2_vm.py build
    python tests/cgroup_v2_vm.py run 'cat /sys/fs/cgroup/cgroup.controllers'
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from cache_lock import cache_lock

CACHE = Path(os.environ.get("FARM_TEST_CACHE", "/var/cache/farm-tests")) / "cgroup-v2-vm"
KERNEL_PACKAGE = "linux-image-cloud-amd64"  # a metapackage: its one dependency is the versioned kernel
VIRTIOFSD = [Path("/usr/lib/qemu/virtiofsd"), Path("/usr/libexec/virtiofsd")]
QEMU = "qemu-system-x86_64"
# the .deb has no modules.dep (depmod never ran): the init retries until each module's dependencies are in
MODULES = ["drivers/virtio/virtio_ring.ko", "drivers/virtio/virtio.ko", "drivers/virtio/virtio_pci_legacy_dev.ko",
           "drivers/virtio/virtio_pci_modern_dev.ko", "drivers/virtio/virtio_pci.ko", "fs/fuse/fuse.ko",
           "fs/fuse/virtiofs.ko"]
RECIPE_VERSION = 2  # 2: a checkout under /tmp is bound back into the guest
MEMORY_MB = 2048
END = "@@farm-vm-exit"

INIT = r"""#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t devtmpfs dev /dev
mount -t proc proc /proc
mount -t sysfs sys /sys
for pass in 1 2 3; do for m in /modules/*.ko; do [ -e "$m.loaded" ] || { insmod "$m" 2>/dev/null && : > "$m.loaded"; }; done; done
mkdir -p /host
mount -t virtiofs -o ro host /host || { echo "farm-vm: cannot mount the host share"; poweroff -f; }
# a checkout under /tmp (a CI clone there) is kept: bound aside before the guest's fresh tmpfs, then back
KEEP=$(cat /proc/cmdline | sed -n 's/.*farm_keep=\([^ ]*\).*/\1/p' | base64 -d)
mkdir -p /keep && [ -n "$KEEP" ] && mount -o bind "/host$KEEP" /keep
for d in tmp run var/tmp; do mount -t tmpfs -o mode=1777 tmpfs /host/$d; done
[ -n "$KEEP" ] && mkdir -p "/host$KEEP" && mount -o bind /keep "/host$KEEP"
# the sim runs jobs as nobody: a Python under the host's 0700 /root must stay reachable, so the guest's /root
# is a 0711 tmpfs holding the host's entries bound back
mkdir -p /oldroot && mount -o bind /host/root /oldroot && mount -t tmpfs -o mode=0711 tmpfs /host/root
for e in /oldroot/* /oldroot/.[!.]*; do
  [ -e "$e" ] || continue; n="/host/root/${e#/oldroot/}"
  if [ -d "$e" ]; then mkdir -p "$n"; else : > "$n"; fi; mount -o bind "$e" "$n"
done
mount -t proc proc /host/proc
mount -t sysfs sys /host/sys
mount -t devtmpfs dev /host/dev
mkdir -p /host/dev/shm && mount -t tmpfs -o size=64m shm /host/dev/shm
mount -t cgroup2 cgroup2 /host/sys/fs/cgroup
CMD=$(cat /proc/cmdline | sed -n 's/.*farm_cmd=\([^ ]*\).*/\1/p' | base64 -d)
echo "@@farm-vm-start"
HOME=/tmp FARM_IN_CGROUP_V2_VM=1 chroot /host /bin/sh -c "$CMD" </dev/null 2>&1
echo "@@farm-vm-exit $?"
poweroff -f
"""


class VmUnavailable(RuntimeError):
    """The VM cannot be built or booted here; the message says why."""


QUICKSTART_MODEL = "mobilenetv2_w0.35_r96.tflite"
GUEST_HIDDEN = ("/tmp", "/run", "/var/tmp")  # the guest mounts fresh tmpfs there (only a checkout there is bound back)


def _sources_key(folders: list[Path]) -> str:
    digest = hashlib.sha256()
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            digest.update(str(path.relative_to(folder.parent)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def host_model(tree: Path) -> Path:
    """The quickstart's one model, generated on the host once per version of the generator's sources (the
    folder is keyed by their hash, written under the cache's lock): the VM proves the kernel's cgroup v2 files,
    and `farm models generate` under TCG cost a guest Python start and a minute or more."""
    import numpy
    key = _sources_key([tree / "model_generators", tree / "models"]) + numpy.__version__
    where = CACHE / f"model-{key}"
    if any(where.is_relative_to(d) for d in GUEST_HIDDEN):
        raise VmUnavailable(f"FARM_TEST_CACHE ({CACHE.parent}) is under {', '.join(GUEST_HIDDEN)}, which the guest "
                            "does not see: point it elsewhere")
    if not (where / QUICKSTART_MODEL).exists():
        with cache_lock(CACHE):
            if not (where / QUICKSTART_MODEL).exists():
                from farm.model_generators.generate import generate_examples
                partial = where.with_name(where.name + ".partial")
                shutil.rmtree(partial, ignore_errors=True)
                generate_examples(partial, widths=[0.35], input_sizes=[96], formats=["tflite"], zoo=False)
                if not (partial / QUICKSTART_MODEL).exists():
                    raise VmUnavailable(f"generate_examples wrote no {QUICKSTART_MODEL} into {partial}")
                shutil.rmtree(where, ignore_errors=True)
                partial.rename(where)
    return where / QUICKSTART_MODEL


def compile_sources(tree: Path) -> int:
    """farm's own sources compiled on the host into their __pycache__ (as any host import writes them), so the
    guest, whose share is read-only, reads bytecode instead of compiling every farm module in each of its Python
    processes under TCG (the stdlib's and the venv's bytecode is on disk already). Returns the folders done."""
    import compileall
    import tomllib
    folders = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    for folder in folders:
        if not compileall.compile_dir(tree / folder, quiet=1):
            raise VmUnavailable(f"compileall of {tree / folder} failed (a syntax error?)")
    return len(folders)


def guest_ready(tree: Path) -> Path:
    """What the guest reads from the host, made on the host: farm's bytecode, and the quickstart model (its path)."""
    compile_sources(tree)
    return host_model(tree)


def recipe_key() -> str:
    text = json.dumps([RECIPE_VERSION, KERNEL_PACKAGE, MODULES, INIT])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def cache_dir() -> Path:
    return CACHE / recipe_key()


def _run(argv: list[str], what: str, timeout: float = 600, **kw) -> subprocess.CompletedProcess[str]:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    except (subprocess.TimeoutExpired, OSError) as e:
        raise VmUnavailable(f"{what}: {e}") from None
    if p.returncode != 0:
        raise VmUnavailable(f"{what} failed ({p.returncode}): {(p.stdout + p.stderr).strip()[-800:]}")
    return p


def virtiofsd() -> Path | None:
    return next((p for p in VIRTIOFSD if p.exists()), None)


def build() -> Path:
    """The cached kernel and initramfs (built when missing, by one test run at a time); returns their folder."""
    if (cache_dir() / "ready").exists():
        return cache_dir()
    with cache_lock(CACHE):  # another run building it: wait, then find it ready
        return _build()


def _build() -> Path:
    where = cache_dir()
    if (where / "ready").exists():
        return where
    for tool in (QEMU, "apt-get", "dpkg-deb", "cpio"):
        if shutil.which(tool) is None:
            raise VmUnavailable(f"{tool} is not installed (apt-get install qemu-system-x86 cpio)")
    if virtiofsd() is None:
        raise VmUnavailable("virtiofsd is not installed (Debian's qemu-system-common ships it)")
    started = time.monotonic()
    shutil.rmtree(where, ignore_errors=True)
    (where / "deb").mkdir(parents=True)
    depends = _run(["apt-cache", "depends", KERNEL_PACKAGE], f"apt-cache depends {KERNEL_PACKAGE}").stdout
    found = re.search(r"Depends: (linux-image-\S+)", depends)
    if not found:
        raise VmUnavailable(f"{KERNEL_PACKAGE} names no kernel package (apt-get update?): {depends[-300:]}")
    _run(["apt-get", "download", found[1], "busybox-static"], "apt-get download of the kernel and busybox "
         "(is the Debian registry reachable?)", cwd=where / "deb")
    unpacked = where / "unpacked"
    for deb in (where / "deb").glob("*.deb"):
        _run(["dpkg-deb", "-x", str(deb), str(unpacked)], f"dpkg-deb -x {deb.name}")
    (vmlinuz,) = (unpacked / "boot").glob("vmlinuz-*")
    (modules_dir,) = (unpacked / "lib/modules").iterdir()
    shutil.copy(vmlinuz, where / "vmlinuz")
    initramfs = where / "initramfs"
    for d in ("bin", "dev", "proc", "sys", "modules"):
        (initramfs / d).mkdir(parents=True, exist_ok=True)
    shutil.copy(unpacked / "bin/busybox", initramfs / "bin/busybox")
    for i, module in enumerate(MODULES):
        shutil.copy(modules_dir / "kernel" / module, initramfs / "modules" / f"{i:02d}-{Path(module).name}")
    (initramfs / "init").write_text(INIT)
    (initramfs / "init").chmod(0o755)
    files = sorted(str(p.relative_to(initramfs)) for p in initramfs.rglob("*"))
    with (where / "initramfs.cpio").open("wb") as out:
        subprocess.run(["cpio", "-o", "-H", "newc", "--quiet"], cwd=initramfs, input="\n".join(files).encode(),
                       stdout=out, check=True)
    shutil.rmtree(unpacked)
    (where / "build.json").write_text(json.dumps({"seconds": round(time.monotonic() - started, 1),
                                                  "kernel": found[1]}))
    (where / "ready").write_text("")
    return where


@dataclass
class VmResult:
    status: int | None  # the command's exit status; None when the VM never said
    output: str  # what the command printed
    console: str  # the whole serial console
    accel: str
    boot_to_exit_s: float


_ACCEL: list[str] = []  # what booted here, found once per process
KVM_PROBE_S = 30  # a KVM guest that works boots in seconds; here its device opens but a guest may hang


def accelerator() -> str:
    """KVM when a guest really boots with it (tried once), else TCG (software, slower)."""
    if not _ACCEL:
        wanted = os.environ.get("FARM_VM_ACCEL")
        if wanted:
            _ACCEL.append(wanted)
        elif os.access("/dev/kvm", os.R_OK | os.W_OK) and run("true", KVM_PROBE_S, accel="kvm").status == 0:
            _ACCEL.append("kvm")
        else:
            _ACCEL.append("tcg")
    return _ACCEL[0]


@contextlib.contextmanager
def _virtiofsd(socket: Path) -> Iterator[subprocess.Popen[bytes]]:
    daemon = virtiofsd()
    assert daemon is not None
    process = subprocess.Popen([str(daemon), f"--socket-path={socket}", "-o", "source=/", "-o", "cache=auto", "-o", "sandbox=chroot"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        end = time.monotonic() + 10
        while not socket.exists():
            if process.poll() is not None or time.monotonic() > end:
                raise VmUnavailable(f"virtiofsd did not start (status {process.poll()})")
            time.sleep(0.05)
        yield process
    finally:
        process.kill()
        process.wait(timeout=10)


def run(command: str, timeout_s: float = 900, accel: str | None = None) -> VmResult:
    """Boot the VM, run `command` (sh, in the host's tree as root) and return what it printed."""
    import base64
    where = build()
    chosen = accel or accelerator()
    with tempfile.TemporaryDirectory(prefix="farm-vm-") as tmp:
        socket = Path(tmp) / "virtiofs.sock"
        encoded = base64.b64encode(command.encode()).decode()
        append = (f"console=ttyS0 quiet panic=-1 cgroup_no_v1=all systemd.unified_cgroup_hierarchy=1 "
                  f"farm_cmd={encoded}")
        tree = Path(__file__).resolve().parent.parent
        if any(tree.is_relative_to(d) for d in ("/tmp", "/run", "/var/tmp")):  # the guest mounts fresh ones there
            append += f" farm_keep={base64.b64encode(str(tree).encode()).decode()}"
        argv = [QEMU, "-accel", chosen, "-m", str(MEMORY_MB), "-smp", "2", "-nographic", "-no-reboot",
                "-kernel", str(where / "vmlinuz"), "-initrd", str(where / "initramfs.cpio"), "-append", append,
                "-chardev", f"socket,id=fs,path={socket}", "-device", "vhost-user-fs-pci,chardev=fs,tag=host",
                "-object", f"memory-backend-file,id=mem,size={MEMORY_MB}M,mem-path=/dev/shm,share=on",
                "-numa", "node,memdev=mem"]
        # numpy and the runtimes use AVX2: TCG's default CPU (qemu64) lacks it, its `max` has it
        argv += ["-cpu", "host" if chosen == "kvm" else "max"]
        with _virtiofsd(socket):
            started = time.monotonic()
            try:
                p = subprocess.run(argv, capture_output=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
                console = (p.stdout + p.stderr).decode("utf-8", "replace")
            except subprocess.TimeoutExpired as e:
                console = (e.stdout or b"").decode("utf-8", "replace")
                return VmResult(None, console, console, chosen, time.monotonic() - started)
    elapsed = time.monotonic() - started
    _, _, after = console.partition("@@farm-vm-start")
    output, _, tail = after.partition(END)
    status = re.match(r"\s*(\d+)", tail)
    return VmResult(int(status[1]) if status else None, output.replace("\r\n", "\n").strip("\n"), console, chosen,
                    elapsed)


def main(argv: list[str]) -> int:
    if argv[:1] == ["build"]:
        started = time.monotonic()
        print(build(), f"({time.monotonic() - started:.0f} s)")
        return 0
    if len(argv) == 2 and argv[0] == "run":
        result = run(argv[1])
        print(result.output)
        print(f"[status {result.status}, {result.accel}, {result.boot_to_exit_s:.1f} s]")
        return 0 if result.status == 0 else 1
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
