#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The device run of the CUDA path: one call on the GPU machine (H100 or H200, 16 cores), under 8 minutes.
#   bench/device/run.sh OUTDIR
# Configures a Release build for sm_90a only in build/device, builds the CUDA targets (the tests
# tests/cuda/test_*, tests/cudnn/test_* (CudnnSdpa, when cuDNN is found), the CPU side
# seqpar_tests_cuda_host, the benches attention_cuda (CudaFlash and CudnnSdpa) and runtime_cuda), runs `ctest -L cuda`, attention_cuda --json, torch_peers.py beside
# it, runtime_cuda --json, a compute-sanitizer memcheck of attention_cuda --smoke and, with time left,
# racecheck of the same and memcheck of the test executables. For CudnnSdpa (issue 38), right after the
# build: cudnn-frontend's log of the engines cuDNN picks and of the graph cache over ten document mixes,
# and memcheck of its test's cases near the views' ends; after the benches: attention_cuda --compare
# (CudnnSdpa against CudaFlash, forward and backward, GQA, a window, 192/128), torch's peers at 192/128,
# and the torch extension built with SEQPAR_TORCH_CUDA=1 and run on one process with each kernel choice
# (bench/device/torch_op_cuda.py). Their JSON goes in logs.tar.gz. Every stage runs under `timeout` inside
# one time budget, the build and the tests leaving time for the benchmarks; a failed stage is recorded
# and the next still runs.
#
# OUTDIR receives at most 6 files (the device tool brings back 8): summary.txt (also printed at the
# end), summary.json, attention_cuda.json, torch_peers.json, runtime_cuda.json, logs.tar.gz (every
# stage's log, the token mixes, ctest's JUnit report; rewritten after each stage).
# Exit status: 0 all passed; 1 configure, build, a test or a sanitizer failed; 2 only a benchmark or
# the peers failed.
#
# Needs build/device_carry from bench/device/prepare.sh (doctest and cudnn-frontend; the GPU machine has
# neither), passed in the device tool's `carry`. Without it the tests are not built (recorded) and the benches still run.
# Environment (all optional): SEQPAR_DEVICE_BUDGET_S (whole run, default 470), SEQPAR_DEVICE_JOBS
# (default nproc), SEQPAR_DEVICE_BUILD (default build/device), SEQPAR_DEVICE_CARRY (default
# build/device_carry), SEQPAR_DEVICE_TARGETS (space-separated: build only these), SEQPAR_DEVICE_ARCH
# (default 90a).
set -uo pipefail  # no -e: a failing stage is recorded, the run goes on

if [[ $# -ne 1 ]]; then
  echo "usage: $0 OUTDIR" >&2
  exit 64
fi
root=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=bench/device/targets.sh
source "$root/bench/device/targets.sh"  # device_targets: what the build stage builds
mkdir -p "$1" && out=$(cd "$1" && pwd) || exit 64
build=${SEQPAR_DEVICE_BUILD:-$root/build/device}
carry=${SEQPAR_DEVICE_CARRY:-$root/build/device_carry}
budget=${SEQPAR_DEVICE_BUDGET_S:-470}
jobs=${SEQPAR_DEVICE_JOBS:-$(nproc)}
arch=${SEQPAR_DEVICE_ARCH:-90a}
logs=$(mktemp -d /tmp/seqpar_device_logs.XXXXXX)
start=$SECONDS
cd "$root" || exit 64

names=() states=() secs=()
failed_hard=0 failed_bench=0

pack_logs() {  # logs.tar.gz is rewritten after each stage: a run cut short still brings its logs back
  tar -C "$logs" -czf "$out/logs.tar.gz.tmp" . 2>/dev/null && mv -f "$out/logs.tar.gz.tmp" "$out/logs.tar.gz"
}

elapsed() { printf '%d:%02d' $(((SECONDS - start) / 60)) $(((SECONDS - start) % 60)); }

# stage NAME KIND LIMIT_S CMD...: KIND hard (counts as a failure), bench (a benchmark) or optional
# (a timeout is no failure). The limit shrinks to what the budget has left, less 20 s for the end and
# less $reserve seconds kept for the stages after it (`reserve=N stage ...`).
stage() {
  local name=$1 kind=$2 limit=$3
  shift 3
  local left=$((budget - (SECONDS - start) - 20 - ${reserve:-0}))
  if ((left < 10)); then
    names+=("$name") states+=("not run: time budget spent") secs+=(0)
    echo "[$(elapsed)] $name: not run (time budget spent)"
    [[ $kind == hard ]] && failed_hard=1
    return 124
  fi
  ((limit > left)) && limit=$left
  local cmd="$*"
  cmd=${cmd//$'\n'/; }
  echo "[$(elapsed)] $name (limit ${limit}s): ${cmd:0:200}"
  local t0=$SECONDS rc state
  timeout --kill-after=10 "$limit" "$@" >"$logs/$name.log" 2>&1
  rc=$?
  case $rc in
    0) state="ok" ;;
    77) state="skipped (exit 77: no CUDA device or no torch)" ;;
    124 | 137) state="TIMEOUT after ${limit}s" ;;
    *) state="FAILED (exit $rc)" ;;
  esac
  if [[ $rc -ne 0 && $rc -ne 77 ]]; then
    case $kind in
      hard) failed_hard=1 ;;
      bench) failed_bench=1 ;;
      optional) [[ $rc -ne 124 && $rc -ne 137 ]] && failed_hard=1 ;;  # an error found, not a timeout
    esac
    echo "  --- last lines of $name.log ---"
    tail -n 15 "$logs/$name.log" | cut -c1-300 | sed 's/^/  | /'
  fi
  names+=("$name") states+=("$state") secs+=($((SECONDS - t0)))
  echo "[$(elapsed)] $name: $state"
  pack_logs
  return $rc
}

