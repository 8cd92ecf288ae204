#!/usr/bin/env bash
# Installs the Debian packages seqpar's tests, examples and benchmarks need, if any is missing.
# As root it runs apt-get; otherwise it prints the exact command and fails.
set -euo pipefail
packages=(cmake ninja-build g++ doctest-dev libopenblas-dev libopenmpi-dev openmpi-bin libglpk-dev
          libtrilinos-kokkos-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
cmd="apt-get update && apt-get install -y --no-install-recommends ${missing[*]}"
if [ "$(id -u)" -ne 0 ]; then
  echo "seqpar needs these Debian packages: ${missing[*]}" >&2
  echo "run as root:  $cmd" >&2
  exit 1
fi
echo "installing: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends "${missing[@]}"
