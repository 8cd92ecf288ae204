// SPDX-License-Identifier: Apache-2.0
// calibrate: measures this machine's replay::HardwareProfile, runs real strategies, and prints the cost
// model's prediction next to the measured time (issue 5, "Calibration": within +-25%).
//
//  1. Profile. Kernel: CpuFlash<float> (1 thread, as one rank runs it) on packed causal documents of a few
//     lengths L and on full-mask L x L blocks (what ring steps run), forward and backward. The model is
//     replay::attention_seconds' tile model: a slice costs the FLOPs of the 128 x 128 key tiles CpuFlash
//     computes (detail::kKeyTile) plus `overhead` tiles per 128-row query block (the per-block setup and
//     the rescaling of the output), at rate r_inf. t = (F_tiles + overhead * F_rows) / r_inf is linear in
//     (1/r_inf, overhead/r_inf), fitted by least squares over every point, each weighted by its relative
//     error. peak_flops is this core's fp32 FMA peak from a register-blocked FMA loop (as
//     bench/attention_cpu measures it), so attention_efficiency = r_inf / peak is the kernel's real
//     fraction of peak; attention_backward_factor is the mean over points of model / measured backward
//     time at factor 1; kernel_launch is the time of a call over one 1-token slice. The kernel is measured
//     with one thread per core, each pinned to its own core, all computing at once (under MPI: on rank 0,
//     which widens its own affinity for it, since mpiexec binds each of 2 ranks to a single core);
//     the simulator time-shares compute when a node has more ranks than cores
//     (cores_per_node = hardware_concurrency). Links and copies are measured at the world size being
//     calibrated with every rank active at once, because that is how the programs run: intra.bandwidth
//     and intra.latency from an alpha-beta fit of the ring step (isend to rank+1, irecv from rank-1) at a
//     small and a large message; hbm_bandwidth from memcpy on every rank at once (2 bytes of traffic per
//     byte copied, as replay::copy_seconds counts them). The all-to-all is measured too and printed against
//     the link's prediction of it. One node: inter = intra, ranks_per_node = world, value_bytes = 4.
//  2. Strategies. Ulysses (Uniform + AllToAll) and zigzag ring (plain and sharding-aware) with
//     DistributedAttention<S, CpuFlash<float>> on 2 packed sequences of lognormal documents; forward and
//     backward timed separately: a repetition is the slowest rank's time from a barrier, the figure the
//     best repetition after a warm-up. The prediction is replay::predict on plan::compile_all<S> with the
//     profile measured at that world size in the same process.
// Compiled plain it uses the in-process world on 2, 4 and 8 threads; compiled with SEQPAR_BENCH_MPI=1
// (target calibrate_mpi) it uses MPI_COMM_WORLD: `mpiexec -n P --oversubscribe calibrate_mpi`.
//   calibrate [--smoke] [--reps N] [--tokens N] [--worlds 2,4,8] [--json FILE] [--profile-out FILE]
// --profile-out writes the profile of the largest world size calibrated (replay/profile_json.hpp format).
#include <seqpar/plan/compile_all.hpp>
#include <seqpar/replay/predict.hpp>
#include <seqpar/replay/profile_json.hpp>
#include <seqpar/seqpar.hpp>
#if SEQPAR_BENCH_MPI
#include <seqpar/backend/mpi.hpp>
#endif

#include <pthread.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "support/json.hpp"

using namespace seqpar;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// CPU time of the calling thread: with the wall time it tells how much of a core a rank actually got (the
// machine is shared with other jobs; a rank that got half a core ran at half speed whatever the model says).
double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

struct Config {
  bool smoke = false;
  int reps = 3;
  std::int64_t tokens = 8192;
  std::vector<int> worlds{2, 4, 8};  // in-process only; MPI calibrates the launched size
  std::string json, profile_out;
};

// ---------------------------------------------------------------------------------------------------
// Kernel: peak and the attention rate fit (one rank, one thread).

// FMA peak of one core: kChains independent accumulator chains cover FMA latency x issue width (4 x 2 on
// current x86) and stay within AVX2's 16 ymm registers together with the two constants.
constexpr int kChains = 12;

float fma_chains(std::int64_t iters) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm256_set1_ps(1.0f + 1e-3f * static_cast<float>(i));
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  // A fold over an index pack unrolls the chains, so the compiler keeps them in registers.
  const auto step = [&]<std::size_t... I>(std::index_sequence<I...>) {
    ((acc[I] = _mm256_fmadd_ps(acc[I], a, b)), ...);
  };
  for (std::int64_t it = 0; it < iters; ++it) step(std::make_index_sequence<kChains>{});
  __m256 s = acc[0];
  for (int i = 1; i < kChains; ++i) s = _mm256_add_ps(s, acc[i]);
  alignas(32) float out[8];
  _mm256_store_ps(out, s);
  return out[0] + out[7];
#else
  float acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = 1.0f + 1e-3f * static_cast<float>(i);
  for (std::int64_t it = 0; it < iters; ++it)
    for (float& x : acc) x = x * 0.999999f + 1e-7f;
  return acc[0] + acc[kChains - 1];