skip() {  # skip NAME REASON
  names+=("$1") states+=("not run: $2") secs+=(0)
  echo "[$(elapsed)] $1: not run ($2)"
}

# ---- 0. the machine ---------------------------------------------------------------------------------
if ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
stage env optional 30 bash -c '
  set -x
  uname -a; nproc; free -g | head -2
  nvidia-smi || true
  nvcc --version; cmake --version | head -1; ninja --version; g++ --version | head -1
  python3 -c "import torch; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"cudnn\", torch.backends.cudnn.version(), torch.cuda.is_available())" || true
  command -v compute-sanitizer ncu || true
  ls -d /usr/local/cuda*/include/nccl.h /usr/include/nccl.h /usr/include/cudnn*.h /usr/local/cuda*/include/cudnn*.h 2>/dev/null
  python3 -c "import nvidia, os; print(\"python nvidia packages:\", sorted(os.listdir(list(nvidia.__path__)[0])))" || true
  git -C "'"$root"'" log -1 --format="%H %s" || true
  git -C "'"$root"'" status --short | head -40 || true'

# ---- 1. configure -----------------------------------------------------------------------------------
tests=ON
doctest_flags=()
if [[ -f $carry/doctest/lib/cmake/doctest/doctestConfig.cmake ]]; then
  doctest_flags=(-Ddoctest_DIR="$carry/doctest/lib/cmake/doctest")
elif [[ ! -f /usr/include/doctest/doctest.h ]]; then
  tests=OFF  # tests/CMakeLists.txt needs doctest: build the benches at least
  echo "no doctest (run bench/device/prepare.sh here and carry build/device_carry): the tests are not built"
fi
# NCCL: the toolkit's, else the one PyTorch's wheels bring (nvidia-nccl-cu13: nccl.h and libnccl.so.2,
# no libnccl.so for find_library), behind a folder of links that NCCL_ROOT names.
nccl_flags=()
cuda_home=$(dirname "$(dirname "$(command -v nvcc)")")
if [[ ! -f $cuda_home/include/nccl.h && ! -f /usr/include/nccl.h ]]; then
  nccl_py=$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)
  if [[ -n $nccl_py && -f $nccl_py/include/nccl.h ]]; then
    nccl_lib=$(ls "$nccl_py"/lib/libnccl.so* 2>/dev/null | head -n 1)
    mkdir -p /tmp/seqpar_nccl/lib && ln -sfn "$nccl_py/include" /tmp/seqpar_nccl/include &&
      ln -sf "$nccl_lib" /tmp/seqpar_nccl/lib/libnccl.so
    export LD_LIBRARY_PATH=$nccl_py/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    nccl_flags=(-DNCCL_ROOT=/tmp/seqpar_nccl)
    echo "NCCL from PyTorch's wheel: $nccl_py ($nccl_lib)"
  else
    echo "no NCCL found (toolkit or nvidia-nccl wheel): the NCCL transport is not built"
  fi
