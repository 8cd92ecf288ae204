# SPDX-License-Identifier: Apache-2.0
# shellcheck shell=bash
# Sourced by run.sh (the GPU run's build stage) and prepare.sh (its dry run here): the one list of what
# the device run builds, so that the dry run tries exactly the programs the GPU run will.
#   device_targets BUILD_DIR   prints the device targets that BUILD_DIR's ninja files define, one a line
device_targets() {
  ninja -C "$1" -t targets all 2>/dev/null | sed -n 's/^\([A-Za-z0-9_]*\): .*/\1/p' |
    grep -E '^(seqpar_test_[A-Za-z0-9_]+|seqpar_tests_cuda_host|seqpar_tests_nccl|seqpar_tests_nccl_host|attention_cuda|runtime_cuda|transport_nccl|07_nccl_ring)$' |
    sort -u
}
