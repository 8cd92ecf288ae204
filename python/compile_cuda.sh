#!/usr/bin/env bash
# Compiles the torch extension's CUDA path (SEQPAR_TORCH_CUDA=1) without building the extension: the
# host translation units python/src/cuda_attention.cpp (c10d::DeviceTransport, CudaFlash engines) and
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
sources=("$@")
[[ ${#sources[@]} -gt 0 ]] || sources=(cuda_attention.cpp ops.cpp)
for src in "${sources[@]}"; do
  echo "== compile (syntax and templates) python/src/$src with SEQPAR_TORCH_CUDA=1"
  ${CXX:-c++} "${flags[@]}" "$root/python/src/$src"
done
