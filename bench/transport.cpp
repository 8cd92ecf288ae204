// SPDX-License-Identifier: Apache-2.0
// Transport micro-benchmark: latency and bandwidth of all_to_all and of a ring step (every rank
// sends S bytes to rank+1 and receives S bytes from rank-1 with isend/irecv) for per-rank message
// sizes S from 4 KiB to 64 MiB.
//  - compiled plain: the in-process world on 2, 4 and 8 threads (bench_smoke.transport);
//  - compiled with SEQPAR_BENCH_MPI=1 (target transport_mpi): MPI_COMM_WORLD, launched with
//    `mpiexec -n P transport_mpi` (bench_smoke.transport_mpi runs -n 2).
// Timing: each repetition starts after a barrier; a repetition's time is the slowest rank's; the
// figure is the best repetition (best-of-N, N from 50 for small sizes down to 5 for 64 MiB).
// gb_per_s = S / seconds: the bytes one rank sends (for all_to_all including the block to itself).
//   usage: transport [--smoke] [--json FILE] [--max-bytes B]
#include <seqpar/seqpar.hpp>
#if SEQPAR_BENCH_MPI
#include <seqpar/backend/mpi.hpp>
#endif

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "support/json.hpp"

namespace {

struct Result {
  std::string op;
  int ranks = 0;
  std::size_t bytes = 0;
  double seconds = 0;
};

struct Config {
  bool smoke = false;
  std::size_t max_bytes = std::size_t{64} << 20;
};

std::vector<std::size_t> sizes(const Config& c) {
  std::vector<std::size_t> s;
  for (std::size_t b = 4096; b <= (c.smoke ? std::size_t{65536} : c.max_bytes); b *= 4) s.push_back(b);
  return s;
}

int repetitions(std::size_t bytes, bool smoke) {
  if (smoke) return 3;
  return static_cast<int>(std::clamp<std::size_t>((std::size_t{256} << 20) / bytes, 5, 50));
}

// Runs `op` `reps` times on every rank of `t`; returns the best over repetitions of the slowest rank.
template <seqpar::Transport T, class Op>
double best_of(T& t, int reps, Op&& op) {
  for (int i = 0; i < 3; ++i) op();  // warm-up: first touch of the buffers, shared-memory connection set-up
  double best = std::numeric_limits<double>::infinity();
  std::vector<double> all(static_cast<std::size_t>(t.size()));
  for (int i = 0; i < reps; ++i) {
    t.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    op();
    const double mine = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    t.all_gather(seqpar::as_bytes_of(std::span<const double>(&mine, 1)),
                 seqpar::as_writable_bytes_of(std::span<double>(all)));
    best = std::min(best, *std::max_element(all.begin(), all.end()));
  }
  return best;
}

// Every size, both operations, on this rank's transport; rank 0's copy of the results is complete.
template <seqpar::Transport T>
std::vector<Result> measure(T& t, const Config& c) {
  std::vector<Result> out;
  const int n = t.size(), me = t.rank();
  for (std::size_t bytes : sizes(c)) {
    const std::size_t rounded = bytes / static_cast<std::size_t>(n) * static_cast<std::size_t>(n);
    std::vector<std::byte> s(rounded, std::byte{1}), r(rounded);
    const int reps = repetitions(bytes, c.smoke);
    const double a2a = best_of(t, reps, [&] { t.all_to_all(std::span<const std::byte>(s), std::span<std::byte>(r)); });
    out.push_back({"all_to_all", n, rounded, a2a});
    std::vector<std::byte> ring_s(bytes, std::byte{2}), ring_r(bytes);
    const int next = (me + 1) % n, prev = (me + n - 1) % n;
    const double ring = best_of(t, reps, [&] {
      auto rq = t.irecv(std::span<std::byte>(ring_r), prev, 1);
      auto sq = t.isend(std::span<const std::byte>(ring_s), next, 1);
      t.wait(rq);
      t.wait(sq);
    });
    out.push_back({"ring_step", n, bytes, ring});
  }
  return out;
}

void print(const char* transport, const std::vector<Result>& results) {
  std::printf("%-8s %-11s %5s %10s %12s %10s\n", "transport", "op", "ranks", "bytes", "latency_us", "GB/s");
  for (const Result& r : results)
    std::printf("%-8s %-11s %5d %10zu %12.1f %10.2f\n", transport, r.op.c_str(), r.ranks, r.bytes, r.seconds * 1e6,
                double(r.bytes) / r.seconds / 1e9);
}

bool write(const std::string& path, const char* transport, const std::vector<Result>& results) {
  std::vector<seqpar::bench::JsonRecord> records;
  for (const Result& r : results)
    records.push_back(seqpar::bench::JsonRecord()
                          .add("transport", transport)
                          .add("op", r.op)
                          .add("ranks", r.ranks)
                          .add("bytes", r.bytes)
                          .add("seconds", r.seconds)
                          .add("gb_per_s", double(r.bytes) / r.seconds / 1e9));
  return seqpar::bench::write_json(path, records);
}

}  // namespace

int main(int argc, char** argv) {
#if SEQPAR_BENCH_MPI
  seqpar::backend::mpi::Environment env(argc, argv);
#endif
  Config c;
  std::string json;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--smoke")
      c.smoke = true;
    else if (a == "--json" && i + 1 < argc)
      json = argv[++i];
    else if (a == "--max-bytes" && i + 1 < argc)
      c.max_bytes = std::stoull(argv[++i]);
    else {
      std::fprintf(stderr, "unknown argument %s\nusage: transport [--smoke] [--json FILE] [--max-bytes B]\n",
                   a.c_str());
      return 2;
    }
  }
#if SEQPAR_BENCH_MPI
  constexpr const char* kTransport = "mpi";
  return seqpar::backend::mpi::run_or_abort(MPI_COMM_WORLD, [&](seqpar::backend::mpi::Transport& t) {
    const std::vector<Result> results = measure(t, c);
    if (t.rank() != 0) return 0;
    print(kTransport, results);
    return json.empty() || write(json, kTransport, results) ? 0 : 1;
  });
#else
  constexpr const char* kTransport = "inproc";
  std::vector<Result> results;
  for (int n : c.smoke ? std::vector<int>{2} : std::vector<int>{2, 4, 8}) {
    std::vector<Result> mine;
    seqpar::backend::inproc::World(n).run([&](seqpar::backend::inproc::Transport& t) {
      auto r = measure(t, c);
      if (t.rank() == 0) mine = std::move(r);
    });
    results.insert(results.end(), mine.begin(), mine.end());
  }
  print(kTransport, results);
  return json.empty() || write(json, kTransport, results) ? 0 : 1;
#endif
}
