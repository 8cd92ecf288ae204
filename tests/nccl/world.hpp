// SPDX-License-Identifier: Apache-2.0
// The NCCL world the test cases of tests/nccl/test_nccl.cpp run on, made once per process by
// tests/nccl/main.cpp (a world of one rank, or the ranks of mpirun, or of a file-store bootstrap).
#pragma once

#include <seqpar/backend/nccl.hpp>

namespace seqpar::test {

/// This process's rank of the NCCL world (every rank runs every test case, in the same order).
backend::nccl::Transport& nccl_world();

}  // namespace seqpar::test
