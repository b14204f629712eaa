#!/usr/bin/env bash
# Idempotently install a minimal single-node SLURM (Debian packages) + munge.
# Used by tests/slurm_cluster.py, which starts private daemons on 127.0.0.1.
set -euo pipefail

PKGS=(slurmctld slurmd slurm-client munge)
BINS=(slurmctld slurmd slurmstepd sbatch srun squeue sinfo scontrol scancel munged mungekey)

# NB: `sinfo --version` tries to load a slurm.conf (and DNS SRV) first, so
# report the Debian package versions instead.
pkg_versions() {
  dpkg-query -W -f='${Package}=${Version} ' "${PKGS[@]}" 2>/dev/null || true
}

have_all() {
  local b
  for b in "${BINS[@]}"; do
    command -v "$b" >/dev/null 2>&1 || [[ -x "/usr/sbin/$b" ]] || return 1
  done
}

if have_all; then
  echo "install-slurm: slurm + munge already installed: $(pkg_versions)"
  exit 0
fi

SUDO=(env DEBIAN_FRONTEND=noninteractive)
if [[ $(id -u) -ne 0 ]]; then
  SUDO=(sudo "${SUDO[@]}")
fi

# Wait for other apt/dpkg users (shared machines, CI images) instead of failing.
APT_OPTS=(-o DPkg::Lock::Timeout=600)
"${SUDO[@]}" apt-get "${APT_OPTS[@]}" update -qq
"${SUDO[@]}" apt-get "${APT_OPTS[@]}" install -y -qq --no-install-recommends "${PKGS[@]}"

# The Debian packages enable and (under systemd) start system daemons using
# /etc/slurm/slurm.conf; the tests run their own private instances instead.
# In containers without systemd nothing is started; nothing else to do.

have_all || { echo "install-slurm: binaries still missing after install" >&2; exit 1; }
echo "install-slurm: installed $(pkg_versions)"
