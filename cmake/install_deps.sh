#!/usr/bin/env bash
# Installs the Debian packages seqpar's tests, examples and benchmarks need, if any is missing.
# As root it runs apt-get; otherwise it prints the exact command and fails.
set -euo pipefail
# cudnn-frontend's headers for attention::CudnnSdpa, where nvcc is: from PyPI into build/cudnn_frontend
# (cmake/install_cudnn_frontend.sh). A machine without network leaves CudnnSdpa unbuilt; CMake says so.
if command -v nvcc >/dev/null; then
  "$(dirname "$0")/install_cudnn_frontend.sh" || true
fi
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