fi
# cuDNN (CudnnSdpa): the toolkit's or the system's, else PyTorch's wheel (nvidia-cudnn-cu13: cudnn.h and
# libcudnn.so.9), behind a folder of links that CUDNN_ROOT names; cudnn-frontend's headers come in the
# carry (prepare.sh: $carry/cudnn_frontend).
cudnn_flags=()
if [[ -f $carry/cudnn_frontend/include/cudnn_frontend.h ]]; then
  cudnn_flags=(-DCUDNN_FRONTEND_ROOT="$carry/cudnn_frontend")
  if [[ ! -f $cuda_home/include/cudnn.h && ! -f /usr/include/cudnn.h ]]; then
    cudnn_py=$(python3 -c 'import nvidia.cudnn as m; print(list(m.__path__)[0])' 2>/dev/null)
    if [[ -n $cudnn_py && -f $cudnn_py/include/cudnn.h ]]; then
      cudnn_lib=$(ls "$cudnn_py"/lib/libcudnn.so* 2>/dev/null | head -n 1)
      mkdir -p /tmp/seqpar_cudnn/lib && ln -sfn "$cudnn_py/include" /tmp/seqpar_cudnn/include &&
        ln -sf "$cudnn_lib" /tmp/seqpar_cudnn/lib/libcudnn.so
      export LD_LIBRARY_PATH=$cudnn_py/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
      cudnn_flags+=(-DCUDNN_ROOT=/tmp/seqpar_cudnn)
      echo "cuDNN from PyTorch's wheel: $cudnn_py ($cudnn_lib)"
    else
      echo "no cuDNN found (toolkit, system or nvidia-cudnn wheel): CudnnSdpa is not built"
    fi
  fi
else
  echo "no cudnn-frontend in $carry (run bench/device/prepare.sh): CudnnSdpa is not built"
fi
# MPI, the examples, the tools, the header checks and the install rules are not needed here (and MPI
# may be half-installed on the GPU image); CUDA is required, for sm_90a only (one pass per kernel).
stage configure hard 120 cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_ARCHITECTURES="$arch" -DSEQPAR_ENABLE_CUDA=ON -DSEQPAR_ENABLE_MPI=OFF \
  -DSEQPAR_BUILD_TESTS=$tests -DSEQPAR_BUILD_BENCH=ON -DSEQPAR_BUILD_EXAMPLES=ON -DSEQPAR_BUILD_TOOLS=OFF \
  -DSEQPAR_VERIFY_HEADERS=OFF -DSEQPAR_INSTALL=OFF "${doctest_flags[@]}" "${nccl_flags[@]}" "${cudnn_flags[@]}"
configured=$?
[[ $tests == OFF ]] && failed_hard=1

