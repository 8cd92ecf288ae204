// SPDX-License-Identifier: Apache-2.0
// The NCCL transport against raw NCCL calls, in the same run, on the same communicator and stream:
// all_to_all_v (equal blocks), all_gather and a ring step (send to rank+1, receive from rank-1), for
// per-rank sizes S from 4 KiB to 64 MiB, in the nccl-tests convention (bench/support/bus_bandwidth.hpp):
// algbw = S / t, busbw = algbw * (n-1)/n for all_to_all_v and all_gather, * 1 for the ring step; S is a
// rank's whole send buffer (all_to_all_v), receive buffer (all_gather) or message (ring step).
//  - raw: ncclGroupStart + ncclSend/ncclRecv per peer (its own block too, as nccl-tests' alltoall),
//    ncclAllGather, ncclGroupStart + ncclSend/ncclRecv;
//  - seqpar: nccl::Transport's all_to_all_v, all_gather, isend/irecv + wait, on device buffers,
//    stream-ordered (set_queue), exactly as the executor drives it.
// Timing: CUDA events around `iters` back-to-back operations, 3 warm-up operations, the median of 7
// samples (seqpar and raw alternate), the slowest rank's. Goal (issue 11): seqpar >= 0.95x raw at 64 MiB.
// Launch: one process per GPU, `mpiexec -n P transport_nccl` (built with seqpar::mpi), or plain: a
// world of one rank (every transfer is then a copy to itself and busbw is 0 by the convention).
//   usage: transport_nccl [--smoke] [--json FILE] [--max-bytes B]
#include <seqpar/backend/nccl.hpp>
#if SEQPAR_ENABLE_MPI
#include <seqpar/backend/mpi.hpp>
#endif

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "seqpar/gpu/check.hpp"
#include "seqpar/gpu/device_memory.hpp"
#include "support/bus_bandwidth.hpp"
#include "support/json.hpp"

namespace {

using seqpar::backend::nccl::Transport;
using seqpar::bench::Collective;

struct Config {
  bool smoke = false;
  std::size_t max_bytes = std::size_t{64} << 20;
};

struct Result {
  std::string op;
  Collective kind = Collective::kSendRecv;
  int ranks = 0;
  std::size_t bytes = 0;
  double seqpar_s = 0, raw_s = 0;
};

// A raw NCCL call on a non-blocking communicator: wait until it is enqueued.
void raw(ncclComm_t comm, ncclResult_t rc, const char* what) {
  ncclResult_t state = rc;
  while (state == ncclInProgress) ncclCommGetAsyncError(comm, &state);
  if (state != ncclSuccess) throw std::runtime_error(std::string(what) + ": " + ncclGetErrorString(state));
}

// Median over samples of the per-operation time of `op`, issued `iters` times between two events.
class Timer {
 public:
  explicit Timer(cudaStream_t stream) : stream_(stream) {
    SEQPAR_CUDA_CHECK(cudaEventCreate(&start_), "bench timer");
    SEQPAR_CUDA_CHECK(cudaEventCreate(&stop_), "bench timer");
  }
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;
  ~Timer() {
    (void)cudaEventDestroy(start_);
    (void)cudaEventDestroy(stop_);
  }
  // One sample: seconds per operation. `sync` waits for the stream (the transport's deadline-aware wait).
  double sample(int iters, const std::function<void()>& op, const std::function<void()>& sync) {
    SEQPAR_CUDA_CHECK(cudaEventRecord(start_, stream_), "bench timer");
    for (int i = 0; i < iters; ++i) op();
    SEQPAR_CUDA_CHECK(cudaEventRecord(stop_, stream_), "bench timer");
    sync();
    SEQPAR_CUDA_CHECK(cudaEventSynchronize(stop_), "bench timer");
    float ms = 0;
    SEQPAR_CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_), "bench timer");
    return double(ms) * 1e-3 / iters;
  }

 private:
  cudaStream_t stream_;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

int iterations(std::size_t bytes, bool smoke) {
  if (smoke) return 3;
  return static_cast<int>(std::clamp<std::size_t>((std::size_t{1} << 30) / bytes, 5, 200));
}

