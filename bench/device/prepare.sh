#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Run on the build machine before a device run: copies into build/device_carry (ignored by git) what
# the device build needs and the GPU machine's image lacks, so that the device tool's `carry` takes it
# along: doctest (tests/CMakeLists.txt: find_package(doctest REQUIRED)), its header and its CMake
# package with the package's install prefix made relative (Debian's says /usr, where the GPU machine
# has no doctest.h); and cudnn-frontend's headers for CudnnSdpa (cmake/install_cudnn_frontend.sh).
# Then a dry run of the device run's scripts and built programs here: each must refuse cleanly without a GPU.
#   bench/device/prepare.sh [DEST]      (DEST defaults to build/device_carry)
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
dest=${1:-$root/build/device_carry}

header=""
for dir in /usr/include /usr/local/include; do
  [[ -f $dir/doctest/doctest.h ]] && header=$dir/doctest/doctest.h && break
done
package=""
for dir in /usr/lib/cmake/doctest /usr/local/lib/cmake/doctest /usr/lib/x86_64-linux-gnu/cmake/doctest \
  /usr/share/doctest/cmake; do
  [[ -f $dir/doctestConfig.cmake ]] && package=$dir && break
done
if [[ -z $header || -z $package ]]; then
  echo "prepare.sh: doctest not found (header: '${header}', CMake package: '${package}'):" \
    "install doctest-dev (cmake/install_deps.sh) and run again" >&2
  exit 1
fi

