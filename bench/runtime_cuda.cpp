// SPDX-License-Identifier: Apache-2.0
// runtime_cuda: what the runtime costs on a GPU on top of the attention it runs, and how fast the
// executor's own kernels move data.
//  (a) The same work (bf16, head dim 128, 16 query and 16 KV heads, 16K tokens of one packed sequence
//      of lognormal documents, document-causal: the mix of bench/attention_cuda.cpp) timed as one
//      attention::CudaFlash call over the whole batch, and through DistributedAttention on 8 ranks
//      sharing the GPU (gpu::device_world: one host thread, one CudaExec and one CudaFlash per rank)
//      with the zigzag ring (sharding-aware), Ulysses (Uniform x AllToAll) and FlashCP's Hybrid x
//      AllGather (sharding-aware). Per row the median over --reps repetitions after --warmup calls,
//      the ratio to the whole-batch call (goal <= 1.3), and the largest |O - whole-batch O| on every
//      16th token. Timing is on the host, the same for both sides: a call and the synchronization of
//      its streams (a distributed pass spans from the first rank's start to the last rank's end; the
//      ranks leave a barrier together), fwd+bwd the sum of the two passes. The whole-batch backward
//      includes zeroing dQ, dK, dV (DistributedAttention's backward overwrites its outputs).
//  (b) runtime::DataOps<gpu::CudaExec>'s pack, unpack and merge on tensors of the same size, in
//      bytes read + written per second beside a device-to-device cudaMemcpy's (goal >= 70%): CUDA
//      events around back-to-back calls, median of --reps samples.
// Without a CUDA device it says so and exits 77.
//   usage: runtime_cuda [--smoke] [--json FILE] [--reps N] [--warmup N] [--tokens N] [--ranks N]
//                       [--cases a,b] (cases: zigzag-ring-sharding-aware, ulysses, hybrid-allgather-sharding-aware,
//                       dpp-chunked-ulysses)
//  The dpp-chunked case is DPP's path: the batch cut by DynamicChunk into chunks whose long documents
//  carry their K/V prefix (runtime::ChunkedAttention over Ulysses), timed and checked the same way.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <seqpar/runtime/chunked_attention.hpp>
#include <seqpar/schedule/dynamic_chunk.hpp>
#include <seqpar/seqpar.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "seqpar/gpu/check.hpp"
#include "seqpar/gpu/data_ops.hpp"
#include "seqpar/gpu/device_memory.hpp"
#include "seqpar/gpu/device_world.hpp"
#include "seqpar/gpu/exec.hpp"
#include "seqpar/gpu/flash.hpp"
#include "seqpar/gpu/slices.hpp"
#include "support/device_fill.hpp"
#include "support/json.hpp"