// The slowest rank's value (an all_gather of host doubles through the transport, outside the timing).
double slowest(Transport& t, double mine) {
  std::vector<double> all(static_cast<std::size_t>(t.size()));
  t.all_gather(std::as_bytes(std::span<const double>(&mine, 1)), std::as_writable_bytes(std::span(all)));
  return *std::max_element(all.begin(), all.end());
}

std::vector<Result> measure(Transport& t, const Config& c) {
  const int n = t.size(), me = t.rank();
  const auto un = static_cast<std::size_t>(n);
  cudaStream_t stream = nullptr;
  SEQPAR_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "bench stream");
  t.set_queue(stream);
  ncclComm_t comm = t.comm();
  Timer timer(stream);
  const auto sync = [&] { t.synchronize(); };
  std::vector<Result> out;
  const std::size_t smoke_max = std::size_t{1} << 20;
  for (std::size_t bytes = 4096; bytes <= (c.smoke ? smoke_max : c.max_bytes); bytes *= 4) {
    const std::size_t block = bytes / un, total = block * un;
    const seqpar::gpu::DeviceBytes s(total), r(total);
    SEQPAR_CUDA_CHECK(cudaMemset(s.data(), 1, total), "bench buffers");
    const int iters = iterations(bytes, c.smoke);
    const int next = (me + 1) % n, prev = (me + n - 1) % n;
    const std::vector<std::size_t> counts(un, block);

    struct Case {
      const char* name;
      Collective kind;
      std::size_t bytes;
      std::function<void()> seqpar, raw;
    };
    const std::vector<Case> cases{
        {"all_to_all_v", Collective::kAllToAll, total, [&] { t.all_to_all_v(s.span(), counts, r.span(), counts); },
         [&] {
           raw(comm, ncclGroupStart(), "ncclGroupStart");
           for (int p = 0; p < n; ++p) {
             raw(comm, ncclSend(s.data() + std::size_t(p) * block, block, ncclUint8, p, comm, stream), "ncclSend");
             raw(comm, ncclRecv(r.data() + std::size_t(p) * block, block, ncclUint8, p, comm, stream), "ncclRecv");
           }
           raw(comm, ncclGroupEnd(), "ncclGroupEnd");
         }},
        {"all_gather", Collective::kAllGather, total, [&] { t.all_gather(s.span().first(block), r.span()); },
         [&] { raw(comm, ncclAllGather(s.data(), r.data(), block, ncclUint8, comm, stream), "ncclAllGather"); }},
        {"ring_step", Collective::kSendRecv, total,
         [&] {
           auto rq = t.irecv(r.span(), prev, 1);
           auto sq = t.isend(s.span(), next, 1);
           t.wait(rq);
           t.wait(sq);
         },
         [&] {
           raw(comm, ncclGroupStart(), "ncclGroupStart");
           raw(comm, ncclSend(s.data(), total, ncclUint8, next, comm, stream), "ncclSend");
           raw(comm, ncclRecv(r.data(), total, ncclUint8, prev, comm, stream), "ncclRecv");
           raw(comm, ncclGroupEnd(), "ncclGroupEnd");
         }},
    };
    for (const Case& k : cases) {
      for (int i = 0; i < 3; ++i) k.seqpar(), k.raw();
      t.synchronize();
      std::vector<double> mine_s, mine_r;
      for (int i = 0; i < 7; ++i) {
        t.barrier();
        mine_s.push_back(timer.sample(iters, k.seqpar, sync));
        t.barrier();
        mine_r.push_back(timer.sample(iters, k.raw, sync));
      }
      std::nth_element(mine_s.begin(), mine_s.begin() + 3, mine_s.end());
      std::nth_element(mine_r.begin(), mine_r.begin() + 3, mine_r.end());
      out.push_back({k.name, k.kind, n, k.bytes, slowest(t, mine_s[3]), slowest(t, mine_r[3])});
    }
  }
  t.set_queue(nullptr);
  SEQPAR_CUDA_CHECK(cudaStreamDestroy(stream), "bench stream");
  return out;
}

