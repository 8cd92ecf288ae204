// SPDX-License-Identifier: Apache-2.0
// Main of the NCCL tests: one process per GPU.
//  - Without a CUDA device: skipped (exit 77).
//  - Launched by mpirun (built with seqpar::mpi): the ranks of MPI_COMM_WORLD, each on GPU (local rank
//    % GPUs), the NCCL world bootstrapped over the MPI transport; skipped on every rank when a node has
//    more ranks than GPUs (NCCL refuses two ranks on one GPU). The exit code is non-zero on every rank
//    if a check failed on any rank; only rank 0 prints the summary unless SEQPAR_NCCL_TEST_VERBOSE is set.
//  - Otherwise a world of one rank, or, with SEQPAR_NCCL_STORE=<path> SEQPAR_NCCL_RANK=<r>
//    SEQPAR_NCCL_SIZE=<n>, the ranks of a file-store bootstrap (processes started by hand).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <seqpar/backend/nccl.hpp>
#if SEQPAR_ENABLE_MPI
#include <seqpar/backend/mpi.hpp>
#endif

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>

#include "nccl/world.hpp"
#include "seqpar/gpu/check.hpp"

namespace {

using seqpar::backend::nccl::Transport;
std::unique_ptr<Transport> g_world;

constexpr seqpar::backend::nccl::Options kOptions{.timeout = std::chrono::seconds{60}};

[[maybe_unused]] bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE"})
    if (std::getenv(v) != nullptr) return true;
  return false;
}

int run_doctest(int argc, char** argv, bool quiet) {
  doctest::Context context;
  context.applyCommandLine(argc, argv);
  if (quiet) {
    context.setOption("minimal", true);
    context.setOption("no-colors", true);
  }
  return context.run();
}

int skip(const char* why) {
  std::printf("%s: the NCCL tests are skipped\n", why);
  return 77;
}

}  // namespace

seqpar::backend::nccl::Transport& seqpar::test::nccl_world() {
  return *g_world;
}

int main(int argc, char** argv) {
  const int devices = seqpar::gpu::device_count();
#if SEQPAR_ENABLE_MPI
  if (launched_by_mpi()) {
    seqpar::backend::mpi::Environment env(argc, argv);
    seqpar::backend::mpi::Transport host(MPI_COMM_WORLD, {.timeout = std::chrono::seconds{60}});
    MPI_Comm node = MPI_COMM_NULL;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
    int local = 0, local_size = 1;
    MPI_Comm_rank(node, &local);
    MPI_Comm_size(node, &local_size);
    MPI_Comm_free(&node);
    int unable = devices == 0 || local_size > devices ? 1 : 0, any = 0;
    MPI_Allreduce(&unable, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (any != 0) {
      if (host.rank() == 0) std::printf("%d ranks on a node with %d CUDA devices\n", local_size, devices);
      return skip("not one GPU per rank");
    }
    SEQPAR_CUDA_CHECK(cudaSetDevice(local % devices), "tests/nccl main");
    g_world = std::make_unique<Transport>(Transport::bootstrap(host, kOptions));
    const int result = run_doctest(argc, argv, host.rank() != 0 && std::getenv("SEQPAR_NCCL_TEST_VERBOSE") == nullptr);
    int failed = result != 0 ? 1 : 0, worst = 0;
    MPI_Allreduce(&failed, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    g_world.reset();
    if (worst != 0 && host.rank() == 0) std::fprintf(stderr, "seqpar_tests_nccl: a test failed on at least one rank\n");
    return worst != 0 ? 1 : 0;
  }
#endif
  if (devices == 0) return skip("no CUDA device (or driver) on this machine");
  const char* store = std::getenv("SEQPAR_NCCL_STORE");
  if (store != nullptr) {
    const int rank = std::atoi(std::getenv("SEQPAR_NCCL_RANK") ? std::getenv("SEQPAR_NCCL_RANK") : "0");
    const int size = std::atoi(std::getenv("SEQPAR_NCCL_SIZE") ? std::getenv("SEQPAR_NCCL_SIZE") : "1");
    SEQPAR_CUDA_CHECK(cudaSetDevice(rank % devices), "tests/nccl main");
    seqpar::backend::nccl::FileStore file(store, kOptions.timeout);
    g_world = std::make_unique<Transport>(Transport::bootstrap(file, rank, size, kOptions));
  } else {
    g_world = std::make_unique<Transport>(Transport::single(kOptions));
  }
  const int result = run_doctest(argc, argv, false);
  g_world.reset();
  return result;
}
