#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs cudnn-frontend's C++ headers (header-only; NVIDIA/cudnn-frontend, MIT) into
# build/cudnn_frontend/include, from PyPI's nvidia-cudnn-frontend wheel (which carries them under
# include/), for attention::CudnnSdpa (kernels/cudnn.cmake finds them there). Reused when present;
# a machine without network or pip leaves CudnnSdpa unbuilt (AUTO), which CMake says.
#   cmake/install_cudnn_frontend.sh [DEST]     (DEST defaults to build/cudnn_frontend)
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
dest=${1:-$root/build/cudnn_frontend}
version=1.32.0  # the wheel whose headers were read when CudnnSdpa was written (2026-12-04)

if [[ -f $dest/include/cudnn_frontend.h && -f $dest/VERSION && $(cat "$dest/VERSION") == "$version" ]]; then
  echo "install_cudnn_frontend.sh: $dest has cudnn-frontend $version"
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  "nvidia-cudnn-frontend==$version" -d "$tmp" >"$tmp/pip.log" 2>&1; then
  echo "install_cudnn_frontend.sh: could not download nvidia-cudnn-frontend $version (no network or pip?):" \
    "CudnnSdpa will not be built" >&2
  tail -n 3 "$tmp/pip.log" >&2
  exit 1
fi
wheel=$(ls "$tmp"/nvidia_cudnn_frontend-*.whl | head -n 1)
rm -rf "$dest"
mkdir -p "$dest"
python3 - "$wheel" "$dest" <<'PY'
import sys, zipfile
wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith("include/") and not n.endswith("/")]
    if not any(n == "include/cudnn_frontend.h" for n in names):
        sys.exit("install_cudnn_frontend.sh: the wheel has no include/cudnn_frontend.h")
    for n in names:
        z.extract(n, dest)
PY
echo "$version" >"$dest/VERSION"
echo "install_cudnn_frontend.sh: cudnn-frontend $version headers in $dest/include"