namespace seqpar::bench {
namespace {

constexpr const char* kWhere = "runtime_cuda";
using T = __nv_bfloat16;
using Kernel = attention::CudaFlash<T>;
using Clock = std::chrono::steady_clock;

struct Options {
  bool smoke = false;
  std::string json;
  int reps = 10, warmup = 2;
  std::int64_t tokens = 16384;
  int ranks = 8;
  AttentionShape shape{16, 16, 128};
  std::vector<std::string> cases = all_cases();
  static std::vector<std::string> all_cases() {
    return {"zigzag-ring-sharding-aware", "ulysses", "hybrid-allgather-sharding-aware", "dpp-chunked-ulysses"};
  }
};

// ---- the batch: bench/attention_cuda.cpp's lognormal mix (same generator, same lengths) --------------
struct SplitMix64 {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return (static_cast<double>(next() >> 11) + 0.5) * 0x1.0p-53; }  // in (0, 1)
};

std::vector<std::int64_t> lognormal_docs(std::int64_t tokens, double median, double sigma, std::uint64_t seed) {
  SplitMix64 rng{seed};
  std::vector<std::int64_t> docs;
  for (std::int64_t left = tokens; left > 0;) {
    const double u1 = rng.uniform(), u2 = rng.uniform();
    const double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
    const double x = median * std::exp(sigma * z);
    const std::int64_t len = std::clamp<std::int64_t>(static_cast<std::int64_t>(x), 1, left);
    docs.push_back(len);
    left -= len;
  }
  return docs;
}

// ---- inputs on the device (support/device_fill.cu) ----------------------------------------------
enum class Input : std::uint64_t { kQ = 1, kK, kV, kDout };

// Fills the local rows of `dst` (the global rows `owned`, in order; `row` elements per token).
void fill_rows(const gpu::CudaExec& exec, const gpu::DeviceArray<T>& dst, Input which, const std::vector<Range>& owned,
               std::int64_t row) {
  std::int64_t at = 0;
  for (const Range& r : owned) {
    if (r.empty()) continue;
    fill_normal(exec.stream(), dst.data() + at * row, r.begin * row, r.size() * row, static_cast<std::uint64_t>(which));
    at += r.size();
  }
}

std::uint64_t nonfinite(const gpu::CudaExec& exec, const gpu::DeviceArray<T>& a) {
  gpu::DeviceArray<unsigned long long> counter(1);
  return count_nonfinite(exec.stream(), a.data(), static_cast<std::int64_t>(a.size()), counter.data());
}

// ---- statistics -----------------------------------------------------------------------------------
double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n == 0 ? std::numeric_limits<double>::quiet_NaN() : n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// ---- (a) the runtime against one kernel call ------------------------------------------------------
constexpr std::int64_t kSampleStride = 16;  // O is compared on every 16th token (all heads)

struct Batch {
  DocumentBatch documents{};
  std::int64_t area = 0;          // visible (query, key) pairs
  std::vector<float> o_sample{};  // the whole-batch O on every kSampleStride-th token
};

struct Row {
  std::string name{};
  int ranks = 1;
  std::string pass{};  // "fwd" | "fwd+bwd"
  std::vector<double> seconds{};
  double ratio = 1, tflops = 0, max_abs_diff_o = 0;
  std::uint64_t nonfinite = 0;
  [[nodiscard]] bool baseline() const { return ranks == 1; }
  [[nodiscard]] bool goal_met() const { return baseline() || (ratio <= 1.3 && nonfinite == 0); }
};

std::vector<float> sample_o(const std::vector<T>& o, const std::vector<Range>& owned, const AttentionShape& shape) {
  const std::int64_t row = std::int64_t{shape.heads_q} * shape.head_dim;
  std::vector<float> out;
  std::int64_t at = 0;
  for (const Range& r : owned) {
    for (std::int64_t t = r.begin; t < r.end; ++t, ++at)
      if (t % kSampleStride == 0)
        for (std::int64_t i = 0; i < row; ++i)
          out.push_back(__bfloat162float(o[static_cast<std::size_t>(at * row + i)]));
  }
  return out;
}

std::vector<Row> run_baseline(Batch& batch, const Options& opt) {
  const AttentionShape& shape = opt.shape;
  const int d = shape.head_dim;
  const std::int64_t n = batch.documents.total_tokens();
  const std::vector<Range> all{{0, n}};
  SEQPAR_CUDA_CHECK(cudaSetDevice(0), kWhere);
  Kernel flash;
  const gpu::CudaExec& exec = flash.exec();
  const gpu::DeviceSlices slices(batch.documents.document_causal_slices(), n, n);
  SEQPAR_CUDA_CHECK(cudaDeviceSynchronize(), kWhere);  // the slices' upload ran on the legacy stream
  const gpu::DeviceBytes ws(flash.workspace_bytes(shape, n, n));
  const auto rows_q = static_cast<std::size_t>(n * shape.heads_q * d);
  const auto rows_kv = static_cast<std::size_t>(n * shape.heads_kv * d);
  gpu::DeviceArray<T> q(rows_q), k(rows_kv), v(rows_kv), dout(rows_q), o(rows_q), dq(rows_q), dk(rows_kv), dv(rows_kv);
  gpu::DeviceArray<float> lse(static_cast<std::size_t>(n * shape.heads_q));
  fill_rows(exec, q, Input::kQ, all, std::int64_t{shape.heads_q} * d);
  fill_rows(exec, k, Input::kK, all, std::int64_t{shape.heads_kv} * d);
  fill_rows(exec, v, Input::kV, all, std::int64_t{shape.heads_kv} * d);
  fill_rows(exec, dout, Input::kDout, all, std::int64_t{shape.heads_q} * d);
  const auto view = [&](const gpu::DeviceArray<T>& a, int heads) { return ThdView<T>::dense(a.data(), n, heads, d); };
  const auto forward = [&] {
    flash.forward(exec, shape, view(q, shape.heads_q), view(k, shape.heads_kv), view(v, shape.heads_kv),
                  slices.device(), view(o, shape.heads_q), LseView<float>::dense(lse.data(), shape.heads_q, n),
                  ws.span());
    exec.synchronize();
  };
  const auto backward = [&] {
    for (const auto* g : {&dq, &dk, &dv})
      SEQPAR_CUDA_CHECK(cudaMemsetAsync(g->data(), 0, g->size() * sizeof(T), exec.stream()), kWhere);
    flash.backward(exec, shape, view(q, shape.heads_q), view(k, shape.heads_kv), view(v, shape.heads_kv),
                   view(o, shape.heads_q), LseView<const float>::dense(lse.data(), shape.heads_q, n),
                   view(dout, shape.heads_q), slices.device(), view(dq, shape.heads_q), view(dk, shape.heads_kv),
                   view(dv, shape.heads_kv), ws.span());
    exec.synchronize();
  };
  Row fwd{.name = "whole-batch CudaFlash", .ranks = 1, .pass = "fwd"};
  Row both{.name = "whole-batch CudaFlash", .ranks = 1, .pass = "fwd+bwd"};
  for (int i = 0; i < opt.warmup; ++i) forward(), backward();
  for (int rep = 0; rep < opt.reps; ++rep) {
    const auto t0 = Clock::now();
    forward();
    const auto t1 = Clock::now();
    backward();
    const auto t2 = Clock::now();
    fwd.seconds.push_back(seconds_between(t0, t1));
    both.seconds.push_back(seconds_between(t0, t2));
  }
  fwd.nonfinite = nonfinite(exec, o);
  both.nonfinite = fwd.nonfinite + nonfinite(exec, dq) + nonfinite(exec, dk) + nonfinite(exec, dv);
  batch.o_sample = sample_o(o.to_host(), all, shape);
  return {fwd, both};
}

// Per repetition, a rank's start and end of its forward and of its backward.
struct RankTimes {
  std::vector<Clock::time_point> forward_start, forward_end, backward_start, backward_end;
  double max_abs_diff_o = 0;
  std::uint64_t nonfinite = 0;
};

// The largest |O - the baseline's O| over this rank's sampled tokens (`o`: its rows, `owned` order).
template <class T>
double sample_diff(const Batch& batch, const std::vector<T>& o, const std::vector<Range>& owned,
                   const AttentionShape& shape) {
  const std::vector<float> got = sample_o(o, owned, shape);
  const std::int64_t row = std::int64_t{shape.heads_q} * shape.head_dim;
  double diff = 0;
  std::size_t at = 0;  // the sampled tokens of this rank, in the order of the whole-batch sample
  for (const Range& r : owned)
    for (std::int64_t t = r.begin; t < r.end; ++t)
      if (t % kSampleStride == 0) {
        const float* whole = batch.o_sample.data() + t / kSampleStride * row;
        for (std::int64_t x = 0; x < row; ++x, ++at) diff = std::max<double>(diff, std::abs(got[at] - whole[x]));
      }
  return diff;
}

// The fwd and fwd+bwd rows of one case: per repetition, from the first rank's start to the last rank's
// end (every rank waits at a barrier before each pass); the worst O difference and every non-finite.
std::vector<Row> rows_of(const std::string& name, const Options& opt, const std::vector<RankTimes>& times) {
  Row fwd{.name = name, .ranks = opt.ranks, .pass = "fwd"};
  Row both{.name = name, .ranks = opt.ranks, .pass = "fwd+bwd"};
  const auto span = [&](auto start, auto end, std::size_t i) {
    Clock::time_point first = Clock::time_point::max(), last = Clock::time_point::min();
    for (const RankTimes& r : times) first = std::min(first, (r.*start)[i]), last = std::max(last, (r.*end)[i]);
    return seconds_between(first, last);
  };
  for (std::size_t i = 0; i < static_cast<std::size_t>(opt.reps); ++i) {
    const double f = span(&RankTimes::forward_start, &RankTimes::forward_end, i);
    fwd.seconds.push_back(f);
    both.seconds.push_back(f + span(&RankTimes::backward_start, &RankTimes::backward_end, i));
  }
  for (const RankTimes& r : times) {
    for (Row* x : {&fwd, &both}) x->max_abs_diff_o = std::max(x->max_abs_diff_o, r.max_abs_diff_o);
    both.nonfinite += r.nonfinite;
  }
  fwd.nonfinite = both.nonfinite;
  return {fwd, both};
}

template <class S>
std::vector<Row> run_distributed(const std::string& name, typename S::Arguments args, const Batch& batch,
                                 const Options& opt) {
  const AttentionShape& shape = opt.shape;
  const int d = shape.head_dim;
  std::vector<RankTimes> times(static_cast<std::size_t>(opt.ranks));
  for (RankTimes& r : times) {
    const auto n = static_cast<std::size_t>(opt.reps);
    r.forward_start.resize(n), r.forward_end.resize(n), r.backward_start.resize(n), r.backward_end.resize(n);
  }
  gpu::device_world(opt.ranks).run([&](backend::inproc::Transport& transport) {
    SEQPAR_CUDA_CHECK(cudaSetDevice(0), kWhere);
    DistributedAttention<S, Kernel> attn(transport, shape, args, Kernel{});
    const gpu::CudaExec& exec = attn.exec();
    const DocumentBatch& b = batch.documents;
    const std::vector<Range> owned = attn.owned_ranges(b);
    const std::int64_t n = attn.local_tokens(b);
    const auto rows_q = static_cast<std::size_t>(n * shape.heads_q * d);
    const auto rows_kv = static_cast<std::size_t>(n * shape.heads_kv * d);
    gpu::DeviceArray<T> q(rows_q), k(rows_kv), v(rows_kv), dout(rows_q), o(rows_q), dq(rows_q), dk(rows_kv),
        dv(rows_kv);
    gpu::DeviceArray<float> lse(static_cast<std::size_t>(n * shape.heads_q));
    fill_rows(exec, q, Input::kQ, owned, std::int64_t{shape.heads_q} * d);
    fill_rows(exec, k, Input::kK, owned, std::int64_t{shape.heads_kv} * d);
    fill_rows(exec, v, Input::kV, owned, std::int64_t{shape.heads_kv} * d);
    fill_rows(exec, dout, Input::kDout, owned, std::int64_t{shape.heads_q} * d);
    exec.synchronize();
    const auto view = [&](const gpu::DeviceArray<T>& a, int heads) { return ThdView<T>::dense(a.data(), n, heads, d); };
    const auto forward = [&] {
      attn.forward(b, view(q, shape.heads_q), view(k, shape.heads_kv), view(v, shape.heads_kv), view(o, shape.heads_q),
                   LseView<float>::dense(lse.data(), shape.heads_q, n));
      exec.synchronize();
    };
    const auto backward = [&] {
      attn.backward(b, view(q, shape.heads_q), view(k, shape.heads_kv), view(v, shape.heads_kv), view(o, shape.heads_q),
                    LseView<const float>::dense(lse.data(), shape.heads_q, n), view(dout, shape.heads_q),
                    view(dq, shape.heads_q), view(dk, shape.heads_kv), view(dv, shape.heads_kv));
      exec.synchronize();
    };
    RankTimes& mine = times[static_cast<std::size_t>(transport.rank())];
    // The first call plans, compiles, lowers and uploads the programs and sizes the workspace and the
    // mailboxes; later ones are the steady state.
    for (int i = 0; i < opt.warmup; ++i) forward(), backward();
    for (int rep = 0; rep < opt.reps; ++rep) {
      const auto i = static_cast<std::size_t>(rep);
      transport.barrier();
      mine.forward_start[i] = Clock::now();
      forward();
      mine.forward_end[i] = Clock::now();
      transport.barrier();
      mine.backward_start[i] = Clock::now();
      backward();
      mine.backward_end[i] = Clock::now();
    }
    mine.nonfinite = nonfinite(exec, o) + nonfinite(exec, dq) + nonfinite(exec, dk) + nonfinite(exec, dv);
    mine.max_abs_diff_o = std::max(mine.max_abs_diff_o, sample_diff(batch, o.to_host(), owned, shape));
  });
  return rows_of(name, opt, times);
}

// The DPP path: the same batch cut by DynamicChunk (capacity tokens / 4, so that the long documents
// split and their K/V prefixes are carried), every chunk's forward and then every backward in reverse
// through runtime::ChunkedAttention over strategy S on the same ranks. Timed as run_distributed (a
// pass spans the first rank's start to the last rank's end, over all chunks), O sampled against the
// whole-batch call.
template <class S>
std::vector<Row> run_chunked(const std::string& name, typename S::Arguments args, const Batch& batch,
                             const Options& opt) {
  const AttentionShape& shape = opt.shape;
  const int d = shape.head_dim;
  const DocumentBatch& b = batch.documents;
  const std::int64_t capacity = std::max<std::int64_t>(1, b.total_tokens() / 4);
  const std::vector<Chunk> chunks =
      schedule::DynamicChunk{{.token_capacity = capacity, .time_target = 0, .slices = 0, .cost = {}}}.chunks(b);
  std::vector<RankTimes> times(static_cast<std::size_t>(opt.ranks));
  for (RankTimes& r : times) {
    const auto n = static_cast<std::size_t>(opt.reps);
    r.forward_start.resize(n), r.forward_end.resize(n), r.backward_start.resize(n), r.backward_end.resize(n);
  }
  gpu::device_world(opt.ranks).run([&](backend::inproc::Transport& transport) {
    SEQPAR_CUDA_CHECK(cudaSetDevice(0), kWhere);
    DistributedAttention<S, Kernel> attn(transport, shape, args, Kernel{});
    const gpu::CudaExec& exec = attn.exec();
    runtime::ChunkedAttention<Kernel> chunked(attn);
    chunked.begin(chunks);
    const int nc = chunked.num_chunks();
    struct Local {
      gpu::DeviceArray<T> q, k, v, dout, o, dq, dk, dv;
      gpu::DeviceArray<float> lse;
      std::int64_t n;
    };
    std::vector<Local> loc;
    for (int c = 0; c < nc; ++c) {
      const std::int64_t n = chunked.local_tokens(c);
      const auto rq = static_cast<std::size_t>(n * shape.heads_q * d),
                 rkv = static_cast<std::size_t>(n * shape.heads_kv * d);
      loc.push_back({gpu::DeviceArray<T>(rq), gpu::DeviceArray<T>(rkv), gpu::DeviceArray<T>(rkv),
                     gpu::DeviceArray<T>(rq), gpu::DeviceArray<T>(rq), gpu::DeviceArray<T>(rq),
                     gpu::DeviceArray<T>(rkv), gpu::DeviceArray<T>(rkv),
                     gpu::DeviceArray<float>(static_cast<std::size_t>(n * shape.heads_q)), n});
      const std::vector<Range>& owned = chunked.owned_global(c);
      Local& l = loc.back();
      fill_rows(exec, l.q, Input::kQ, owned, std::int64_t{shape.heads_q} * d);
      fill_rows(exec, l.k, Input::kK, owned, std::int64_t{shape.heads_kv} * d);
      fill_rows(exec, l.v, Input::kV, owned, std::int64_t{shape.heads_kv} * d);
      fill_rows(exec, l.dout, Input::kDout, owned, std::int64_t{shape.heads_q} * d);
    }
    exec.synchronize();
    const auto view = [&](const gpu::DeviceArray<T>& a, std::int64_t n, int heads) {
      return ThdView<T>::dense(a.data(), n, heads, d);
    };
    const auto forward = [&] {
      for (int c = 0; c < nc; ++c) {
        Local& l = loc[static_cast<std::size_t>(c)];
        chunked.forward(c, view(l.q, l.n, shape.heads_q), view(l.k, l.n, shape.heads_kv),
                        view(l.v, l.n, shape.heads_kv), view(l.o, l.n, shape.heads_q),
                        LseView<float>::dense(l.lse.data(), shape.heads_q, l.n));
      }
      exec.synchronize();
    };
    const auto backward = [&] {
      for (int c = nc - 1; c >= 0; --c) {
        Local& l = loc[static_cast<std::size_t>(c)];
        chunked.backward(c, view(l.q, l.n, shape.heads_q), view(l.k, l.n, shape.heads_kv),
                         view(l.v, l.n, shape.heads_kv), view(l.o, l.n, shape.heads_q),
                         LseView<const float>::dense(l.lse.data(), shape.heads_q, l.n),
                         view(l.dout, l.n, shape.heads_q), view(l.dq, l.n, shape.heads_q),
                         view(l.dk, l.n, shape.heads_kv), view(l.dv, l.n, shape.heads_kv));
      }
      exec.synchronize();
    };
    RankTimes& mine = times[static_cast<std::size_t>(transport.rank())];
    for (int i = 0; i < opt.warmup; ++i) forward(), backward();
    for (int rep = 0; rep < opt.reps; ++rep) {
      const auto i = static_cast<std::size_t>(rep);
      transport.barrier();
      mine.forward_start[i] = Clock::now();
      forward();
      mine.forward_end[i] = Clock::now();
      transport.barrier();
      mine.backward_start[i] = Clock::now();
      backward();
      mine.backward_end[i] = Clock::now();
    }
    for (int c = 0; c < nc; ++c) {
      const Local& l = loc[static_cast<std::size_t>(c)];
      mine.nonfinite += nonfinite(exec, l.o) + nonfinite(exec, l.dq) + nonfinite(exec, l.dk) + nonfinite(exec, l.dv);
      mine.max_abs_diff_o =
          std::max(mine.max_abs_diff_o, sample_diff(batch, l.o.to_host(), chunked.owned_global(c), shape));
    }
  });
  return rows_of(name + " (" + std::to_string(chunks.size()) + " chunks)", opt, times);
}

std::vector<Row> run_case(const std::string& name, const Batch& batch, const Options& opt) {
  using ZigzagRing = Strategy<partition::Zigzag, comm::Ring>;
  using Ulysses = Strategy<partition::Uniform, comm::AllToAll>;
  using HybridAllGather = Strategy<partition::Hybrid, comm::AllGather>;
  if (name == "zigzag-ring-sharding-aware") {
    ZigzagRing::Arguments args;
    args.comm.sharding_aware = true;
    return run_distributed<ZigzagRing>(name, args, batch, opt);
  }
  if (name == "ulysses") return run_distributed<Ulysses>(name, {}, batch, opt);
  if (name == "dpp-chunked-ulysses") return run_chunked<Ulysses>(name, {}, batch, opt);
  if (name == "hybrid-allgather-sharding-aware") {
    HybridAllGather::Arguments args;
    args.comm.sharding_aware = true;
    return run_distributed<HybridAllGather>(name, args, batch, opt);
  }
  throw std::invalid_argument("runtime_cuda: unknown case " + name);
}

// ---- (b) the data ops' bandwidth ----------------------------------------------------------------------
class Events {
 public:
  Events() {
    SEQPAR_CUDA_CHECK(cudaEventCreate(&start_), kWhere);
    SEQPAR_CUDA_CHECK(cudaEventCreate(&stop_), kWhere);
  }
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;
  ~Events() {
    (void)cudaEventDestroy(start_);
    (void)cudaEventDestroy(stop_);
  }
  /// Milliseconds the stream spent on `body`.
  template <class Body>
  double time(cudaStream_t s, Body&& body) {
    SEQPAR_CUDA_CHECK(cudaEventRecord(start_, s), kWhere);
    body();
    SEQPAR_CUDA_CHECK(cudaEventRecord(stop_, s), kWhere);
    SEQPAR_CUDA_CHECK(cudaEventSynchronize(stop_), kWhere);
    float ms = 0;
    SEQPAR_CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_), kWhere);
    return ms;
  }

 private:
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