#endif
}

constexpr double kFlopsPerIteration =
#if defined(__AVX2__) && defined(__FMA__)
    2.0 * kChains * 8;  // 8 fp32 lanes, 2 FLOPs per FMA
#else
    2.0 * kChains;
#endif

template <class F>
double best_time(int reps, F&& f) {
  f();  // warm-up: first touch of the workspace and outputs
  double best = std::numeric_limits<double>::infinity();
  for (int i = 0; i < reps; ++i) {
    const auto t0 = Clock::now();
    f();
    best = std::min(best, seconds_since(t0));
  }
  return best;
}

int cores() {
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

struct KernelPoint {
  std::string mask;  // "causal" documents of `length`, or "full" length x length blocks
  std::int64_t length = 0;
  double fwd_s = 0, bwd_s = 0;
  double flops = 0;            // forward FLOPs of the visible pairs
  double tiles = 0, rows = 0;  // tile x tile blocks touched, query blocks (replay::attention_slots with tile kTile)
  double tile_flops = 0;       // forward FLOPs of one tile x tile block over all heads
};

struct KernelFit {
  int threads = 1;
  double peak = 0, r_inf = 0, overhead = 0, bwd_factor = 0, launch = 0;
  double cpu = 0;  // least CPU time / wall time of a measuring thread: below ~0.9, other jobs took its core
  std::vector<KernelPoint> points;

  // What the fitted model says of a point: the FLOPs of its computed slots at r_inf (backward * bwd_factor).
  [[nodiscard]] double model_fwd_s(const KernelPoint& p) const { return slot_flops(p) / r_inf; }
  [[nodiscard]] double model_bwd_s(const KernelPoint& p) const { return 2.5 * slot_flops(p) / (r_inf * bwd_factor); }
  [[nodiscard]] double slot_flops(const KernelPoint& p) const { return (p.tiles + overhead * p.rows) * p.tile_flops; }
};

// CpuFlash computes whole blocks of detail::kKeyTile keys: the tile the cost model prices slices by.
constexpr int kTile = attention::detail::kKeyTile;

// Least squares of y = a x + b z (no intercept); returns {a, b}.
std::pair<double, double> fit_two(const std::vector<double>& x, const std::vector<double>& z,
                                  const std::vector<double>& y) {
  double xx = 0, xz = 0, zz = 0, xy = 0, zy = 0;
  for (std::size_t i = 0; i < y.size(); ++i) {
    xx += x[i] * x[i];
    xz += x[i] * z[i];
    zz += z[i] * z[i];
    xy += x[i] * y[i];
    zy += z[i] * y[i];
  }
  const double det = xx * zz - xz * xz;
  return {(xy * zz - zy * xz) / det, (zy * xx - xy * xz) / det};
}

std::vector<AttnSlice> causal_slices(std::int64_t len, std::int64_t total) {
  std::vector<AttnSlice> out;
  for (std::int64_t at = 0; at + len <= total; at += len)
    out.push_back({{at, at + len}, {at, at + len}, Mask::causal()});
  return out;
}
// Query rows [at, at + len) against keys [0, len): full blocks, as a ring step's off-diagonal slices.
std::vector<AttnSlice> full_slices(std::int64_t len, std::int64_t total) {
  std::vector<AttnSlice> out;
  for (std::int64_t at = 0; at + len <= total; at += len) out.push_back({{at, at + len}, {0, len}, Mask::full()});
  return out;
}

// Pins the calling thread to the `index`-th online CPU. An MPI launcher binds each of a few ranks to one
// core, so rank 0's measuring threads would otherwise share that core (cpu 0.5 in the table) and halve the
// rates. Returns false where the OS refuses (a cpuset that excludes the CPU): the cpu column then shows it.
bool pin_to_cpu(int index) {
  const long online = sysconf(_SC_NPROCESSORS_ONLN);
  if (online < 1) return false;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(static_cast<int>(index % online), &set);
  return pthread_setaffinity_np(pthread_self(), sizeof(set), &set) == 0;
}

// Runs body(thread) on `threads` threads at once, thread i pinned to CPU i, and joins them.
template <class F>
void on_threads(int threads, F&& body) {
  std::vector<std::thread> pool;
  for (int i = 0; i < threads; ++i)
    pool.emplace_back([&body, i] {
      (void)pin_to_cpu(i);
      body(i);
    });
  for (std::thread& t : pool) t.join();
}

// The kernel's rates with `threads` ranks computing at once (one per core: the node busy, as it is in a
// distributed run), each on its own tensors; a figure is the slowest thread's best time. Measured alone, one
// rank reaches a higher rate than when every core computes (shared L3 and memory bandwidth, and on this VM
// the host's scheduling), and the calibrated runs always have every core busy.
KernelFit measure_kernel(const AttentionShape& shape, bool smoke, int threads) {
  KernelFit fit;
  const std::int64_t total = smoke ? 512 : 2048;
  const std::vector<std::int64_t> lengths =
      smoke ? std::vector<std::int64_t>{64, 256} : std::vector<std::int64_t>{128, 512, 2048};
  const int hq = shape.heads_q, hkv = shape.heads_kv, d = shape.head_dim;
  const std::size_t n_len = lengths.size();
  // times[thread][point]: fwd at 2i, bwd at 2i+1; peak[thread]: FMA FLOP/s.
  // Full-mask blocks (q rows x L keys, no diagonal): what ring steps and a split document's earlier chunks run.
  const std::vector<std::int64_t> full_lengths =
      smoke ? std::vector<std::int64_t>{64} : std::vector<std::int64_t>{128, 512};
  const std::size_t n_full = full_lengths.size();
  std::vector<std::vector<double>> times(static_cast<std::size_t>(threads), std::vector<double>(2 * (n_len + n_full)));
  std::vector<double> peak(static_cast<std::size_t>(threads)), launch(static_cast<std::size_t>(threads)),
      cpu_share(static_cast<std::size_t>(threads));
  std::barrier sync(threads);
  on_threads(threads, [&](int me) {
    const auto um = static_cast<std::size_t>(me);
    {  // FMA peak of this core while the others run theirs
      const std::int64_t iters = smoke ? 2'000'000 : 10'000'000;
      volatile float sink = 0;
      for (int rep = 0; rep < 3; ++rep) {
        sync.arrive_and_wait();
        const auto t0 = Clock::now();
        sink = sink + fma_chains(iters);
        peak[um] = std::max(peak[um], kFlopsPerIteration * static_cast<double>(iters) / seconds_since(t0));
      }
    }
    const attention::CpuFlash<float> flash({.threads = 1});
    std::mt19937_64 rng(7 + static_cast<std::uint64_t>(me));
    std::normal_distribution<float> dist(0.0f, 1.0f);
    ThdTensor<float> q(total, hq, d), k(total, hkv, d), v(total, hkv, d), o(total, hq, d), dout(total, hq, d),
        dq(total, hq, d), dk(total, hkv, d), dv(total, hkv, d);
    for (auto* t : {&q, &k, &v, &dout})
      for (float& x : t->storage) x = dist(rng);
    LseTensor<float> lse(hq, total);
    std::vector<std::byte> ws(flash.workspace_bytes(shape, total, total));
    const double cpu0 = thread_cpu_seconds();
    const auto wall0 = Clock::now();
    for (std::size_t i = 0; i < n_len; ++i) {
      const std::vector<AttnSlice> slices = causal_slices(lengths[i], total);
      sync.arrive_and_wait();
      times[um][2 * i] = best_time(
          smoke ? 1 : 3, [&] { flash.forward(shape, q.view(), k.view(), v.view(), slices, o.view(), lse.view(), ws); });
      sync.arrive_and_wait();
      times[um][2 * i + 1] = best_time(smoke ? 1 : 2, [&] {
        flash.backward(shape, q.view(), k.view(), v.view(), o.view(), lse.view(), dout.view(), slices, dq.view(),
                       dk.view(), dv.view(), ws);
      });
    }
    for (std::size_t j = 0; j < n_full; ++j) {
      const std::vector<AttnSlice> slices = full_slices(full_lengths[j], total);
      sync.arrive_and_wait();
      times[um][2 * (n_len + j)] = best_time(
          smoke ? 1 : 3, [&] { flash.forward(shape, q.view(), k.view(), v.view(), slices, o.view(), lse.view(), ws); });
      sync.arrive_and_wait();
      times[um][2 * (n_len + j) + 1] = best_time(smoke ? 1 : 2, [&] {
        flash.backward(shape, q.view(), k.view(), v.view(), o.view(), lse.view(), dout.view(), slices, dq.view(),
                       dk.view(), dv.view(), ws);
      });
    }
    cpu_share[um] = (thread_cpu_seconds() - cpu0) / seconds_since(wall0);
    // Per-call overhead: a call over one token, on one-row views. CpuFlash::forward first clears every row of
    // o and lse it is given (its cost grows with the view, not with the slices), so views of the whole buffer
    // would measure that clearing, which the model has no term for.
    const std::vector<AttnSlice> one{{{0, 1}, {0, 1}, Mask::causal()}};
    sync.arrive_and_wait();
    launch[um] = best_time(20, [&] {
      flash.forward(shape, q.view().tokens_slice(0, 1), k.view().tokens_slice(0, 1), v.view().tokens_slice(0, 1), one,
                    o.view().tokens_slice(0, 1), lse.view().tokens_slice(0, 1), ws);
    });
  });
  fit.threads = threads;
  fit.peak = *std::min_element(peak.begin(), peak.end());
  fit.launch = *std::max_element(launch.begin(), launch.end());
  fit.cpu = *std::min_element(cpu_share.begin(), cpu_share.end());
  // The model (replay::attention_seconds): a slice costs attention_flops of its slots = (tiles + overhead *
  // query blocks) * tile^2 at rate r. So t_fwd = (F_tiles + overhead * F_rows) / r with F_* the forward FLOPs
  // of those slots: linear in (1/r, overhead/r), fitted by least squares over causal and full points at once.
  std::vector<double> x, z, y;
  const auto add_point = [&](const std::string& mask, std::int64_t len, const std::vector<AttnSlice>& slices,
                             std::size_t at) {
    KernelPoint p{mask, len, 0, 0, 0, 0, 0, 0};
    for (const auto& t : times) {
      p.fwd_s = std::max(p.fwd_s, t[at]);
      p.bwd_s = std::max(p.bwd_s, t[at + 1]);
    }
    for (const AttnSlice& sl : slices) {
      const double base = replay::attention_slots(sl, kTile, 0.0), with = replay::attention_slots(sl, kTile, 1.0);
      p.tiles += base / (double(kTile) * kTile);
      p.rows += (with - base) / (double(kTile) * kTile);
    }
    p.flops = replay::attention_flops(static_cast<double>(total_area(slices)) * hq, d, false);
    p.tile_flops = replay::attention_flops(double(kTile) * kTile * hq, d, false);
    x.push_back(p.tiles * p.tile_flops / p.fwd_s);  // divided through by t: every point weighs its relative error
    z.push_back(p.rows * p.tile_flops / p.fwd_s);
    y.push_back(1.0);
    fit.points.push_back(p);
  };
  for (std::size_t i = 0; i < n_len; ++i) add_point("causal", lengths[i], causal_slices(lengths[i], total), 2 * i);
  for (std::size_t j = 0; j < n_full; ++j)
    add_point("full", full_lengths[j], full_slices(full_lengths[j], total), 2 * (n_len + j));
  auto [a, b] = fit_two(x, z, y);
  if (!(a > 0) || !(b >= 0)) {
    // Noisy points (a loaded machine, the smoke run's two lengths) can fit a negative rate or overhead:
    // keep the physical model, overhead 0, and fit the rate alone (least squares of 1 = a x).
    double xx = 0, xy = 0;
    for (std::size_t i = 0; i < y.size(); ++i) xx += x[i] * x[i], xy += x[i] * y[i];
    a = xy / xx;
    b = 0;
  }
  fit.r_inf = 1.0 / a;
  fit.overhead = b / a;
  // Backward: the same slots at r_inf * factor; the factor is the mean over points of what each one gives.
  double ratio = 0;
  fit.bwd_factor = 1;
  for (const KernelPoint& p : fit.points) ratio += fit.model_bwd_s(p) / p.bwd_s;
  fit.bwd_factor = ratio / static_cast<double>(fit.points.size());
  return fit;
}

// ---------------------------------------------------------------------------------------------------
// Links and copies at the world size, every rank at once.

// Best over `reps` of the slowest rank's time of op() from a barrier.
template <Transport T, class Op>
double slowest_best(T& t, int reps, Op&& op) {
  op();  // warm-up: first touch, connection set-up
  double best = std::numeric_limits<double>::infinity();
  std::vector<double> all(static_cast<std::size_t>(t.size()));
  for (int i = 0; i < reps; ++i) {
    t.barrier();
    const auto t0 = Clock::now();
    op();
    const double mine = seconds_since(t0);
    t.all_gather(as_bytes_of(std::span<const double>(&mine, 1)), as_writable_bytes_of(std::span<double>(all)));
    best = std::min(best, *std::max_element(all.begin(), all.end()));
  }
  return best;
}

struct LinkFit {
  std::size_t small = 0, large = 0;
  double ring_small_s = 0, ring_large_s = 0, a2a_bytes = 0, a2a_s = 0, copy_bytes = 0, copy_s = 0;
  double bandwidth = 0, latency = 0, hbm = 0;
};

template <Transport T>
LinkFit measure_links(T& t, bool smoke) {
  LinkFit f;
  const int n = t.size(), me = t.rank();
  f.small = 4096;
  // Large: the size of the ring's KV blocks in the calibrated runs (a few MiB), past the caches.
  f.large = smoke ? std::size_t{1} << 20 : std::size_t{8} << 20;
  const int reps = smoke ? 3 : 8;
  const auto ring = [&](std::size_t bytes) {
    std::vector<std::byte> s(bytes, std::byte{1}), r(bytes);
    return slowest_best(t, reps, [&] {
      auto rq = t.irecv(std::span<std::byte>(r), (me + n - 1) % n, 1);
      auto sq = t.isend(std::span<const std::byte>(s), (me + 1) % n, 1);
      t.wait(rq);
      t.wait(sq);
    });
  };
  f.ring_small_s = ring(f.small);
  f.ring_large_s = ring(f.large);
  f.bandwidth = static_cast<double>(f.large - f.small) / std::max(1e-9, f.ring_large_s - f.ring_small_s);
  f.latency = std::max(0.0, f.ring_small_s - static_cast<double>(f.small) / f.bandwidth);
  // All-to-all of f.large bytes per rank (a block of large/n to every rank, one of them local).
  const std::size_t a2a = f.large / static_cast<std::size_t>(n) * static_cast<std::size_t>(n);
  {
    std::vector<std::byte> s(a2a, std::byte{2}), r(a2a);
    f.a2a_bytes = static_cast<double>(a2a);
    f.a2a_s = slowest_best(t, reps, [&] { t.all_to_all(std::span<const std::byte>(s), std::span<std::byte>(r)); });
  }
  {
    f.copy_bytes = static_cast<double>(f.large);
    std::vector<std::byte> s(f.large, std::byte{3}), r(f.large);
    f.copy_s = slowest_best(t, reps, [&] { std::memcpy(r.data(), s.data(), s.size()); });
    f.hbm = 2.0 * f.copy_bytes / f.copy_s;
  }
  return f;
}

replay::HardwareProfile make_profile(const char* transport, int world, const KernelFit& k, const LinkFit& l) {
  replay::HardwareProfile p;
  p.name = std::string("this-machine-") + transport + "-w" + std::to_string(world);
  p.peak_flops = k.peak;
  p.attention_efficiency = std::min(1.0, k.r_inf / k.peak);
  p.attention_tile = kTile;
  p.attention_tile_overhead = k.overhead;
  p.attention_half_length = 0;  // the tile model carries the length dependence
  p.attention_backward_factor = std::clamp(k.bwd_factor, 0.05, 2.0);
  p.kernel_launch = k.launch;
  p.hbm_bandwidth = l.hbm;
  p.intra = {l.bandwidth, l.latency};
  p.inter = p.intra;  // one node: no rank pair crosses it
  p.ranks_per_node = world;
  p.nics_per_node = 1;
  const double phys = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
  p.memory_bytes = std::max(1.0, phys / world);
  p.value_bytes = 4;
  p.cores_per_node = cores();
  return p;
}

// ---------------------------------------------------------------------------------------------------
// Strategies: measured and predicted.

/// CpuFlash<float> (1 thread) that adds the wall time of its calls to `*seconds`: the measured side of the
/// model's compute term, so that an error can be told apart into kernel and communication (one clock read
/// per call, negligible next to a call).
struct TimedFlash {
  using kernel_category = attention::kernel_tag;
  using value_type = float;
  using accum_type = float;
  using exec_type = HostExec;
  attention::CpuFlash<float> flash{{.threads = 1}};
  std::shared_ptr<double> seconds = std::make_shared<double>(0.0);

  [[nodiscard]] std::size_t workspace_bytes(const AttentionShape& shape, std::int64_t q_rows,
                                            std::int64_t k_rows) const {
    return flash.workspace_bytes(shape, q_rows, k_rows);
  }
  [[nodiscard]] const HostExec& exec() const noexcept { return flash.exec(); }
  [[nodiscard]] Status can_implement(const AttentionShape& shape) const { return flash.can_implement(shape); }
  void forward(const HostExec& exec, const AttentionShape& shape, ThdView<const float> q, ThdView<const float> k,
               ThdView<const float> v, std::span<const AttnSlice> slices, ThdView<float> o, LseView<float> lse,
               std::span<std::byte> workspace) const {
    const auto t0 = Clock::now();
    flash.forward(exec, shape, q, k, v, slices, o, lse, workspace);
    *seconds += seconds_since(t0);
  }
  void backward(const HostExec& exec, const AttentionShape& shape, ThdView<const float> q, ThdView<const float> k,
                ThdView<const float> v, ThdView<const float> o, LseView<const float> lse, ThdView<const float> dout,
                std::span<const AttnSlice> slices, ThdView<float> dq, ThdView<float> dk, ThdView<float> dv,
                std::span<std::byte> workspace) const {
    const auto t0 = Clock::now();
    flash.backward(exec, shape, q, k, v, o, lse, dout, slices, dq, dk, dv, workspace);
    *seconds += seconds_since(t0);
  }
};
static_assert(attention::AttentionKernel<TimedFlash>);

struct Row {
  std::string transport, strategy, pass;
  int world = 0;
  double predicted_s = 0, measured_s = 0;
  double predicted_compute_s = 0, predicted_exposed_comm_s = 0;
  double measured_kernel_s = 0;  ///< slowest rank's kernel time in the best repetition
  double cpu_share = 0;          ///< CPU the ranks used / (cores they could use x wall): < ~0.9 = contended
  [[nodiscard]] double error() const { return (predicted_s - measured_s) / measured_s; }
  [[nodiscard]] bool pass_25() const { return std::fabs(error()) <= 0.25; }
};

struct Measured {
  double fwd_s = 0, bwd_s = 0;
  double fwd_kernel_s = 0, bwd_kernel_s = 0;  // slowest rank's kernel time in the best repetition
  double fwd_cpu = 0, bwd_cpu = 0;            // CPU our ranks used / (cores x wall) in the best repetition
};

struct Timing {
  double wall_s = 0, kernel_s = 0, cpu = 0;
};

// As slowest_best, plus the slowest rank's kernel time (*kernel_seconds accumulated by op) and the share of
// the node's cores the ranks used, both in the best repetition.
template <Transport T, class Op>
Timing slowest_best_with_kernel(T& t, int reps, double* kernel_seconds, Op&& op) {
  op();
  Timing best{std::numeric_limits<double>::infinity(), 0, 0};
  std::vector<double> all(3 * static_cast<std::size_t>(t.size()));
  for (int i = 0; i < reps; ++i) {
    t.barrier();
    *kernel_seconds = 0;
    const double cpu0 = thread_cpu_seconds();
    const auto t0 = Clock::now();
    op();
    const double mine[3] = {seconds_since(t0), *kernel_seconds, thread_cpu_seconds() - cpu0};
    t.all_gather(as_bytes_of(std::span<const double>(mine, 3)), as_writable_bytes_of(std::span<double>(all)));
    Timing rep;
    double cpu = 0;
    for (std::size_t r = 0; r < all.size(); r += 3) {
      rep.wall_s = std::max(rep.wall_s, all[r]);
      rep.kernel_s = std::max(rep.kernel_s, all[r + 1]);
      cpu += all[r + 2];
    }
    rep.cpu = cpu / (std::min(t.size(), cores()) * rep.wall_s);
    if (rep.wall_s < best.wall_s) best = rep;
  }
  return best;
}

template <class S, Transport T>
Measured run_strategy(T& t, const DocumentBatch& batch, const AttentionShape& shape, const typename S::Arguments& args,
                      int reps) {
  TimedFlash kernel;
  const std::shared_ptr<double> kernel_seconds = kernel.seconds;
  DistributedAttention<S, TimedFlash> attn(t, shape, args, std::move(kernel));  // kernel_seconds stays shared
  const std::int64_t n = attn.local_tokens(batch);
  const int hq = shape.heads_q, hkv = shape.heads_kv, d = shape.head_dim;
  ThdTensor<float> q(n, hq, d), k(n, hkv, d), v(n, hkv, d), o(n, hq, d), dout(n, hq, d), dq(n, hq, d), dk(n, hkv, d),
      dv(n, hkv, d);
  std::mt19937_64 rng(static_cast<std::uint64_t>(100 + t.rank()));
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (auto* x : {&q, &k, &v, &dout})
    for (float& e : x->storage) e = dist(rng);
  LseTensor<float> lse(hq, n);
  Measured m;
  const Timing f = slowest_best_with_kernel(
      t, reps, kernel_seconds.get(), [&] { attn.forward(batch, q.view(), k.view(), v.view(), o.view(), lse.view()); });
  const Timing b = slowest_best_with_kernel(t, reps, kernel_seconds.get(), [&] {
    attn.backward(batch, q.view(), k.view(), v.view(), o.view(), lse.view(), dout.view(), dq.view(), dk.view(),
                  dv.view());
  });
  m = {f.wall_s, b.wall_s, f.kernel_s, b.kernel_s, f.cpu, b.cpu};
  return m;
}

template <class S>
void predict_rows(const char* transport, const char* name, int world, const DocumentBatch& batch,
                  const AttentionShape& shape, const typename S::Arguments& args, const replay::HardwareProfile& hw,
                  const Measured& m, std::vector<Row>& rows) {
  const Topology topo{world, world};
  const replay::CompiledStrategy compiled = plan::compile_all<S>(args, batch, shape, topo);
  if (!compiled.status) {
    std::printf("%s refused: %s\n", name, compiled.status.reason.c_str());
    return;
  }
  replay::SimulationOptions options;
  options.hardware = hw;
  const replay::AttentionPrediction p = replay::predict(compiled, topo, shape, options);
  rows.push_back({transport, name, "fwd", world, p.forward.time_s, m.fwd_s, p.forward.max_compute_s(),
                  p.forward.max_exposed_comm_s(), m.fwd_kernel_s, m.fwd_cpu});
  rows.push_back({transport, name, "bwd", world, p.backward.time_s, m.bwd_s, p.backward.max_compute_s(),
                  p.backward.max_exposed_comm_s(), m.bwd_kernel_s, m.bwd_cpu});
}

using Ulysses = Strategy<partition::Uniform, comm::AllToAll>;
using ZigzagRing = Strategy<partition::Zigzag, comm::Ring>;

ZigzagRing::Arguments aware_args() {
  ZigzagRing::Arguments a;
  a.comm.sharding_aware = true;
  return a;
}

// Every strategy on one world: measured on all ranks of `t`; the returned timings are the same on every rank.
template <Transport T>
std::vector<Measured> run_all(T& t, const DocumentBatch& batch, const AttentionShape& shape, int reps) {
  std::vector<Measured> out;
  out.push_back(run_strategy<Ulysses>(t, batch, shape, {}, reps));
  out.push_back(run_strategy<ZigzagRing>(t, batch, shape, {}, reps));
  out.push_back(run_strategy<ZigzagRing>(t, batch, shape, aware_args(), reps));
  return out;
}

void predict_all(const char* transport, int world, const DocumentBatch& batch, const AttentionShape& shape,
                 const replay::HardwareProfile& hw, const std::vector<Measured>& m, std::vector<Row>& rows) {
  predict_rows<Ulysses>(transport, "ulysses", world, batch, shape, {}, hw, m[0], rows);
  predict_rows<ZigzagRing>(transport, "zigzag-ring", world, batch, shape, {}, hw, m[1], rows);
  predict_rows<ZigzagRing>(transport, "zigzag-ring-aware", world, batch, shape, aware_args(), hw, m[2], rows);
}

DocumentBatch make_batch(std::int64_t tokens) {
  // Two sequences of lognormal document lengths (median tokens/12, sigma 1), fixed seed.
  std::mt19937 rng(2026);
  std::lognormal_distribution<double> lengths(std::log(static_cast<double>(tokens) / 12.0), 1.0);
  std::vector<std::vector<std::int64_t>> seqs(2);
  for (auto& docs : seqs)
    for (std::int64_t left = tokens / 2; left > 0;) {
      const std::int64_t len = std::clamp<std::int64_t>(std::llround(lengths(rng)), 1, left);
      docs.push_back(len);
      left -= len;
    }
  return DocumentBatch(seqs);
}

// ---------------------------------------------------------------------------------------------------
// Output.

void print_kernel(const KernelFit& k) {
  std::printf("kernel CpuFlash<float>, 1 thread per rank, %d ranks computing at once: FMA peak %.1f GFLOP/s per core\n",
              k.threads, k.peak * 1e-9);
  std::printf("  %-6s %6s %12s %12s %12s %12s\n", "mask", "L", "fwd GFLOP/s", "model", "bwd GFLOP/s", "model");
  for (const KernelPoint& p : k.points) {
    std::printf("  %-6s %6lld %12.2f %12.2f %12.2f %12.2f\n", p.mask.c_str(), static_cast<long long>(p.length),
                p.flops / p.fwd_s * 1e-9, p.flops / k.model_fwd_s(p) * 1e-9, 2.5 * p.flops / p.bwd_s * 1e-9,
                2.5 * p.flops / k.model_bwd_s(p) * 1e-9);
  }
  std::printf(
      "  fit: r_inf %.2f GFLOP/s per computed slot (%.1f%% of peak), tile %d, overhead %.2f blocks per query "
      "block; backward factor %.3f; per call %.2f us; cpu %.2f\n",
      k.r_inf * 1e-9, 100 * k.r_inf / k.peak, kTile, k.overhead, k.bwd_factor, k.launch * 1e6, k.cpu);
}

void print_links(const char* transport, int world, const LinkFit& l) {
  const replay::LinkClass link{l.bandwidth, l.latency};
  // What the simulator charges an all-to-all instance: latency + (bytes each rank sends to others) / bw.
  const double a2a_model = link.time(l.a2a_bytes * (world - 1) / world);
  std::printf(
      "links %s w%d: ring step %zu B %.1f us, %zu B %.1f us -> %.2f GB/s, latency %.1f us; "
      "all_to_all %.0f B %.1f us (link model %.1f us, %+.0f%%); memcpy %.2f GB/s/rank (hbm_bandwidth %.2f)\n",
      transport, world, l.small, l.ring_small_s * 1e6, l.large, l.ring_large_s * 1e6, l.bandwidth * 1e-9,
      l.latency * 1e6, l.a2a_bytes, l.a2a_s * 1e6, a2a_model * 1e6, 100 * (a2a_model - l.a2a_s) / l.a2a_s,
      l.copy_bytes / l.copy_s * 1e-9, l.hbm * 1e-9);
}

void print_rows(const std::vector<Row>& rows) {
  // pred_kernel: the slowest rank's simulated kernel time; meas_kernel: the slowest rank's measured time inside
  // kernel calls (time-shared with the other ranks on the node, as the simulator's compute is);
  // pred_xcomm: the slowest rank's simulated time blocked on transfers; cpu: CPU time the ranks used over
  // (min(ranks, cores) x wall) -- well below 1 means other jobs took cores (or ranks sat in waits).
  std::printf("\n%-7s %5s %-18s %-4s %12s %12s %8s %6s %12s %12s %10s %5s\n", "transp", "world", "strategy", "pass",
              "predicted_ms", "measured_ms", "error", "+-25%", "pred_kernel", "meas_kernel", "pred_xcomm", "cpu");
  for (const Row& r : rows)
    std::printf("%-7s %5d %-18s %-4s %12.2f %12.2f %+7.1f%% %6s %12.2f %12.2f %10.2f %5.2f\n", r.transport.c_str(),
                r.world, r.strategy.c_str(), r.pass.c_str(), r.predicted_s * 1e3, r.measured_s * 1e3, 100 * r.error(),
                r.pass_25() ? "PASS" : "FAIL", r.predicted_compute_s * 1e3, r.measured_kernel_s * 1e3,
                r.predicted_exposed_comm_s * 1e3, r.cpu_share);
  int ok = 0;
  for (const Row& r : rows) ok += r.pass_25() ? 1 : 0;
  std::printf("%d of %zu within +-25%%\n", ok, rows.size());
}

bool write_outputs(const Config& c, const std::vector<Row>& rows, const replay::HardwareProfile& profile,
                   const DocumentBatch& batch, const AttentionShape& shape) {
  bool ok = true;
  if (!c.json.empty()) {
    std::vector<bench::JsonRecord> records;
    for (const Row& r : rows)
      records.push_back(bench::JsonRecord()
                            .add("transport", r.transport)
                            .add("world", r.world)
                            .add("strategy", r.strategy)
                            .add("pass", r.pass)
                            .add("tokens", batch.total_tokens())
                            .add("heads_q", shape.heads_q)
                            .add("heads_kv", shape.heads_kv)
                            .add("head_dim", shape.head_dim)
                            .add("predicted_s", r.predicted_s)
                            .add("measured_s", r.measured_s)
                            .add("error", r.error())
                            .add("within_25pct", r.pass_25())
                            .add("predicted_compute_s", r.predicted_compute_s)
                            .add("predicted_exposed_comm_s", r.predicted_exposed_comm_s)
                            .add("measured_kernel_s", r.measured_kernel_s)
                            .add("cpu_share", r.cpu_share));
    ok = bench::write_json(c.json, records) && ok;
  }
  if (!c.profile_out.empty()) {
    std::ofstream out(c.profile_out);
    out << replay::to_json(profile);
    out.close();
    if (!out) {
      std::fprintf(stderr, "cannot write %s\n", c.profile_out.c_str());
      ok = false;
    }
  }
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
#if SEQPAR_BENCH_MPI
  backend::mpi::Environment env(argc, argv);
#endif
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  Config c;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--smoke")
      c.smoke = true;
    else if (a == "--reps" && i + 1 < argc)
      c.reps = std::max(1, std::stoi(argv[++i]));
    else if (a == "--tokens" && i + 1 < argc)
      c.tokens = std::max<std::int64_t>(64, std::stoll(argv[++i]));
    else if (a == "--json" && i + 1 < argc)
      c.json = argv[++i];
    else if (a == "--worlds" && i + 1 < argc) {
      c.worlds.clear();
      for (std::string list = argv[++i]; !list.empty();) {
        const std::size_t comma = list.find(',');
        c.worlds.push_back(std::max(1, std::stoi(list.substr(0, comma))));
        list = comma == std::string::npos ? "" : list.substr(comma + 1);
      }
    } else if (a == "--profile-out" && i + 1 < argc)
      c.profile_out = argv[++i];
    else {
      std::fprintf(stderr,
                   "unknown argument %s\nusage: calibrate [--smoke] [--reps N] [--tokens N] [--worlds 2,4,8] "
                   "[--json FILE] [--profile-out FILE]\n",
                   a.c_str());
      return 2;
    }
  }
  if (c.smoke) {
    c.tokens = std::min<std::int64_t>(c.tokens, 1024);
    c.reps = 1;
    c.worlds = {2};
  }
  // Ulysses splits heads: heads_q = 8 serves up to 8 ranks. d 64, MHA (Hkv 8) keeps KV blocks large.
  const AttentionShape shape{8, 8, 64};
  const DocumentBatch batch = make_batch(c.tokens);
  std::printf(
      "calibrate: %lld tokens in 2 sequences of %zu documents, heads %d:%d, d %d, fp32, CpuFlash 1 thread "
      "per rank, %u cores\n",
      static_cast<long long>(batch.total_tokens()), batch.documents().size(), shape.heads_q, shape.heads_kv,
      shape.head_dim, std::thread::hardware_concurrency());
  std::vector<Row> rows;
  replay::HardwareProfile last;

#if SEQPAR_BENCH_MPI
  constexpr const char* kTransport = "mpi";
  return backend::mpi::run_or_abort(MPI_COMM_WORLD, [&](backend::mpi::Transport& t) {
    // The kernel on rank 0, one pinned thread per core; the others wait in the barrier (the transport's
    // waits back off to sleeps, so they leave the cores to it).
    KernelFit kernel;
    if (t.rank() == 0) kernel = measure_kernel(shape, c.smoke, cores());
    t.barrier();
    const LinkFit links = measure_links(t, c.smoke);
    const std::vector<Measured> m = run_all(t, batch, shape, c.reps);
    if (t.rank() != 0) return 0;
    print_kernel(kernel);
    print_links(kTransport, t.size(), links);
    last = make_profile(kTransport, t.size(), kernel, links);
    predict_all(kTransport, t.size(), batch, shape, last, m, rows);
    print_rows(rows);
    return write_outputs(c, rows, last, batch, shape) ? 0 : 1;
  });
#else
  constexpr const char* kTransport = "inproc";
  try {
    const KernelFit kernel = measure_kernel(shape, c.smoke, cores());
    print_kernel(kernel);
    for (int world : c.worlds) {
      LinkFit links;
      std::vector<Measured> m;
      backend::inproc::World(world).run([&](backend::inproc::Transport& t) {
        LinkFit l = measure_links(t, c.smoke);
        std::vector<Measured> mine = run_all(t, batch, shape, c.reps);
        if (t.rank() == 0) {
          links = l;
          m = std::move(mine);
        }
      });
      print_links(kTransport, world, links);
      last = make_profile(kTransport, world, kernel, links);
      predict_all(kTransport, world, batch, shape, last, m, rows);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "calibrate: %s\n", e.what());
    return 1;
  }
  print_rows(rows);
  return write_outputs(c, rows, last, batch, shape) ? 0 : 1;
#endif
}
