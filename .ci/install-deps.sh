#!/usr/bin/env bash
# What the tests' peers and foreign hosts need from Debian, installed when missing: the one list that both `.ci/run`
# and `make test` install from, so the README's test command proves on a fresh machine what CI proves (issue 34).
# Root only: anyone else gets a note naming what is missing (its tests skip, saying why) and nothing is changed.
# Safe to run again: what is installed already is not asked for.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive

need=()
# Debian's Docker engine (docker.io, .ci/install-docker.sh): the docker backend's tests.
command -v dockerd >/dev/null 2>&1 || [ -x /usr/sbin/dockerd ] || need+=(docker.io)
# The Jetson-like ssh test peer runs Debian's OpenSSH server.
[ -x /usr/sbin/sshd ] || need+=(openssh-server)
# Debian's platform adb client: the test that proves the ADB device emulator faithful drives it.
command -v adb >/dev/null || need+=(adb)
# Debian's chromium and its driver: the dashboard's tests drive a real headless browser, the report test screenshots
# its page and checks it is not blank.
{ [ -x /usr/bin/chromedriver ] && [ -x /usr/bin/chromium ]; } || need+=(chromium chromium-driver)
# The foreign hosts of the test lab: an arm64 board (debootstrap + qemu-user binfmt) and a cgroup-v2 VM
# (qemu-system-x86, cpio for its initramfs).
for pair in debootstrap:/usr/sbin/debootstrap qemu-user-static:/usr/bin/qemu-aarch64-static \
            binfmt-support:/usr/sbin/update-binfmts qemu-system-x86:/usr/bin/qemu-system-x86_64 cpio:/usr/bin/cpio; do
  [ -x "${pair#*:}" ] || need+=("${pair%%:*}")
done
# zsh and fish: the completion tests ask each shell what it would complete.
for shell in zsh fish; do command -v $shell >/dev/null || need+=($shell); done
# Debian's PostgreSQL server: the test peer for the store a lab outgrows one machine with (issue 22).
compgen -G "/usr/lib/postgresql/*/bin/postgres" >/dev/null || need+=(postgresql)

if [ ${#need[@]} -eq 0 ]; then
  echo "install-deps: every test peer's package is installed"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "install-deps: not root, so not installing ${need[*]}; the tests that need them skip, saying why" \
       "(run .ci/install-deps.sh as root to install them)"
  exit 0
fi
echo "install-deps: installing ${need[*]}"
# Another apt run (a test installing a peer beside this one) may hold the lock for a while: wait for it.
apt-get -o DPkg::Lock::Timeout=600 update -qq
apt-get -o DPkg::Lock::Timeout=600 install -y -qq "${need[@]}"