// Median milliseconds per call: samples of back-to-back calls lasting about 2 ms each.
double time_per_call(cudaStream_t s, int samples, const std::function<void()>& call) {
  Events ev;
  call();
  call();
  const double one = ev.time(s, call);
  const int inner = std::clamp(static_cast<int>(std::ceil(2.0 / std::max(one, 1e-3))), 1, 200);
  std::vector<double> per_call;
  for (int r = 0; r < samples; ++r)
    per_call.push_back(ev.time(s, [&] {
      for (int i = 0; i < inner; ++i) call();
    }) / inner);
  return median(per_call);
}

struct OpRow {
  std::string name{};
  double bytes = 0;  // read + written per call
  double ms = 0;
  double gbps = 0, fraction = 0;
  [[nodiscard]] bool goal_met() const { return fraction >= 0.7; }
};

std::vector<OpRow> run_data_ops(const Batch& batch, const Options& opt, double& copy_gbps) {
  using Ops = runtime::DataOps<gpu::CudaExec>;
  using runtime::BufferId;
  using runtime::PieceCopy;
  const AttentionShape& shape = opt.shape;
  const int d = shape.head_dim, heads = shape.heads_q;
  const std::int64_t n = batch.documents.total_tokens();
  SEQPAR_CUDA_CHECK(cudaSetDevice(0), kWhere);
  const gpu::CudaExec exec(0);
  const cudaStream_t s = exec.stream();
  const int samples = std::max(opt.reps, 3);
  std::vector<OpRow> rows;

  {  // the ceiling: a device-to-device copy, bytes read + written
    const std::size_t bytes = opt.smoke ? (std::size_t{16} << 20) : (std::size_t{1} << 30);
    const gpu::DeviceBytes from(bytes), to(bytes);
    SEQPAR_CUDA_CHECK(cudaMemsetAsync(from.data(), 1, bytes, s), kWhere);
    OpRow r{.name = "device copy (cudaMemcpyAsync D2D)", .bytes = 2.0 * static_cast<double>(bytes)};
    r.ms = time_per_call(s, samples, [&] {
      SEQPAR_CUDA_CHECK(cudaMemcpyAsync(to.data(), from.data(), bytes, cudaMemcpyDeviceToDevice, s), kWhere);
    });
    r.gbps = r.bytes / (r.ms * 1e-3) * 1e-9;
    r.fraction = 1;
    copy_gbps = r.gbps;
    rows.push_back(r);
  }

  // Buffers of the whole batch: K, V, dK (n, H, d) and O, O_part, LSE, LSE_part.
  const auto elems = static_cast<std::size_t>(n * heads * d);
  gpu::DeviceArray<T> k(elems), v(elems), dk(elems), o(elems), o_part(elems);
  gpu::DeviceArray<float> lse(static_cast<std::size_t>(n * heads)), lse_part(static_cast<std::size_t>(n * heads));
  const std::vector<Range> all{{0, n}};
  fill_rows(exec, k, Input::kK, all, std::int64_t{heads} * d);
  fill_rows(exec, v, Input::kV, all, std::int64_t{heads} * d);
  fill_rows(exec, dk, Input::kDout, all, std::int64_t{heads} * d);
  fill_rows(exec, o, Input::kQ, all, std::int64_t{heads} * d);
  fill_rows(exec, o_part, Input::kDout, all, std::int64_t{heads} * d);
  SEQPAR_CUDA_CHECK(cudaMemsetAsync(lse.data(), 0, lse.size() * sizeof(float), s), kWhere);
  SEQPAR_CUDA_CHECK(cudaMemsetAsync(lse_part.data(), 0, lse_part.size() * sizeof(float), s), kWhere);
  runtime::BufferTable<T, float> b;
  b.thd[static_cast<std::size_t>(BufferId::kK)] = ThdView<T>::dense(k.data(), n, heads, d);
  b.thd[static_cast<std::size_t>(BufferId::kV)] = ThdView<T>::dense(v.data(), n, heads, d);
  b.thd[static_cast<std::size_t>(BufferId::kDk)] = ThdView<T>::dense(dk.data(), n, heads, d);

  // The copy tables, as a lowering lays them out: pieces back to back, one run per operation.
  runtime::LoweredProgram lp;
  lp.head_dim = d;
  const auto piece_bytes = [&](Range rows, Range hs) {
    return static_cast<std::uint64_t>(rows.size() * hs.size() * d) * sizeof(T);
  };
  const auto add_run = [&](const std::vector<std::pair<BufferId, std::pair<Range, Range>>>& pieces, bool accumulate) {
    const auto first = static_cast<std::uint32_t>(lp.copies.size());
    std::uint64_t off = 0;
    for (const auto& [id, box] : pieces) {
      lp.copies.push_back({id, accumulate, box.first, box.second, off});
      off += piece_bytes(box.first, box.second);
    }
    return std::pair{runtime::TableSpan{first, static_cast<std::uint32_t>(lp.copies.size()) - first}, off};
  };
  const int peers = opt.ranks;
  const std::int64_t chunk = (n + peers - 1) / peers;
  const Range all_heads{0, heads};
  // (1) ring / all-gather: K and V rows in 8 chunks, every head; (2) Ulysses: every row, a peer's heads.
  std::vector<std::pair<BufferId, std::pair<Range, Range>>> rows_pieces, heads_pieces, sum_pieces;
  for (int p = 0; p < peers; ++p) {
    const Range rows{std::min(n, p * chunk), std::min(n, (p + 1) * chunk)};
    rows_pieces.push_back({BufferId::kK, {rows, all_heads}});
    rows_pieces.push_back({BufferId::kV, {rows, all_heads}});
    const int h0 = heads * p / peers, h1 = heads * (p + 1) / peers;
    heads_pieces.push_back({BufferId::kK, {{0, n}, {h0, h1}}});
    heads_pieces.push_back({BufferId::kV, {{0, n}, {h0, h1}}});
    sum_pieces.push_back({BufferId::kDk, {{0, chunk}, all_heads}});  // every peer's gradient of the same rows
  }
  const auto [rows_span, rows_bytes] = add_run(rows_pieces, false);
  const auto [heads_span, heads_bytes] = add_run(heads_pieces, false);
  const auto [sum_span, sum_bytes] = add_run(sum_pieces, true);
  const auto docs = batch.documents.document_causal_slices();
  lp.slices.assign(docs.begin(), docs.end());
  runtime::MergeOp merge;
  merge.slices = {0, static_cast<std::uint32_t>(lp.slices.size())};
  lp.ops.push_back({merge, {}, 0, "merge"});
  const Ops::Tables tables = Ops::upload(exec, lp);
  const auto slice_of = [&](runtime::TableSpan sp) {
    return runtime::TableSlice<PieceCopy>{lp.view(lp.copies, sp), tables.copies + sp.first};
  };
  const gpu::DeviceBytes region(std::max({rows_bytes, heads_bytes, sum_bytes}) + 256);
  SEQPAR_CUDA_CHECK(cudaMemsetAsync(region.data(), 0, region.size(), s), kWhere);
  exec.synchronize();

  const auto add_row = [&](const std::string& name, double bytes, const std::function<void()>& call) {
    OpRow r{.name = name, .bytes = bytes};
    r.ms = time_per_call(s, samples, call);
    r.gbps = r.bytes / (r.ms * 1e-3) * 1e-9;
    r.fraction = r.gbps / copy_gbps;
    rows.push_back(r);
  };
  const auto fb = [](std::uint64_t x) { return static_cast<double>(x); };
  add_row("pack: K, V row chunks (ring, all-gather)", 2 * fb(rows_bytes), [&] {
    Ops::pack(exec, b, slice_of(rows_span), region.data(), comm::HeadWidths{d, d});
  });
  add_row("pack: K, V head groups (Ulysses)", 2 * fb(heads_bytes), [&] {
    Ops::pack(exec, b, slice_of(heads_span), region.data(), comm::HeadWidths{d, d});
  });
  add_row("unpack: K, V row chunks", 2 * fb(rows_bytes), [&] {
    Ops::unpack(exec, b, slice_of(rows_span), region.data(), comm::HeadWidths{d, d});
  });
  add_row("unpack: K, V head groups", 2 * fb(heads_bytes), [&] {
    Ops::unpack(exec, b, slice_of(heads_span), region.data(), comm::HeadWidths{d, d});
  });
  // Adding every peer's gradient of the same rows: one launch per peer, each reading the message and
  // the gradient and writing the gradient.
  add_row("unpack + accumulate: 8 peers' dK of one chunk", 3 * fb(sum_bytes), [&] {
    Ops::unpack(exec, b, slice_of(sum_span), region.data(), comm::HeadWidths{d, d});
  });
  // Merge: reads O, O_part, LSE, LSE_part and writes O, LSE. Every LSE is finite (0 at first, the
  // merged one grows by about log 2 per call), so every element is a weighted sum: no empty-side shortcut.
  const double merge_bytes = 3.0 * static_cast<double>(elems * sizeof(T)) + 3.0 * static_cast<double>(n * heads * 4);
  add_row("merge: O += O_part on the document slices", merge_bytes, [&] {
    Ops::merge(exec, ThdView<T>::dense(o.data(), n, heads, d), LseView<float>::dense(lse.data(), heads, n),
               ThdView<T>::dense(o_part.data(), n, heads, d), LseView<float>::dense(lse_part.data(), heads, n),
               runtime::TableSlice<AttnSlice>{lp.slices, tables.slices});
  });
  exec.synchronize();
  return rows;
}

