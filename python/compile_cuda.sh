#!/usr/bin/env bash
# Compiles the torch extension's CUDA path (SEQPAR_TORCH_CUDA=1) without building the extension: the
# host translation units python/src/cuda_attention.cpp (c10d::DeviceTransport; CudaFlash, TorchFlash and, where
# cuDNN and cudnn-frontend are found as setup.py finds them, CudnnSdpa engines) and
# ops.cpp (which dispatches CUDA tensors to it), against the torch of build/venv and the CUDA headers of
# CUDA_HOME (default: nvcc's). What .ci/run checks on machines without a GPU; the kernels those units
# link (kernels/instances) are compiled by the CMake build. Warnings are errors (torch's headers are
# system headers here). Arguments: the translation units (default both; CI checks cuda_attention.cpp,
# which holds all of the CUDA path's code but ops.cpp's few dispatch lines: 1.5 min of CPU here, half).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
python=${SEQPAR_VENV:-$root/build/venv}/bin/python
export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
mapfile -t system < <("$python" - <<'PY'
import sysconfig
from torch.utils.cpp_extension import include_paths
for p in include_paths("cuda") + [sysconfig.get_paths()["include"]]:
    print(p)
PY
)
# The C++ standard and the CUDA definitions: cmake/build_flags.json, as the CMake build and setup.py.
mapfile -t shared < <("$python" - "$root/cmake/build_flags.json" <<'PY'
import json, sys
flags = json.load(open(sys.argv[1]))
print(f"-std=c++{flags['cxx_standard']}")
for d in flags["cuda_definitions"]:
    print(f"-D{d}")
PY
)
flags=("${shared[@]}" -O0 -fsyntax-only -Wall -Wextra -Werror -Wno-unused-parameter -Wno-deprecated-declarations
       -DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_C -DSEQPAR_TORCH_CUDA=1
       -I"$root/include" -I"$root/kernels" -I"$root/python/src")
for dir in "${system[@]}"; do flags+=(-isystem "$dir"); done
# CudnnSdpa in the op (SEQPAR_TORCH_CUDNN=1) where setup.py would find cuDNN and cudnn-frontend (seqpar_build's
# cudnn_paths); its instances (kernels/instances_cudnn) are compiled by the CMake build.
mapfile -t cudnn < <("$python" - "$root/python" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
import seqpar_build
for p in seqpar_build.cudnn_paths() or ():
    print(p)
PY
)
if [[ ${#cudnn[@]} -eq 3 ]]; then
  flags+=(-DSEQPAR_TORCH_CUDNN=1 -isystem "${cudnn[0]}" -isystem "${cudnn[2]}")
  echo "== with CudnnSdpa (cuDNN ${cudnn[0]}, cudnn-frontend ${cudnn[2]})"
else
  echo "== without CudnnSdpa (cuDNN or cudnn-frontend not found)"
fi
sources=("$@")
[[ ${#sources[@]} -gt 0 ]] || sources=(cuda_attention.cpp ops.cpp)
for src in "${sources[@]}"; do
  echo "== compile (syntax and templates) python/src/$src with SEQPAR_TORCH_CUDA=1"
  ${CXX:-c++} "${flags[@]}" "$root/python/src/$src"
done
