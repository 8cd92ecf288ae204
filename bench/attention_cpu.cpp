// SPDX-License-Identifier: Apache-2.0
// CpuFlash forward/backward throughput against this machine's measured fp32 FMA peak and against an
// unfused baseline (OpenBLAS sgemm for Q K^T and P V plus a softmax pass) when OpenBLAS is available.
// FLOPs = 4 * d * Hq * (visible pairs) forward, 2.5x that backward. Best-of-N timing.
//   attention_cpu [--smoke] [--quick] [--threads N] [--seq N] [--json FILE]
#include <seqpar/seqpar.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#if defined(SEQPAR_BENCH_OPENBLAS)
#include <cblas.h>
extern "C" void openblas_set_num_threads(int);
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

using namespace seqpar;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// ---- peak: register-blocked FMA loop, independent accumulators per thread, all summed ----
// Enough chains to cover FMA latency x throughput (>= 10), few enough to stay in registers with the
// two constants: AVX2 has 16 ymm registers (16 accumulators there spill and measure memory, not FMA).
#if defined(__AVX512F__)
constexpr int kAccumulators = 16;
#else
constexpr int kAccumulators = 12;
#endif

float fma_loop(std::int64_t iters, float seed) {
#if defined(__AVX512F__)
  __m512 acc[kAccumulators];
  for (int i = 0; i < kAccumulators; ++i) acc[i] = _mm512_set1_ps(seed + float(i) * 1e-3f);
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  const auto step = [&]<std::size_t... I>(std::index_sequence<I...>) {
    ((acc[I] = _mm512_fmadd_ps(acc[I], a, b)), ...);
  };
  for (std::int64_t it = 0; it < iters; ++it) step(std::make_index_sequence<kAccumulators>{});
  __m512 s = acc[0];
  for (int i = 1; i < kAccumulators; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc[kAccumulators];
  for (int i = 0; i < kAccumulators; ++i) acc[i] = _mm256_set1_ps(seed + float(i) * 1e-3f);
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  // Unrolled by a fold so the accumulators live in registers (a loop over the array may stay in memory).
  const auto step = [&]<std::size_t... I>(std::index_sequence<I...>) {
    ((acc[I] = _mm256_fmadd_ps(acc[I], a, b)), ...);
  };
  for (std::int64_t it = 0; it < iters; ++it) step(std::make_index_sequence<kAccumulators>{});
  __m256 s = acc[0];
  for (int i = 1; i < kAccumulators; ++i) s = _mm256_add_ps(s, acc[i]);
  alignas(32) float out[8];
  _mm256_store_ps(out, s);
  return out[0] + out[1] + out[2] + out[3] + out[4] + out[5] + out[6] + out[7];
#else
  float acc[kAccumulators];
  for (int i = 0; i < kAccumulators; ++i) acc[i] = seed + float(i) * 1e-3f;
  for (std::int64_t it = 0; it < iters; ++it)
    for (int i = 0; i < kAccumulators; ++i) acc[i] = acc[i] * 0.999999f + 1e-7f;
  float s = 0;
  for (float x : acc) s += x;
  return s;
#endif
}

/// fp32 lanes per FMA of the widest vector unit the build targets.
constexpr int lanes() {
#if defined(__AVX512F__)
  return 16;
#elif defined(__AVX2__) && defined(__FMA__)
  return 8;
#else
  return 1;
#endif
}

double measure_peak(int threads) {
  const std::int64_t iters = 20'000'000;  // kAccumulators * lanes() * 2 flops per iteration
  double best = 0;
  volatile float sink = 0;
  for (int rep = 0; rep < 3; ++rep) {
    std::vector<float> out(static_cast<std::size_t>(threads));
    const auto t0 = Clock::now();
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t)
      ts.emplace_back([&, t] { out[static_cast<std::size_t>(t)] = fma_loop(iters, float(t)); });
    for (auto& t : ts) t.join();
    const double s = seconds_since(t0);
    for (float x : out) sink = sink + x;
    best = std::max(best, 2.0 * kAccumulators * lanes() * double(iters) * threads / s * 1e-9);
  }
  return best;
}

// ---- problem setup ----
struct Problem {
  std::int64_t seq = 0;
  int d = 0, hq = 0, hkv = 0;
  std::string mask;  // "causal" | "doc"
  std::vector<AttnSlice> slices;
  std::vector<std::int64_t> docs;
  std::int64_t area = 0;
};