# ---- 2. build -----------------------------------------------------------------------------------------
targets=()
if [[ $configured -eq 0 ]]; then
  if [[ -n ${SEQPAR_DEVICE_TARGETS:-} ]]; then
    read -r -a targets <<<"$SEQPAR_DEVICE_TARGETS"
  else
    mapfile -t targets < <(device_targets "$build")
  fi
  echo "targets: ${targets[*]:-none}"
  if ((${#targets[@]} > 0)); then
    # -k 0: one target that does not compile leaves the others built and run.
    # Keeps 60 s for the tests and 130 s for the benchmarks, whatever the build takes.
    reserve=190 stage build hard 300 ninja -C "$build" -j "$jobs" -k 0 "${targets[@]}"
  else
    failed_hard=1
    skip build "no CUDA target found"
  fi
else
  skip build "configure failed"
fi
bench_exe() { for p in "$build/bench/$1" "$build/$1"; do [[ -x $p ]] && echo "$p" && return; done; }

# ---- 2b. CudnnSdpa first (issue 38; the review of 2026-12-06, "does not yet cover" 1, 2, 8) --------------
# The cuDNN and frontend versions, and which engine (UNIFIED or COMPOSITE) cuDNN picks per mask: cudnn-
# frontend's own log of the graph-cache test (ten document mixes: graphs built, build time, workspace) and
# of the refusal test (versions and the deterministic gate); then memcheck of the CudnnSdpa test on the
# cases that read near the views' ends (a NaN-poisoned tail, A3's offsets, one-row documents), the only
# check that sees a read past a view.
cudnn_test=$build/tests/seqpar_test_cudnn_sdpa
if [[ -x $cudnn_test ]]; then
  stage cudnn_record optional 90 env CUDNN_FRONTEND_LOG_INFO=1 CUDNN_FRONTEND_LOG_FILE="$logs/cudnn_frontend.log" \
    "$cudnn_test" -tc='*graph cache*,*refuses bad input*'
  # The engine choices in a few lines (the full log stays in logs.tar.gz).
  if [[ -f $logs/cudnn_frontend.log ]]; then
    grep -ioE '(implementation|engine|heuristic|cudnn_backend_version|cudnn version)[^,;]{0,80}' \
      "$logs/cudnn_frontend.log" | sort | uniq -c | sort -rn | head -n 40 >"$logs/cudnn_engines.txt"
    gzip -f "$logs/cudnn_frontend.log"
  fi
  if command -v compute-sanitizer >/dev/null; then
    stage memcheck_cudnn optional 150 compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 \
      "$cudnn_test" -tc='*NaN past the views*,*layouts*'
  else
    skip memcheck_cudnn "no compute-sanitizer"
  fi
else
  skip cudnn_record "seqpar_test_cudnn_sdpa not built (no cuDNN or cudnn-frontend)"
fi

# ---- 3. the CUDA tests ----------------------------------------------------------------------------------
if [[ $configured -eq 0 && $tests == ON ]]; then
  # -j 4: the tests share the one GPU; they are independent processes. Label regex cuda also selects
  # cuda_host and the CUDA benches' smoke cases (bench_smoke.attention_cuda).
  reserve=130 stage ctest hard 180 ctest --test-dir "$build" -L 'cuda|nccl' --output-on-failure -j 4 \
    --output-junit "$logs/ctest_junit.xml"
else
  skip ctest "tests not configured"
fi

# ---- 4. the benchmarks and the peers (before the sanitizers: a slow build must not cost them) -------------
attention=$(bench_exe attention_cuda)
if [[ -n $attention ]]; then
  stage attention_cuda bench 120 "$attention" --json "$out/attention_cuda.json" --mixes-out "$logs/mixes.json"
else
  failed_bench=1
  skip attention_cuda "not built"
fi
# CudnnSdpa against CudaFlash on identical inputs at the bench sizes, forward and backward: MHA, GQA 4:1, d 64
# and 128, a window of 4096 on 1 x 16K, MLA's 192/128 (issue 38; its JSON goes in logs.tar.gz).
if [[ -n $attention ]]; then
  stage attention_compare bench 100 "$attention" --compare --json "$logs/attention_compare.json"
fi
peers_args=(--json "$out/torch_peers.json")
[[ -f $logs/mixes.json ]] && peers_args+=(--mixes "$logs/mixes.json")
[[ -f $out/attention_cuda.json ]] && peers_args+=(--compare "$out/attention_cuda.json")
stage torch_peers bench 150 env PYTHONUNBUFFERED=1 python3 "$root/bench/device/torch_peers.py" "${peers_args[@]}"
# torch's SDPA backends at MLA's 192/128 beside the compare table's CudnnSdpa and CudaFlash at 192/128.
stage torch_peers_mla bench 60 env PYTHONUNBUFFERED=1 python3 "$root/bench/device/torch_peers.py" --mla \
  --backends flash,cudnn --reps 5 --json "$logs/torch_peers_mla.json"

# ---- 4b. the torch op's CUDA path (issue 38): the extension built with SEQPAR_TORCH_CUDA=1 for this GPU,
# then one process over NCCL with each kernel choice ("auto", "flash", "cudnn", "seqpar") against float64.
if python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  reserve=60 stage torch_ext_build optional 240 env -C "$root/python" SEQPAR_TORCH_CUDA=1 SEQPAR_CUDA_ARCHS="$arch" \
    SEQPAR_EXTENSIONS=seqpar._C MAX_JOBS="$jobs" python3 setup.py --quiet build_ext --inplace
  if [[ $? -eq 0 ]]; then
    stage torch_op_cuda hard 90 env PYTHONPATH="$root/python" PYTHONUNBUFFERED=1 \
      python3 "$root/bench/device/torch_op_cuda.py" --json "$logs/torch_op_cuda.json"
  else
    skip torch_op_cuda "the extension did not build"
  fi
else
  skip torch_ext_build "no torch with CUDA on this machine"
fi

runtime=$(bench_exe runtime_cuda)
if [[ -n $runtime ]]; then
  stage runtime_cuda bench 120 "$runtime" --json "$out/runtime_cuda.json"
else
  skip runtime_cuda "no runtime_cuda target or not built"
fi
nccl_bench=$(bench_exe transport_nccl)
if [[ -n $nccl_bench ]]; then
  stage transport_nccl bench 90 "$nccl_bench" --json "$out/transport_nccl.json"
else
  skip transport_nccl "not built (SEQPAR_ENABLE_NCCL)"
fi

# ---- 5. memcheck of the kernels on the smoke shapes ---------------------------------------------------------
if [[ -n $attention ]] && command -v compute-sanitizer >/dev/null; then
  stage memcheck_smoke optional 90 compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 \
    "$attention" --smoke
else
  skip memcheck_smoke "no attention_cuda or no compute-sanitizer"
fi

# ---- 6. with time left: racecheck of the smoke shapes, memcheck of the test executables --------------------
if [[ -n $attention ]] && command -v compute-sanitizer >/dev/null; then
  stage racecheck_smoke optional 90 compute-sanitizer --tool racecheck --error-exitcode 99 --print-limit 20 \
    "$attention" --smoke
  for exe in "$build"/tests/seqpar_test_*; do
    [[ -x $exe ]] || continue
    stage "memcheck_$(basename "$exe")" optional 90 compute-sanitizer --tool memcheck --error-exitcode 99 \
      --print-limit 20 "$exe"
  done
fi

# ---- summary --------------------------------------------------------------------------------------------
{
  echo "seqpar device run: $(date -u +%FT%TZ), $(hostname), $(elapsed) of a ${budget}s budget"
  printf '%-34s %6s  %s\n' stage seconds status
  for i in "${!names[@]}"; do printf '%-34s %6s  %s\n' "${names[$i]}" "${secs[$i]}" "${states[$i]}"; done
  if [[ -f $logs/build.log ]] && grep -q 'FAILED:' "$logs/build.log"; then
    echo
    echo "--- build: failed targets and first errors ---"
    grep -E '^FAILED:' "$logs/build.log" | cut -c1-200 | head -n 10
    grep -E 'error' "$logs/build.log" | grep -v '^FAILED:' | cut -c1-300 | head -n 20
  fi
  if [[ -f $logs/ctest.log ]]; then
    echo
    grep -E 'tests passed|tests failed|\*\*\*(Failed|Skipped|Not Run|Timeout)|Not Run|Total Test time' \
      "$logs/ctest.log" | tail -n 25
  fi
  if [[ -f $logs/cudnn_engines.txt ]]; then
    echo
    echo "--- cuDNN engines and versions (cudnn-frontend's log, counted) ---"
    head -n 20 "$logs/cudnn_engines.txt" | cut -c1-200
  fi
  for name in cudnn_record attention_compare torch_op_cuda attention_cuda torch_peers runtime_cuda; do
    [[ -f $logs/$name.log ]] || continue
    echo
    echo "--- $name (tail) ---"
    tail -n 45 "$logs/$name.log" | cut -c1-200
  done
} >"$out/summary.txt"
python3 - "$out/summary.json" "$failed_hard" "$failed_bench" "${names[@]}" -- "${states[@]}" <<'EOF' || true
import json, sys
path, hard, bench, rest = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
cut = rest.index("--")
stages = [{"stage": n, "status": s} for n, s in zip(rest[:cut], rest[cut + 1:])]
json.dump({"failed_hard": hard == "1", "failed_bench": bench == "1", "stages": stages}, open(path, "w"), indent=1)
EOF
pack_logs
rm -rf "$logs"
echo
cat "$out/summary.txt"
if ((failed_hard)); then exit 1; fi
if ((failed_bench)); then exit 2; fi
exit 0