// ---- output ------------------------------------------------------------------------------------------
void print_rows_header() {
  std::printf("%-34s %5s %-7s %9s %7s %8s %9s %-12s %s\n", "case", "ranks", "pass", "ms", "ratio", "TFLOP/s", "diff O",
              "goal", "met");
}

void print_row(const Row& r) {
  char ratio[16] = "-";
  if (!r.baseline()) std::snprintf(ratio, sizeof ratio, "%.3f", r.ratio);
  std::printf("%-34s %5d %-7s %9.3f %7s %8.1f %9.2e %-12s %s\n", r.name.c_str(), r.ranks, r.pass.c_str(),
              median(r.seconds) * 1e3, ratio, r.tflops, r.max_abs_diff_o, r.baseline() ? "-" : "ratio <= 1.3",
              r.baseline()   ? (r.nonfinite == 0 ? "" : "NON-FINITE")
              : r.goal_met() ? "yes"
                             : (r.nonfinite != 0 ? "NO (non-finite)" : "NO"));
  std::fflush(stdout);
}

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');) out.push_back(x);
  return out;
}

int run(const Options& opt) {
  cudaDeviceProp prop{};
  SEQPAR_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0), kWhere);
  const std::vector<std::int64_t> docs = lognormal_docs(opt.tokens, opt.smoke ? 16.0 : 256.0, 1.0, 20240607);
  Batch batch{DocumentBatch::single(docs)};
  batch.area = total_area(batch.documents.document_causal_slices());
  const AttentionShape& shape = opt.shape;
  const double fwd_flops = 4.0 * shape.head_dim * shape.heads_q * static_cast<double>(batch.area);
  std::printf(
      "runtime_cuda on %s: %lld tokens in %zu documents (longest %lld), %lld visible pairs, heads %d:%d, d %d, bf16; "
      "%d ranks on one GPU; median of %d reps after %d warm-up call(s)\n\n",
      prop.name, static_cast<long long>(opt.tokens), docs.size(),
      static_cast<long long>(*std::max_element(docs.begin(), docs.end())), static_cast<long long>(batch.area),
      shape.heads_q, shape.heads_kv, shape.head_dim, opt.ranks, opt.reps, opt.warmup);
  std::vector<JsonRecord> records;
  records.push_back(JsonRecord()
                        .add("kind", "setup")
                        .add("device", prop.name)
                        .add("tokens", opt.tokens)
                        .add("documents", docs.size())
                        .add("longest", *std::max_element(docs.begin(), docs.end()))
                        .add("visible_pairs", batch.area)
                        .add("heads_q", shape.heads_q)
                        .add("heads_kv", shape.heads_kv)
                        .add("head_dim", shape.head_dim)
                        .add("dtype", "bf16")
                        .add("ranks", opt.ranks)
                        .add("reps", opt.reps)
                        .add("warmup", opt.warmup)
                        .add("smoke", opt.smoke));
  bool ok = true;
  print_rows_header();
  std::vector<Row> base = run_baseline(batch, opt);
  const auto finish = [&](Row& r, double baseline_seconds) {
    const double s = median(r.seconds);
    r.ratio = s / baseline_seconds;
    r.tflops = (r.pass == "fwd" ? 1.0 : 3.5) * fwd_flops / s * 1e-12;
    print_row(r);
    ok = ok && r.nonfinite == 0;
    records.push_back(JsonRecord()
                          .add("kind", "runtime")
                          .add("case", r.name)
                          .add("ranks", r.ranks)
                          .add("pass", r.pass)
                          .add("ms", s * 1e3)
                          .add("ratio", r.ratio)
                          .add("tflops", r.tflops)
                          .add("max_abs_diff_o", r.max_abs_diff_o)
                          .add("nonfinite", r.nonfinite)
                          .add("goal_ratio", 1.3)
                          .add("goal_met", r.goal_met()));
  };
  const double base_fwd = median(base[0].seconds), base_both = median(base[1].seconds);
  for (Row& r : base) finish(r, r.pass == "fwd" ? base_fwd : base_both);
  for (const std::string& name : opt.cases) {
    std::vector<Row> rows = run_case(name, batch, opt);
    for (Row& r : rows) finish(r, r.pass == "fwd" ? base_fwd : base_both);
  }

  double copy_gbps = 0;
  const std::vector<OpRow> ops = run_data_ops(batch, opt, copy_gbps);
  std::printf("\n%-48s %9s %9s %9s %8s %-14s %s\n", "data op (bytes read + written)", "MiB", "ms", "GB/s", "of copy",
              "goal", "met");
  for (const OpRow& r : ops) {
    const bool copy = &r == &ops.front();
    std::printf("%-48s %9.1f %9.4f %9.0f %7.0f%% %-14s %s\n", r.name.c_str(), r.bytes / (1 << 20), r.ms, r.gbps,
                100 * r.fraction, copy ? "-" : ">= 70% of copy",
                copy           ? ""
                : r.goal_met() ? "yes"
                               : "NO");
    records.push_back(JsonRecord()
                          .add("kind", copy ? "copy" : "data_op")
                          .add("op", r.name)
                          .add("bytes", r.bytes)
                          .add("ms", r.ms)
                          .add("gbps_read_plus_write", r.gbps)
                          .add("fraction_of_copy", r.fraction)
                          .add("goal_fraction", 0.7)
                          .add("goal_met", copy || r.goal_met()));
  }
  if (!opt.json.empty() && !write_json(opt.json, records)) return 1;
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace seqpar::bench