Problem make_problem(std::int64_t seq, int d, int hq, int hkv, const std::string& mask) {
  Problem p{seq, d, hq, hkv, mask, {}, {}, 0};
  if (mask == "causal") {
    p.docs = {seq};
  } else {  // lognormal document lengths, fixed seed, median seq/16
    std::mt19937_64 rng(42);
    std::lognormal_distribution<double> dist(std::log(double(seq) / 16.0), 1.0);
    std::int64_t left = seq;
    while (left > 0) {
      const std::int64_t len = std::clamp<std::int64_t>(std::llround(dist(rng)), 1, left);
      p.docs.push_back(len);
      left -= len;
    }
  }
  std::int64_t at = 0;
  for (std::int64_t len : p.docs) {
    p.slices.push_back({{at, at + len}, {at, at + len}, Mask::causal()});
    at += len;
  }
  p.area = total_area(p.slices);
  return p;
}

template <class F>
double best_time(F&& f, double budget_s, int max_reps) {
  double best = 1e300, total = 0;
  for (int rep = 0; rep < max_reps && (rep < 2 || total < budget_s); ++rep) {
    const auto t0 = Clock::now();
    f();
    const double s = seconds_since(t0);
    best = std::min(best, s);
    total += s;
  }
  return best;
}

#if defined(SEQPAR_BENCH_OPENBLAS)
// Unfused forward: per head and document, S = scale Q K^T (sgemm), masked softmax, O = P V (sgemm).
void unfused_forward(const Problem& p, const AttentionShape& shape, ThdView<const float> q, ThdView<const float> k,
                     ThdView<const float> v, ThdView<float> o, std::vector<float>& s) {
  const std::int64_t maxdoc = *std::max_element(p.docs.begin(), p.docs.end());
  s.resize(static_cast<std::size_t>(maxdoc * maxdoc));
  const float scale = float(shape.scale());
  for (int h = 0; h < p.hq; ++h) {
    const int hk = h / shape.group_size();
    std::int64_t at = 0;
    for (std::int64_t n : p.docs) {
      const int ni = int(n);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, ni, ni, p.d, scale, q.row(at, h), int(q.token_stride),
                  k.row(at, hk), int(k.token_stride), 0.0f, s.data(), ni);
      for (std::int64_t i = 0; i < n; ++i) {
        float* row = s.data() + i * n;
        float m = -INFINITY;
        for (std::int64_t j = 0; j <= i; ++j) m = std::max(m, row[j]);
        float sum = 0;
        for (std::int64_t j = 0; j <= i; ++j) {
          row[j] = std::exp(row[j] - m);
          sum += row[j];
        }
        const float inv = 1.0f / sum;
        for (std::int64_t j = 0; j <= i; ++j) row[j] *= inv;
        std::fill(row + i + 1, row + n, 0.0f);
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, ni, p.d, ni, 1.0f, s.data(), ni, v.row(at, hk),
                  int(v.token_stride), 0.0f, o.row(at, h), int(o.token_stride));
      at += n;
    }
  }
}
#endif

struct Record {
  std::string pass;
  Problem p;
  int threads;
  double gflops, peak, baseline;
};

}  // namespace

int main(int argc, char** argv) {
  bool smoke = false, quick = false;
  std::vector<int> thread_list{1, 2};
  std::vector<std::int64_t> seqs{4096, 16384};
  std::string json;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--smoke")
      smoke = true;
    else if (a == "--quick")
      quick = true;
    else if (a == "--threads" && i + 1 < argc)
      thread_list = {std::atoi(argv[++i])};
    else if (a == "--seq" && i + 1 < argc)
      seqs = {std::atoll(argv[++i])};
    else if (a == "--json" && i + 1 < argc)
      json = argv[++i];
    else {
      std::fprintf(stderr, "usage: %s [--smoke] [--quick] [--threads N] [--seq N] [--json FILE]\n", argv[0]);
      return 2;
    }
  }
#if defined(SEQPAR_BENCH_OPENBLAS)
  setenv("OPENBLAS_CORETYPE", "SkylakeX", 0);  // OpenBLAS 0.3.21 misdetects Zen 5 as Haswell
  const bool have_blas = true;
#else
  const bool have_blas = false;