rm -rf "$dest/doctest"
mkdir -p "$dest/doctest/include/doctest" "$dest/doctest/lib/cmake/doctest"
cp "$header" "$dest/doctest/include/doctest/"
cp "$package"/*.cmake "$dest/doctest/lib/cmake/doctest/"
# The same layout as the install (<prefix>/include, <prefix>/lib/cmake/doctest), so the prefix is
# three folders above the package wherever the folder lands.
# shellcheck disable=SC2016  # ${CMAKE_CURRENT_LIST_DIR} is CMake's, not the shell's
sed -i 's|^set(_IMPORT_PREFIX ".*")$|get_filename_component(_IMPORT_PREFIX "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)|' \
  "$dest/doctest/lib/cmake/doctest/doctestTargets.cmake"
if grep -q '^set(_IMPORT_PREFIX "/' "$dest/doctest/lib/cmake/doctest/doctestTargets.cmake"; then
  echo "prepare.sh: doctestTargets.cmake still names an absolute prefix" >&2
  exit 1
fi

# Check: a CMake project that finds the copy sees its include folder, not the system's.
check=$(mktemp -d)
trap 'rm -rf "$check"' EXIT
cat >"$check/CMakeLists.txt" <<'EOF'
cmake_minimum_required(VERSION 3.25)
project(doctest_carry_check LANGUAGES NONE)
find_package(doctest REQUIRED)
get_target_property(inc doctest::doctest INTERFACE_INCLUDE_DIRECTORIES)
message(STATUS "doctest_include=${inc}")
EOF
found=$(cmake -S "$check" -B "$check/build" -Ddoctest_DIR="$dest/doctest/lib/cmake/doctest" 2>&1 |
  sed -n 's/^-- doctest_include=//p')
if [[ $found != "$dest/doctest/include" || ! -f $found/doctest/doctest.h ]]; then
  echo "prepare.sh: the copied package points at '$found', not $dest/doctest/include" >&2
  exit 1
fi

# cudnn-frontend's headers (CudnnSdpa): installed into build/cudnn_frontend by the project's script,
# copied beside doctest. Without them the device build leaves CudnnSdpa out (and says so).
frontend=""
if "$root/cmake/install_cudnn_frontend.sh" "$root/build/cudnn_frontend" >&2; then
  rm -rf "$dest/cudnn_frontend"
  cp -r "$root/build/cudnn_frontend" "$dest/cudnn_frontend"
  frontend="cudnn-frontend $(cat "$dest/cudnn_frontend/VERSION")"
else
  echo "prepare.sh: no cudnn-frontend: the device run will not build CudnnSdpa" >&2
fi

# Dry run of the device run's pieces here, where there is no GPU: the scripts parse, and every program the
# run calls refuses cleanly (exit 77, "no CUDA device") rather than failing. The programs come from a build
# folder (SEQPAR_DRY_BUILD, default build/release), brought up to date first with the device run's own target
# list (run.sh's build stage): a program built from an older tree would dry-run old code (a stale
# attention_cuda once failed here on --compare, which the tree had). SEQPAR_DRY_NO_BUILD=1 skips the build
# and tries what is there. The Python pieces run with SEQPAR_PYTHON (default: the project's venv, which
# make test installs, else python3; a torch without a GPU, or no torch, both skip).
python=${SEQPAR_PYTHON:-}
if [[ -z $python ]]; then
  python=python3
  [[ -x $root/build/venv/bin/python ]] && python=$root/build/venv/bin/python
fi
dry_build=${SEQPAR_DRY_BUILD:-$root/build/release}
dry_fail=0
# shellcheck source=bench/device/targets.sh
source "$root/bench/device/targets.sh"  # device_targets: run.sh's build stage's list
if [[ -f $dry_build/build.ninja && ${SEQPAR_DRY_NO_BUILD:-0} != 1 ]]; then
  mapfile -t dry_targets < <(device_targets "$dry_build")
  if ((${#dry_targets[@]} > 0)); then
    echo "prepare.sh: dry run: building ${#dry_targets[@]} device targets in $dry_build (ninja; up to date is quick)"
    nice -n 10 ninja -C "$dry_build" "${dry_targets[@]}" >"$check/dry_build.log" 2>&1 || {
      echo "prepare.sh: dry run: the device targets do not build here:" >&2
      tail -n 30 "$check/dry_build.log" >&2
      exit 1
    }
  fi
fi
expect_skip() {  # expect_skip NAME CMD...: exit 0 or 77 is clean, anything else is not
  local rc=0
  "${@:2}" >"$check/$1.log" 2>&1 || rc=$?
  if [[ $rc -eq 77 || $rc -eq 0 ]]; then
    echo "prepare.sh: dry run: $1: exit $rc ($(tail -n 1 "$check/$1.log" | cut -c1-120))"
  else
    echo "prepare.sh: dry run: $1: exit $rc, not a clean refusal:" >&2
    tail -n 20 "$check/$1.log" >&2
    dry_fail=1
  fi
}
bash -n "$root/bench/device/run.sh" || dry_fail=1
"$python" -m py_compile "$root/bench/device/torch_peers.py" "$root/bench/device/torch_op_cuda.py" || dry_fail=1
expect_skip torch_peers_dry "$python" "$root/bench/device/torch_peers.py" --dry-run --smoke
expect_skip torch_peers_mla_dry "$python" "$root/bench/device/torch_peers.py" --dry-run --smoke --mla
expect_skip torch_op_cuda env PYTHONPATH="$root/python" "$python" "$root/bench/device/torch_op_cuda.py"
# Every GPU program the run calls: the CUDA/NCCL test executables (ctest -L 'cuda|nccl' and the sanitizer
# passes run them), then the benchmarks with the run's arguments.
for exe in "$dry_build"/tests/seqpar_test_* "$dry_build"/tests/seqpar_tests_nccl; do
  [[ -x $exe ]] || continue
  expect_skip "$(basename "$exe")" "$exe"
done
for exe in bench/attention_cuda bench/runtime_cuda bench/transport_nccl; do
  [[ -x $dry_build/$exe ]] || continue
  expect_skip "$(basename "$exe")" "$dry_build/$exe" --json "$check/$(basename "$exe").json"
done
[[ -x $dry_build/bench/attention_cuda ]] && expect_skip attention_compare "$dry_build/bench/attention_cuda" --smoke --compare
[[ -x $dry_build/bench/attention_cuda ]] && expect_skip attention_cuda_smoke "$dry_build/bench/attention_cuda" --smoke
if ((dry_fail)); then
  echo "prepare.sh: the dry run found a script or program that does not refuse cleanly without a GPU" >&2
  exit 1
fi

cat >"$dest/README" <<EOF
Made by bench/device/prepare.sh on $(hostname) at $(date -u +%FT%TZ); carried to the GPU machine by the
device tool (carry: build/device_carry). doctest from $header and $package. ${frontend:-no cudnn-frontend}.
EOF
echo "prepare.sh: $dest ready ($(du -sh "$dest" | cut -f1)); pass carry: [\"${dest#"$root"/}\"] to the device run"
