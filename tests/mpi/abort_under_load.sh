#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# abort_under_load.sh MPIEXEC NPFLAG EXE MODE BOUND_S [LOADS]
# Runs `EXE MODE` on 2 processes beside LOADS busy-loop processes (default 4) and passes when the job
# ends within BOUND_S seconds with a non-zero exit and "seqpar: rank 0 failed" in its output: after
# MPI_Abort nothing of ours (a thread, a collective without a deadline) may keep it alive, even when
# the CPU is oversubscribed. A job that has not ended after 3 x BOUND_S is killed and fails the test.
set -u
mpiexec=$1 npflag=$2 exe=$3 mode=$4 bound=$5 loads=${6:-4}
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; }
trap cleanup EXIT
for _ in $(seq "$loads"); do
  (while :; do :; done) &
  pids+=($!)
done
start=$(date +%s.%N)
out=$(timeout -k 5 $((3 * bound)) "$mpiexec" "$npflag" 2 "$exe" "$mode" 2>&1)
rc=$?
elapsed=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
printf '%s\n' "$out"
echo "abort_under_load: mode $mode: exit $rc after ${elapsed} s (bound ${bound} s, $loads busy loops beside)"
fail() { echo "abort_under_load: FAILED: $*" >&2; exit 1; }
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then fail "the job did not end (killed after $((3 * bound)) s)"; fi
[ "$rc" -ne 0 ] || fail "the job exited 0; a failing rank must end it with a non-zero exit"
printf '%s' "$out" | grep -q "seqpar: rank 0 failed: .*timed out" || fail "no 'seqpar: rank 0 failed: ... timed out' in the output"
awk -v e="$elapsed" -v b="$bound" 'BEGIN { exit !(e <= b) }' || fail "the job took ${elapsed} s, over the bound of ${bound} s"
echo "abort_under_load: passed"