#endif

  struct Config {
    std::int64_t seq;
    int d, hq, hkv;
    std::string mask;
  };
  std::vector<Config> configs;
  if (smoke) {
    configs.push_back({256, 64, 2, 2, "causal"});
    thread_list = {thread_list.back()};
  } else {
    for (std::int64_t s : seqs)
      for (int d : {128, 64})
        for (auto [hq, hkv] : {std::pair{8, 8}, std::pair{32, 8}})
          for (const char* m : {"causal", "doc"}) {
            if (quick && !(hq == 8 && (s <= 4096 || (d == 128 && std::string(m) == "causal")))) continue;
            configs.push_back({s, d, hq, hkv, m});
          }
  }

  std::vector<double> peak(3, 0.0);
  for (int t : thread_list) peak[static_cast<std::size_t>(t)] = measure_peak(t);
  std::printf("measured fp32 FMA peak:");
  for (int t : thread_list) std::printf("  %dT %.0f GFLOP/s", t, peak[static_cast<std::size_t>(t)]);
  std::printf("\n\n%-5s %-6s %6s %4s %7s %3s %9s %8s %6s %9s %7s\n", "pass", "mask", "seq", "d", "Hq:Hkv", "thr",
              "GFLOP/s", "peak", "frac", "baseline", "ratio");

  std::vector<Record> records;
  const double budget = smoke ? 0.2 : quick ? 2.0 : 4.0;
  for (const Config& c : configs) {
    const Problem p = make_problem(c.seq, c.d, c.hq, c.hkv, c.mask);
    const AttentionShape shape{c.hq, c.hkv, c.d, 0.0};
    std::mt19937_64 rng(1);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    ThdTensor<float> q(c.seq, c.hq, c.d), k(c.seq, c.hkv, c.d), v(c.seq, c.hkv, c.d), o(c.seq, c.hq, c.d),
        dout(c.seq, c.hq, c.d), dq(c.seq, c.hq, c.d), dk(c.seq, c.hkv, c.d), dv(c.seq, c.hkv, c.d);
    for (auto* t : {&q, &k, &v, &dout})
      for (float& x : t->storage) x = dist(rng);
    LseTensor<float> lse(c.hq, c.seq);
    const double fwd_flops = 4.0 * c.d * c.hq * double(p.area);
    for (int threads : thread_list) {
      const attention::CpuFlash<float> flash({.threads = threads});
      std::vector<std::byte> ws(flash.workspace_bytes(shape, c.seq, c.seq));
      const double tf = best_time(
          [&] { flash.forward(shape, q.view(), k.view(), v.view(), p.slices, o.view(), lse.view(), ws); }, budget, 5);
      const double tb = best_time(
          [&] {
            flash.backward(shape, q.view(), k.view(), v.view(), o.view(), lse.view(), dout.view(), p.slices, dq.view(),
                           dk.view(), dv.view(), ws);
          },
          budget, 3);
      double base = 0;
#if defined(SEQPAR_BENCH_OPENBLAS)
      if (!smoke || true) {
        openblas_set_num_threads(threads);
        ThdTensor<float> ob(c.seq, c.hq, c.d);
        std::vector<float> s;
        const double tu = best_time([&] { unfused_forward(p, shape, q.view(), k.view(), v.view(), ob.view(), s); },
                                    budget, c.seq > 8192 ? 1 : 2);
        base = fwd_flops / tu * 1e-9;
      }
#endif
      const double pk = peak[static_cast<std::size_t>(threads)];
      records.push_back({"fwd", p, threads, fwd_flops / tf * 1e-9, pk, base});
      records.push_back({"bwd", p, threads, 2.5 * fwd_flops / tb * 1e-9, pk, 0.0});
      for (std::size_t r = records.size() - 2; r < records.size(); ++r) {
        const Record& x = records[r];
        char base_s[32] = "n/a", ratio_s[32] = "";
        if (x.baseline > 0) {
          std::snprintf(base_s, sizeof base_s, "%.1f", x.baseline);
          std::snprintf(ratio_s, sizeof ratio_s, "%.2fx", x.gflops / x.baseline);
        }
        std::printf("%-5s %-6s %6lld %4d %4d:%-2d %3d %9.1f %8.0f %5.1f%% %9s %7s\n", x.pass.c_str(), c.mask.c_str(),
                    static_cast<long long>(c.seq), c.d, c.hq, c.hkv, threads, x.gflops, pk, 100.0 * x.gflops / pk,
                    x.pass == "fwd" ? base_s : "", ratio_s);
        std::fflush(stdout);
      }
    }
  }
  if (!have_blas) std::printf("\nbaseline n/a: built without OpenBLAS\n");

  if (!json.empty()) {
    std::ofstream f(json);
    f << "[\n";
    for (std::size_t i = 0; i < records.size(); ++i) {
      const Record& r = records[i];
      f << "  {\"kernel\": \"CpuFlash<float>\", \"pass\": \"" << r.pass << "\", \"seq_len\": " << r.p.seq
        << ", \"head_dim\": " << r.p.d << ", \"heads_q\": " << r.p.hq << ", \"heads_kv\": " << r.p.hkv
        << ", \"mask\": \"" << r.p.mask << "\", \"documents\": " << r.p.docs.size() << ", \"threads\": " << r.threads
        << ", \"gflops\": " << r.gflops << ", \"peak_gflops\": " << r.peak
        << ", \"fraction_of_peak\": " << r.gflops / r.peak << ", \"baseline_gflops\": ";
      if (r.baseline > 0)
        f << r.baseline;
      else
        f << "null";
      f << "}" << (i + 1 < records.size() ? "," : "") << "\n";
    }
    f << "]\n";
  }
  return 0;
}