int main(int argc, char** argv) {
  using namespace seqpar::bench;
  Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--smoke") {
      opt.smoke = true;
    } else if (a == "--json" && i + 1 < argc) {
      opt.json = argv[++i];
    } else if (a == "--reps" && i + 1 < argc) {
      opt.reps = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--warmup" && i + 1 < argc) {
      opt.warmup = std::max(1, std::atoi(argv[++i]));  // >= 1: the first call is never steady state
    } else if (a == "--tokens" && i + 1 < argc) {
      opt.tokens = std::max<std::int64_t>(1, std::atoll(argv[++i]));
    } else if (a == "--ranks" && i + 1 < argc) {
      opt.ranks = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--cases" && i + 1 < argc) {
      opt.cases = split_list(argv[++i]);
    } else {
      std::fprintf(stderr,
                   "usage: %s [--smoke] [--json FILE] [--reps N] [--warmup N] [--tokens N] [--ranks N] [--cases a,b]\n"
                   "cases: zigzag-ring-sharding-aware, ulysses, hybrid-allgather-sharding-aware\n",
                   argv[0]);
      return 2;
    }
  }
  for (const std::string& name : opt.cases)
    if (const auto all = Options::all_cases(); std::find(all.begin(), all.end(), name) == all.end()) {
      std::fprintf(stderr, "runtime_cuda: unknown case %s\n", name.c_str());
      return 2;
    }
  if (opt.smoke) opt.tokens = 2048, opt.reps = 2, opt.warmup = 1;  // every case, in seconds
  if (seqpar::gpu::device_count() == 0) {
    std::printf("runtime_cuda: no CUDA device (or driver) on this machine: skipped\n");
    return 77;
  }
  try {
    return run(opt);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "runtime_cuda: %s\n", e.what());
    return 1;
  }
}