void print(const std::vector<Result>& results) {
  std::printf("%-13s %5s %10s %11s %11s %9s %9s %9s %9s %8s\n", "op", "ranks", "bytes", "seqpar_us", "raw_us", "algbw",
              "busbw", "raw_alg", "raw_bus", "vs_raw");
  for (const Result& x : results) {
    const auto mine = seqpar::bench::bandwidth(x.kind, x.bytes, x.ranks, x.seqpar_s);
    const auto theirs = seqpar::bench::bandwidth(x.kind, x.bytes, x.ranks, x.raw_s);
    std::printf("%-13s %5d %10zu %11.1f %11.1f %9.2f %9.2f %9.2f %9.2f %8.3f\n", x.op.c_str(), x.ranks, x.bytes,
                x.seqpar_s * 1e6, x.raw_s * 1e6, mine.algbw, mine.busbw, theirs.algbw, theirs.busbw,
                x.raw_s / x.seqpar_s);
  }
  std::printf("(GB/s; vs_raw = raw time / seqpar time, the goal is >= 0.95 at 64 MiB)\n");
  for (const Result& x : results)
    if (x.bytes >= (std::size_t{64} << 20) - 64)
      std::printf("goal at %zu bytes, %s: %.3f %s\n", x.bytes, x.op.c_str(), x.raw_s / x.seqpar_s,
                  x.raw_s / x.seqpar_s >= 0.95 ? "met" : "NOT MET");
}

bool write(const std::string& path, const std::vector<Result>& results) {
  std::vector<seqpar::bench::JsonRecord> records;
  for (const Result& x : results) {
    const auto mine = seqpar::bench::bandwidth(x.kind, x.bytes, x.ranks, x.seqpar_s);
    const auto theirs = seqpar::bench::bandwidth(x.kind, x.bytes, x.ranks, x.raw_s);
    records.push_back(seqpar::bench::JsonRecord()
                          .add("transport", "nccl")
                          .add("op", x.op)
                          .add("ranks", x.ranks)
                          .add("bytes", x.bytes)
                          .add("seqpar_seconds", x.seqpar_s)
                          .add("raw_seconds", x.raw_s)
                          .add("algbw_gb_per_s", mine.algbw)
                          .add("busbw_gb_per_s", mine.busbw)
                          .add("raw_algbw_gb_per_s", theirs.algbw)
                          .add("raw_busbw_gb_per_s", theirs.busbw)
                          .add("vs_raw", x.raw_s / x.seqpar_s));
  }
  return seqpar::bench::write_json(path, records);
}

[[maybe_unused]] bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE"})
    if (std::getenv(v) != nullptr) return true;
  return false;
}

int report(Transport& t, const Config& c, const std::string& json) {
  const std::vector<Result> results = measure(t, c);
  if (t.rank() != 0) return 0;
  print(results);
  return json.empty() || write(json, results) ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
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
      std::fprintf(stderr, "unknown argument %s\nusage: transport_nccl [--smoke] [--json FILE] [--max-bytes B]\n",
                   a.c_str());
      return 2;
    }
  }
  const int devices = seqpar::gpu::device_count();
  const seqpar::backend::nccl::Options options{.timeout = std::chrono::seconds{120}};
#if SEQPAR_ENABLE_MPI
  if (launched_by_mpi()) {
    seqpar::backend::mpi::Environment env(argc, argv);
    return seqpar::backend::mpi::run_or_abort(MPI_COMM_WORLD, [&](seqpar::backend::mpi::Transport& host) {
      MPI_Comm node = MPI_COMM_NULL;
      MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
      int local = 0, local_size = 1;
      MPI_Comm_rank(node, &local);
      MPI_Comm_size(node, &local_size);
      MPI_Comm_free(&node);
      int unable = devices == 0 || local_size > devices ? 1 : 0, any = 0;
      MPI_Allreduce(&unable, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
      if (any != 0) {
        if (host.rank() == 0) std::printf("transport_nccl: needs one GPU per rank (%d GPUs here): skipped\n", devices);
        return 77;
      }
      SEQPAR_CUDA_CHECK(cudaSetDevice(local % devices), "transport_nccl");
      Transport t = Transport::bootstrap(host, options);
      return report(t, c, json);
    });
  }
#endif
  if (devices == 0) {
    std::printf("transport_nccl: no CUDA device (or driver) on this machine: skipped\n");
    return 77;
  }
  Transport t = Transport::single(options);
  return report(t, c, json);
}
