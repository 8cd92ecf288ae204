// SPDX-License-Identifier: Apache-2.0
// Jobs in which one rank fails: each must end (non-zero exit) with "seqpar: rank R failed: ..." on
// stderr instead of its other ranks hanging. The mode (argv[1]) says how:
//  - throw (default): rank 1 throws inside run_or_abort while rank 0 waits for it in a receive;
//  - never-constructs: rank 1 never enters run_or_abort; rank 0's transport construction (collective
//    over the communicator) must time out instead of hanging in MPI_Comm_dup;
//  - never-calls: rank 1 enters run_or_abort but never calls; rank 0's forward times out with threads
//    of ours alive (a CpuFlash pool of 4 threads, a plan_ahead planning thread) that must not keep
//    the process, or the job, alive after MPI_Abort.
// Run by tests/mpi/expect_abort.cmake (throw) and tests/mpi/abort_under_load.sh (the others, beside
// busy-loop load processes), which check the exit code, the message and the time the job took.
#include <seqpar/backend/mpi.hpp>
#include <seqpar/seqpar.hpp>

#include <chrono>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {
[[noreturn]] void never_call() {
  for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
}
}  // namespace

int main(int argc, char** argv) {
  namespace mpi = seqpar::backend::mpi;
  mpi::Environment env(argc, argv);
  const std::string mode = argc > 1 ? argv[1] : "throw";
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  mpi::Transport::Options options;
  options.timeout = std::chrono::seconds(2);
  if (mode == "never-constructs") {
    if (rank == 1) never_call();
    return mpi::run_or_abort(
        MPI_COMM_WORLD, [](mpi::Transport&) { return 0; }, options);
  }
  if (mode == "never-calls") {
    return mpi::run_or_abort(
        MPI_COMM_WORLD,
        [](mpi::Transport& t) {
          if (t.rank() == 1) never_call();
          using Ring = seqpar::Strategy<seqpar::partition::Zigzag, seqpar::comm::Ring>;
          const seqpar::AttentionShape shape{4, 2, 16};
          seqpar::DistributedAttention<Ring, seqpar::attention::CpuFlash<float>> attn(
              t, shape, {}, seqpar::attention::CpuFlash<float>({.threads = 4}));
          const seqpar::DocumentBatch batch({{96, 32}});
          attn.plan_ahead(seqpar::DocumentBatch({{100'000, 50'000, 30'000}}));  // a planning thread, in flight
          seqpar::AttentionTensors<float> l(attn.local_tokens(batch), shape);
          attn.forward(batch, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view());  // times out
          return 0;
        },
        options);
  }
  return mpi::run_or_abort(MPI_COMM_WORLD, [](mpi::Transport& t) {
    std::vector<std::byte> b(16);
    if (t.rank() == 1) throw std::runtime_error("injected failure mid-run");
    t.recv(b, 1, 0);  // never satisfied: rank 1 failed; MPI_Abort ends this rank
    return 0;
  });
}
