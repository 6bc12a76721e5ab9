#!/usr/bin/env bash
# Install Debian's Docker engine (docker.io) when dockerd is missing. Safe to run again.
# With its recommends (apparmor among them), as tested. It only installs:
# tests/docker_engine.py starts the daemon when the docker tests run.
set -euo pipefail

if command -v dockerd >/dev/null 2>&1 || [ -x /usr/sbin/dockerd ]; then
  echo "install-docker: dockerd already installed ($( (command -v dockerd || echo /usr/sbin/dockerd) ))"
  exit 0
fi

# Root runs apt directly; anyone else needs sudo without a password prompt (CI has no stdin).
if [ "$(id -u)" -eq 0 ]; then
  as_root=()
elif command -v sudo >/dev/null 2>&1; then
  as_root=(sudo -n)
else
  echo "install-docker: need root or sudo to install docker.io" >&2
  exit 1
fi

export DEBIAN_FRONTEND=noninteractive
# Another apt run (a test installing sshd or adb beside this one) holds the lock for a while: wait for it.
"${as_root[@]}" apt-get -o DPkg::Lock::Timeout=600 update -qq
"${as_root[@]}" apt-get -o DPkg::Lock::Timeout=600 install -y -qq docker.io
echo "install-docker: installed $(/usr/sbin/dockerd --version)"
