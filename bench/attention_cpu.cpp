// SPDX-License-Identifier: Apache-2.0
// CpuFlash forward/backward throughput against this machine's measured fp32 FMA peak and against an
// unfused baseline (OpenBLAS sgemm for Q K^T and P V plus a softmax pass) when OpenBLAS is available.
// FLOPs = 4 * d * Hq * (visible pairs) forward, 2.5x that backward. Best-of-N timing.
//   attention_cpu [--smoke] [--quick] [--threads N,..] [--seq N,..] [--d N,..] [--mask causal|doc,..]
//                 [--heads HQ:HKV,..] [--dtype fp32|bf16|both] [--no-blas] [--peer torch] [--python PATH]
//                 [--rounds N] [--isa auto|portable|avx2|avx512|avx512bf16|all,..] [--json FILE]
// Each list option selects a subset of the default table (threads 1,2 x seq 4096,16384 x d 128,64 x heads
// 8:8,32:8 x mask causal,doc: all of it takes well over 10 minutes on 2 cores); the rows are the product of the
// lists. --no-blas skips the unfused OpenBLAS baseline (slow at 16K: tens of seconds per run).
// --dtype both (the default) adds CpuFlash<bf16> rows (bf16 storage, fp32 accumulation) after each fp32 row; bf16
// gives those rows only. avx512bf16 (the bf16 dot products, bf16 storage only) has bf16 rows only; its peak is the
// vdpbf16ps loop's (2 multiply-adds per fp32 lane), so its rows' fractions are of a peak twice the fp32 one.
// --peer torch runs bench/torch_peer/sdpa.py (PyTorch's scaled_dot_product_attention, same shapes, same run)
// with the venv made by bench/torch_peer/install.sh and prints our GFLOP/s over torch's.
// --isa picks the micro-kernels' instruction set (default auto: what CpuFlash picks on this CPU; "all": every one
// this CPU runs, one set of rows each, against the FMA peak of that instruction set measured in the same run).
// The micro-kernel rows time each policy's tile gemm alone, so a code-generation regression shows.
// --rounds N runs the whole table N times, one configuration after another, and keeps each row's best (ours and
// torch's alike): on a shared machine a burst of load then costs one round of a row, not the row.
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
#if SEQPAR_CPU_DISPATCH
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
// One loop per instruction set CpuFlash has, compiled for it by a target attribute (as its tiles are), so
// each row's fraction is of the peak of the instruction set that ran it. The portable path's peak is the
// plain loop at the build's flags (what the compiler makes of the portable tiles).
#if SEQPAR_CPU_DISPATCH
__attribute__((target("avx512f"))) float fma_loop_avx512(std::int64_t iters, float seed) {
  constexpr int kAcc = 16;
  __m512 acc[kAcc];
  _Pragma("GCC unroll 16") for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_set1_ps(seed + float(i) * 1e-3f);
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  for (std::int64_t it = 0; it < iters; ++it) {
    _Pragma("GCC unroll 16") for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  }
  __m512 s = acc[0];
  _Pragma("GCC unroll 16") for (int i = 1; i < kAcc; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}
// The bf16 dot-product peak: vdpbf16ps, two bf16 multiply-adds per fp32 lane, as the avx512bf16 tiles' S and dP.
__attribute__((target("avx512f,avx512bf16"))) float dpbf16_loop_avx512(std::int64_t iters, float seed) {
  constexpr int kAcc = 16;
  __m512 acc[kAcc];
  _Pragma("GCC unroll 16") for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_set1_ps(seed + float(i) * 1e-3f);
  const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0.5f), _mm512_set1_ps(0.5f));
  const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-7f), _mm512_set1_ps(1e-7f));
  for (std::int64_t it = 0; it < iters; ++it) {
    _Pragma("GCC unroll 16") for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  }
  __m512 s = acc[0];
  _Pragma("GCC unroll 16") for (int i = 1; i < kAcc; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}
__attribute__((target("avx2,fma"))) float fma_loop_avx2(std::int64_t iters, float seed) {
  constexpr int kAcc = 12;
  __m256 acc[kAcc];
  _Pragma("GCC unroll 16") for (int i = 0; i < kAcc; ++i) acc[i] = _mm256_set1_ps(seed + float(i) * 1e-3f);
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  for (std::int64_t it = 0; it < iters; ++it) {
    _Pragma("GCC unroll 16") for (int i = 0; i < kAcc; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  }
  __m256 s = acc[0];
  _Pragma("GCC unroll 16") for (int i = 1; i < kAcc; ++i) s = _mm256_add_ps(s, acc[i]);
  alignas(32) float out[8];
  _mm256_store_ps(out, s);
  return out[0] + out[1] + out[2] + out[3] + out[4] + out[5] + out[6] + out[7];
}
#endif
float fma_loop_portable(std::int64_t iters, float seed) {
  constexpr int kAcc = 12;
  float acc[kAcc];
  for (int i = 0; i < kAcc; ++i) acc[i] = seed + float(i) * 1e-3f;
  for (std::int64_t it = 0; it < iters; ++it)
    for (int i = 0; i < kAcc; ++i) acc[i] = acc[i] * 0.999999f + 1e-7f;
  float s = 0;
  for (float x : acc) s += x;
  return s;
}

/// Multiply-adds per iteration of the isa's loop (accumulators x lanes, x 2 for the bf16 pairs).
int fmas_per_iteration(attention::CpuIsa isa) {
  switch (isa) {
    case attention::CpuIsa::kAvx512Bf16:
      return 16 * 16 * 2;
    case attention::CpuIsa::kAvx512:
      return 16 * 16;
    case attention::CpuIsa::kAvx2:
      return 12 * 8;
    default:
      return 12;
  }
}

float fma_loop(attention::CpuIsa isa, std::int64_t iters, float seed) {
#if SEQPAR_CPU_DISPATCH
  if (isa == attention::CpuIsa::kAvx512Bf16) return dpbf16_loop_avx512(iters, seed);
  if (isa == attention::CpuIsa::kAvx512) return fma_loop_avx512(iters, seed);
  if (isa == attention::CpuIsa::kAvx2) return fma_loop_avx2(iters, seed);
#endif
  return fma_loop_portable(iters, seed);
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

/// One timed run of the isa's FMA loop on `threads` threads (GFLOP/s).
double peak_once(attention::CpuIsa isa, int threads, std::int64_t iters) {
  static volatile float sink = 0;
  std::vector<float> out(static_cast<std::size_t>(threads));
  const auto t0 = Clock::now();
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t)
    ts.emplace_back([&, t] { out[static_cast<std::size_t>(t)] = fma_loop(isa, iters, float(t)); });
  for (auto& t : ts) t.join();
  const double s = seconds_since(t0);
  for (float x : out) sink = sink + x;
  return 2.0 * fmas_per_iteration(isa) * double(iters) * threads / s * 1e-9;
}

/// Best of several short runs per thread count, interleaved (1T, 2T, 1T, 2T, ...) so that a burst of
/// load from other processes costs one sample of each, not every sample of one; `peak` keeps the max
/// over every call (the bench calls this again between configurations). peak[isa][threads].
using Peaks = std::vector<std::vector<double>>;
void measure_peak(const std::vector<attention::CpuIsa>& isas, const std::vector<int>& thread_list, Peaks& peak,
                  int rounds) {
  // ~4 ms samples at full speed (fewer iterations for the narrower loops): many short samples catch a quiet
  // moment more often than a few long ones.
  for (int r = 0; r < rounds; ++r)
    for (attention::CpuIsa isa : isas)
      for (int t : thread_list) {
        double& p = peak[static_cast<std::size_t>(isa)][static_cast<std::size_t>(t)];
        p = std::max(p, peak_once(isa, t, 512'000'000 / fmas_per_iteration(isa)));
      }
}

// ---- micro-kernel: the tile policy's gemm on L1-resident packed tiles, one thread ----
// The shapes of the forward's two tile products: S = Q K^T (96 x 64 x d) and O += P V (96 x d x 64), with B
// packed in column panels as CpuFlash packs K^T and V; P V also with a row-major V (the unpacked layout, whose
// 512-byte row stride at d 128 lands on a few L1 sets), to show what the packing buys.
// A drop here means the micro-kernel's code generation regressed (e.g. accumulators spilled at -O2).
struct KernelRow {
  attention::CpuIsa isa;
  std::string what;
  int m, n, k;
  double gflops;
};

template <class Tiles>
KernelRow time_gemm(const char* what, int m, int n, int k, bool packed, double budget_s) {
  constexpr int kP = Tiles::kPanel;
  const int n_pad = (n + kP - 1) / kP * kP;
  std::vector<float> a(static_cast<std::size_t>(m) * k), b(static_cast<std::size_t>(k) * n_pad),
      c(static_cast<std::size_t>(m) * n);
  const std::int64_t ldb = packed ? kP : n, panel = packed ? std::int64_t{k} * kP : kP;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (float& x : a) x = u(rng);
  for (float& x : b) x = u(rng) * 1e-3f;
  const int inner = std::max(1, int(2e8 / (2.0 * m * n * k)));
  const double t = best_time(
      [&] {
        for (int r = 0; r < inner; ++r) Tiles::gemm(m, n, k, a.data(), k, 1, b.data(), ldb, panel, c.data(), n, true);
      },
      budget_s, 20);
  return {Tiles::kIsa, what, m, n, k, 2.0 * m * n * k * inner / t * 1e-9};
}

/// The bf16 score product S = Q K^T (m x n x k) of a policy with bf16 dot products, B packed as CpuFlash packs K^T.
template <class Tiles>
KernelRow time_gemm_pairs(const char* what, int m, int n, int k, double budget_s) {
  constexpr int kP = Tiles::kPanel;
  const int n_pad = (n + kP - 1) / kP * kP;
  const std::int64_t panel = std::int64_t{(k + 1) / 2} * kP;
  std::vector<float> a(static_cast<std::size_t>(m) * k), c(static_cast<std::size_t>(m) * n);
  std::vector<attention::bf16> keys(static_cast<std::size_t>(n_pad) * k);
  std::vector<std::uint32_t> b(static_cast<std::size_t>(n_pad / kP * panel));
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (float& x : a) x = float(attention::bf16(u(rng)));
  for (attention::bf16& x : keys) x = attention::bf16(u(rng));
  for (int j = 0; j < n_pad; ++j)
    Tiles::pack_key_pairs(keys.data() + static_cast<std::size_t>(j) * k, k, b.data() + (j / kP) * panel + j % kP, kP);
  const int inner = std::max(1, int(2e8 / (2.0 * m * n * k)));
  const double t = best_time(
      [&] {
        for (int r = 0; r < inner; ++r)
          Tiles::gemm_pairs(m, n, k, a.data(), k, 1, b.data(), panel, c.data(), n, false, 1.0f);
      },
      budget_s, 20);
  return {Tiles::kIsa, what, m, n, k, 2.0 * m * n * k * inner / t * 1e-9};
}

/// The tile products of `isa`'s policy at head dim d (bf16 storage's policy: also the bf16 score product).
std::vector<KernelRow> time_tile_gemms(attention::CpuIsa isa, int d, double budget_s) {
  const auto rows = [&]<class Tiles>() {
    constexpr int kKT = attention::detail::kKeyTile;
    std::vector<KernelRow> r;
    if constexpr (attention::detail::kBf16Scores<Tiles>)
      r.push_back(time_gemm_pairs<Tiles>("S = Q K^T, bf16 pairs", 96, kKT, d, budget_s));
    r.push_back(time_gemm<Tiles>("S = Q K^T", 96, kKT, d, true, budget_s));
    r.push_back(time_gemm<Tiles>("O += P V", 96, d, kKT, true, budget_s));
    r.push_back(time_gemm<Tiles>("O += P V, row-major V", 96, d, kKT, false, budget_s));
    return r;
  };
  return attention::detail::with_tile_policy<float, attention::bf16>(isa, rows);
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
  attention::CpuIsa isa;
  std::string pass, dtype;
  Problem p;
  int threads;
  double gflops, baseline, peer;
};

/// Runs `python script ...` for one shape and parses "fwd bwd" GFLOP/s; {0, 0} when it fails.
std::pair<double, double> run_torch_peer(const std::string& python, const std::string& script, const Problem& p,
                                         int threads, const char* dtype, double budget) {
  std::string docs;
  for (std::int64_t n : p.docs) docs += (docs.empty() ? "" : ",") + std::to_string(n);
  const std::string cmd = python + " " + script + " --threads " + std::to_string(threads) + " --hq " +
                          std::to_string(p.hq) + " --hkv " + std::to_string(p.hkv) + " --d " + std::to_string(p.d) +
                          " --dtype " + dtype + " --budget " + std::to_string(budget) + " --docs " + docs;
  FILE* f = popen(cmd.c_str(), "r");
  if (f == nullptr) return {0, 0};
  double fwd = 0, bwd = 0;
  if (std::fscanf(f, "%lf %lf", &fwd, &bwd) != 2) fwd = bwd = 0;
  char rest[256];
  while (std::fgets(rest, sizeof rest, f) != nullptr) {
  }
  if (pclose(f) != 0) return {0, 0};
  return {fwd, bwd};
}

/// "a,b,c" -> {"a", "b", "c"} (an option's list of values: the rows of the table are their product).
std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::size_t at = 0;
  while (true) {
    const std::size_t comma = s.find(',', at);
    out.push_back(s.substr(at, comma == std::string::npos ? std::string::npos : comma - at));
    if (comma == std::string::npos) return out;
    at = comma + 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool smoke = false, quick = false;
  std::vector<int> thread_list{1, 2};
  std::vector<std::int64_t> seqs{4096, 16384};
  std::vector<int> dims{128, 64};
  std::vector<std::string> masks{"causal", "doc"};
  std::vector<std::pair<int, int>> heads{{8, 8}, {32, 8}};
  std::string json, peer;
  bool bf16_rows = true, fp32_rows = true, use_blas = true;
  int rounds = 1;
  std::vector<attention::CpuIsa> isas{attention::CpuIsa::kAuto};
#if defined(SEQPAR_TORCH_PEER_SCRIPT)
  std::string python = SEQPAR_TORCH_PEER_PYTHON, script = SEQPAR_TORCH_PEER_SCRIPT;
#else
  std::string python = "build/torch-venv/bin/python", script = "bench/torch_peer/sdpa.py";
#endif
  const char* usage =
      "usage: %s [--smoke] [--quick] [--threads N,..] [--seq N,..] [--d N,..] [--mask causal|doc,..]\n"
      "          [--heads HQ:HKV,..] [--dtype fp32|bf16|both] [--no-blas] [--peer torch] [--python PATH]\n"
      "          [--rounds N] [--isa auto|portable|avx2|avx512|avx512bf16|all,..] [--json FILE]\n";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has = i + 1 < argc;
    if (a == "--smoke")
      smoke = true;
    else if (a == "--quick")
      quick = true;
    else if (a == "--threads" && has) {
      thread_list.clear();
      for (const std::string& x : split_list(argv[++i])) thread_list.push_back(std::atoi(x.c_str()));
    } else if (a == "--seq" && has) {
      seqs.clear();
      for (const std::string& x : split_list(argv[++i])) {
        seqs.push_back(std::atoll(x.c_str()));
        if (seqs.back() < 1) {
          std::fprintf(stderr, "--seq wants positive lengths, got %s\n", x.c_str());
          return 2;
        }
      }
    } else if (a == "--d" && has) {
      dims.clear();
      for (const std::string& x : split_list(argv[++i])) {
        dims.push_back(std::atoi(x.c_str()));
        if (dims.back() < 1) {
          std::fprintf(stderr, "--d wants positive head dims, got %s\n", x.c_str());
          return 2;
        }
      }
    } else if (a == "--mask" && has) {
      masks = split_list(argv[++i]);
      for (const std::string& m : masks)
        if (m != "causal" && m != "doc") {
          std::fprintf(stderr, "--mask wants causal or doc, got %s\n", m.c_str());
          return 2;
        }
    } else if (a == "--heads" && has) {
      heads.clear();
      for (const std::string& x : split_list(argv[++i])) {
        int hq = 0, hkv = 0;
        if (std::sscanf(x.c_str(), "%d:%d", &hq, &hkv) != 2 || hq < 1 || hkv < 1 || hq % hkv != 0) {
          std::fprintf(stderr, "--heads wants HQ:HKV with HKV dividing HQ, got %s\n", x.c_str());
          return 2;
        }
        heads.emplace_back(hq, hkv);
      }
    } else if (a == "--isa" && has) {
      isas.clear();
      for (const std::string& x : split_list(argv[++i])) {
        if (x == "all") {  // every instruction set this CPU runs, narrowest first
          for (attention::CpuIsa isa : {attention::CpuIsa::kPortable, attention::CpuIsa::kAvx2,
                                        attention::CpuIsa::kAvx512, attention::CpuIsa::kAvx512Bf16})
            if (attention::cpu_isa_runnable(isa)) isas.push_back(isa);
          continue;
        }
        const auto isa = attention::parse_cpu_isa(x);
        if (!isa) {
          std::fprintf(stderr, "--isa wants auto, portable, avx2, avx512, avx512bf16 or all, got %s\n", x.c_str());
          return 2;
        }
        isas.push_back(*isa);
      }
    } else if (a == "--no-blas")
      use_blas = false;
    else if (a == "--dtype" && has) {
      const std::string d = argv[++i];
      if (d != "fp32" && d != "bf16" && d != "both") {
        std::fprintf(stderr, "--dtype wants fp32, bf16 or both (fp32 and bf16), got %s\n", d.c_str());
        return 2;
      }
      bf16_rows = d != "fp32";
      fp32_rows = d != "bf16";
    } else if (a == "--peer" && has)
      peer = argv[++i];
    else if (a == "--python" && has)
      python = argv[++i];
    else if (a == "--json" && has)
      json = argv[++i];
    else if (a == "--rounds" && has) {
      rounds = std::atoi(argv[++i]);
      if (rounds < 1 || rounds > 100) {
        std::fprintf(stderr, "--rounds wants 1..100, got %s\n", argv[i]);
        return 2;
      }
    } else {
      std::fprintf(stderr, usage, argv[0]);
      return 2;
    }
  }
  for (int t : thread_list)
    if (t < 1 || t > 256) {
      std::fprintf(stderr, "--threads must be in [1, 256], got %d\n", t);
      return 2;
    }
  // kAuto becomes what CpuFlash picks here for each storage type (SEQPAR_CPU_ISA included): float's choice,
  // and bf16's where it differs (avx512bf16 on CPUs with AVX512-BF16), whose bf16 rows then run there and not
  // on float's choice. One this CPU lacks is refused.
  std::vector<attention::CpuIsa> bf16_skips;  // auto's float choice where bf16's differs: no bf16 rows on it
  try {
    std::vector<attention::CpuIsa> resolved, named;
    const auto add = [&](attention::CpuIsa isa) {
      if (std::find(resolved.begin(), resolved.end(), isa) == resolved.end()) resolved.push_back(isa);
    };
    for (attention::CpuIsa isa : isas) {
      if (isa != attention::CpuIsa::kAuto) {
        add(attention::resolve_cpu_isa(isa, "attention_cpu --isa", attention::cpu_features(),
                                       isa == attention::CpuIsa::kAvx512Bf16));
        named.push_back(isa);
        continue;
      }
      const attention::CpuIsa for_float =
          attention::resolve_cpu_isa(isa, "attention_cpu --isa", attention::cpu_features(), false);
      const attention::CpuIsa for_bf16 =
          attention::resolve_cpu_isa(isa, "attention_cpu --isa", attention::cpu_features(), true);
      add(for_float);
      if (for_bf16 != for_float && bf16_rows) {
        add(for_bf16);
        bf16_skips.push_back(for_float);
      }
    }
    isas = resolved;
    // An ISA named explicitly runs bf16 rows even where auto would not choose it for bf16.
    std::erase_if(bf16_skips,
                  [&](attention::CpuIsa isa) { return std::find(named.begin(), named.end(), isa) != named.end(); });
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  if (!peer.empty() && peer != "torch") {
    std::fprintf(stderr, "--peer: only 'torch' is known, got '%s'\n", peer.c_str());
    return 2;
  }
#if defined(SEQPAR_BENCH_OPENBLAS)
  setenv("OPENBLAS_CORETYPE", "SkylakeX", 0);  // OpenBLAS 0.3.21 misdetects Zen 5 as Haswell
  const bool have_blas = use_blas;
#else
  const bool have_blas = false;
  (void)use_blas;
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
      for (int d : dims)
        for (auto [hq, hkv] : heads)
          for (const std::string& m : masks) {
            if (quick && !(hq == 8 && (s <= 4096 || (d == 128 && m == "causal")))) continue;
            configs.push_back({s, d, hq, hkv, m});
          }
  }

  Peaks peak(5, std::vector<double>(257, 0.0));
  // 1 thread always: the micro-kernel rows are single-threaded
  std::vector<int> peak_threads = thread_list;
  if (std::find(peak_threads.begin(), peak_threads.end(), 1) == peak_threads.end())
    peak_threads.insert(peak_threads.begin(), 1);
  measure_peak(isas, peak_threads, peak, smoke ? 1 : 25);
  const auto peak_of = [&](attention::CpuIsa isa, int threads) {
    return peak[static_cast<std::size_t>(isa)][static_cast<std::size_t>(threads)];
  };

  // Micro-kernel rows (1 thread): the tile products at this build's flags.
  std::vector<KernelRow> kernel_rows;
  for (int round = 0; round < rounds; ++round) {
    std::size_t at = 0;
    const auto keep_kernel = [&](KernelRow r) {
      if (at == kernel_rows.size())
        kernel_rows.push_back(std::move(r));
      else
        kernel_rows[at].gflops = std::max(kernel_rows[at].gflops, r.gflops);
      ++at;
    };
    for (attention::CpuIsa isa : isas)
      for (int d : smoke ? std::vector<int>{64} : dims)
        for (KernelRow& r : time_tile_gemms(isa, d, smoke ? 0.05 : 0.5)) keep_kernel(std::move(r));
  }

  std::vector<Record> records;  // the best over rounds (first round: in this order; later rounds: max per row)
  std::size_t row = 0;
  const auto keep = [&](Record r) {
    if (row == records.size()) {
      records.push_back(std::move(r));
    } else {
      Record& b = records[row];
      b.gflops = std::max(b.gflops, r.gflops);
      b.baseline = std::max(b.baseline, r.baseline);
      b.peer = std::max(b.peer, r.peer);
    }
    ++row;
  };
  const double budget = smoke ? 0.2 : quick ? 2.0 : 4.0;
  for (int round = 0; round < rounds; ++round, row = 0)
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
      for (attention::CpuIsa isa : isas)
        for (int threads : thread_list) {
          // avx512bf16 is for bf16 storage: CpuFlash<float> refuses it
          if (fp32_rows && isa != attention::CpuIsa::kAvx512Bf16) {
            const attention::CpuFlash<float> flash({.threads = threads, .isa = isa});
            std::vector<std::byte> ws(flash.workspace_bytes(shape, c.seq, c.seq));
            const double tf = best_time(
                [&] { flash.forward(shape, q.view(), k.view(), v.view(), p.slices, o.view(), lse.view(), ws); }, budget,
                5);
            const double tb = best_time(
                [&] {
                  flash.backward(shape, q.view(), k.view(), v.view(), o.view(), lse.view(), dout.view(), p.slices,
                                 dq.view(), dk.view(), dv.view(), ws);
                },
                budget, 3);
            double base = 0;
#if defined(SEQPAR_BENCH_OPENBLAS)
            if (have_blas) {
              openblas_set_num_threads(threads);
              ThdTensor<float> ob(c.seq, c.hq, c.d);
              std::vector<float> s;
              const double tu =
                  best_time([&] { unfused_forward(p, shape, q.view(), k.view(), v.view(), ob.view(), s); }, budget,
                            c.seq > 8192 ? 1 : 2);
              base = fwd_flops / tu * 1e-9;
            }
#endif
            std::pair<double, double> tp{0, 0};
            if (!peer.empty()) tp = run_torch_peer(python, script, p, threads, "float32", budget);
            keep({isa, "fwd", "fp32", p, threads, fwd_flops / tf * 1e-9, base, tp.first});
            keep({isa, "bwd", "fp32", p, threads, 2.5 * fwd_flops / tb * 1e-9, 0.0, tp.second});
            std::fprintf(stderr, ".");
          }
          if (bf16_rows && std::find(bf16_skips.begin(), bf16_skips.end(), isa) == bf16_skips.end()) {
            // the same values rounded to bf16; fp32 accumulation and LSE
            using attention::bf16;
            const auto narrow = [](const ThdTensor<float>& t) {
              ThdTensor<bf16> r(t.tokens, t.heads, t.head_dim);
              for (std::size_t i = 0; i < t.storage.size(); ++i) r.storage[i] = bf16(t.storage[i]);
              return r;
            };
            const ThdTensor<bf16> qh = narrow(q), kh = narrow(k), vh = narrow(v), doh = narrow(dout);
            ThdTensor<bf16> oh(c.seq, c.hq, c.d), dqh(c.seq, c.hq, c.d), dkh(c.seq, c.hkv, c.d), dvh(c.seq, c.hkv, c.d);
            const attention::CpuFlash<bf16> fh({.threads = threads, .isa = isa});
            std::vector<std::byte> wsh(fh.workspace_bytes(shape, c.seq, c.seq));
            const double tfh = best_time(
                [&] { fh.forward(shape, qh.view(), kh.view(), vh.view(), p.slices, oh.view(), lse.view(), wsh); },
                budget, 5);
            const double tbh = best_time(
                [&] {
                  fh.backward(shape, qh.view(), kh.view(), vh.view(), oh.view(), lse.view(), doh.view(), p.slices,
                              dqh.view(), dkh.view(), dvh.view(), wsh);
                },
                budget, 3);
            std::pair<double, double> th{0, 0};
            if (!peer.empty()) th = run_torch_peer(python, script, p, threads, "bfloat16", budget);
            keep({isa, "fwd", "bf16", p, threads, fwd_flops / tfh * 1e-9, 0.0, th.first});
            keep({isa, "bwd", "bf16", p, threads, 2.5 * fwd_flops / tbh * 1e-9, 0.0, th.second});
            std::fprintf(stderr, ".");
          }
        }
      measure_peak(isas, peak_threads, peak, 3);  // more interleaved samples between configurations
    }
  std::fprintf(stderr, "\n");

  std::printf("CPU features: %s; CpuFlash's choice here: %s (float), %s (bf16)\n",
              attention::cpu_features().to_string().c_str(), attention::to_string(attention::CpuFlash<float>().isa()),
              attention::to_string(attention::CpuFlash<attention::bf16>().isa()));
  std::printf("measured peak per instruction set (fp32 FMA; avx512bf16: vdpbf16ps; best of %d interleaved runs):\n",
              smoke ? 1 : 25 + 3 * rounds * int(configs.size()));
  for (attention::CpuIsa isa : isas) {
    std::printf("  %-10s", attention::to_string(isa));
    for (int t : peak_threads) std::printf("  %dT %.0f GFLOP/s", t, peak_of(isa, t));
    std::printf("\n");
  }
  std::printf("\nmicro-kernel (1 thread, L1-resident packed tiles):\n");
  for (const KernelRow& r : kernel_rows)
    std::printf("  %-10s %-22s %3d x %3d x %3d  %7.1f GFLOP/s  %5.1f%% of 1T peak\n", attention::to_string(r.isa),
                r.what.c_str(), r.m, r.n, r.k, r.gflops, 100.0 * r.gflops / peak_of(r.isa, 1));
  std::printf("\n%-10s %-5s %-5s %-6s %6s %4s %7s %3s %9s %6s %9s %7s %9s %7s\n", "isa", "pass", "dtype", "mask", "seq",
              "d", "Hq:Hkv", "thr", "GFLOP/s", "frac", "baseline", "ratio", "torch", "ratio");
  for (const Record& x : records) {
    const double pk = peak_of(x.isa, x.threads);
    char base_s[32] = "", ratio_s[32] = "", peer_s[32] = "", pratio_s[32] = "";
    if (x.baseline > 0) {
      std::snprintf(base_s, sizeof base_s, "%.1f", x.baseline);
      std::snprintf(ratio_s, sizeof ratio_s, "%.2fx", x.gflops / x.baseline);
    } else if (x.pass == "fwd") {
      std::snprintf(base_s, sizeof base_s, "n/a");
    }
    if (x.peer > 0) {
      std::snprintf(peer_s, sizeof peer_s, "%.1f", x.peer);
      std::snprintf(pratio_s, sizeof pratio_s, "%.2fx", x.gflops / x.peer);
    } else if (!peer.empty()) {
      std::snprintf(peer_s, sizeof peer_s, "n/a");
    }
    std::printf("%-10s %-5s %-5s %-6s %6lld %4d %4d:%-2d %3d %9.1f %5.1f%% %9s %7s %9s %7s\n",
                attention::to_string(x.isa), x.pass.c_str(), x.dtype.c_str(), x.p.mask.c_str(),
                static_cast<long long>(x.p.seq), x.p.d, x.p.hq, x.p.hkv, x.threads, x.gflops, 100.0 * x.gflops / pk,
                base_s, ratio_s, peer_s, pratio_s);
  }
  if (!have_blas) std::printf("\nbaseline n/a: built without OpenBLAS, or --no-blas\n");
  if (std::any_of(kernel_rows.begin(), kernel_rows.end(),
                  [&](const KernelRow& r) { return r.gflops > peak_of(r.isa, 1); }))
    std::printf(
        "note: a micro-kernel ran above the measured peak: the machine was loaded while the peak was "
        "sampled (the peak is too low), so the frac columns are unreliable\n");
  if (!peer.empty() && std::any_of(records.begin(), records.end(), [](const Record& r) { return r.peer <= 0; }))
    std::printf("torch n/a: '%s %s' failed (install it with bench/torch_peer/install.sh)\n", python.c_str(),
                script.c_str());

  if (!json.empty()) {
    std::ofstream f(json);
    f << "{\"rounds\": " << rounds << ", \"cpu_features\": \"" << attention::cpu_features().to_string()
      << "\", \"peak_gflops\": {";
    for (std::size_t j = 0; j < isas.size(); ++j) {
      f << (j ? ", " : "") << "\"" << attention::to_string(isas[j]) << "\": {";
      for (std::size_t i = 0; i < thread_list.size(); ++i)
        f << (i ? ", " : "") << "\"" << thread_list[i] << "\": " << peak_of(isas[j], thread_list[i]);
      f << "}";
    }
    f << "},\n \"micro_kernel\": [";
    for (std::size_t i = 0; i < kernel_rows.size(); ++i) {
      const KernelRow& r = kernel_rows[i];
      f << (i ? ", " : "") << "{\"isa\": \"" << attention::to_string(r.isa) << "\", \"what\": \"" << r.what
        << "\", \"m\": " << r.m << ", \"n\": " << r.n << ", \"k\": " << r.k << ", \"gflops\": " << r.gflops
        << ", \"fraction_of_peak\": " << r.gflops / peak_of(r.isa, 1) << "}";
    }
    f << "],\n \"rows\": [\n";
    for (std::size_t i = 0; i < records.size(); ++i) {
      const Record& r = records[i];
      const double pk = peak_of(r.isa, r.threads);
      f << "  {\"kernel\": \"CpuFlash\", \"isa\": \"" << attention::to_string(r.isa) << "\", \"dtype\": \"" << r.dtype
        << "\", \"pass\": \"" << r.pass << "\", \"seq_len\": " << r.p.seq << ", \"head_dim\": " << r.p.d
        << ", \"heads_q\": " << r.p.hq << ", \"heads_kv\": " << r.p.hkv << ", \"mask\": \"" << r.p.mask
        << "\", \"documents\": " << r.p.docs.size() << ", \"threads\": " << r.threads << ", \"gflops\": " << r.gflops
        << ", \"peak_gflops\": " << pk << ", \"fraction_of_peak\": " << r.gflops / pk << ", \"baseline_gflops\": ";
      if (r.baseline > 0)
        f << r.baseline;
      else
        f << "null";
      f << ", \"torch_gflops\": ";
      if (r.peer > 0)
        f << r.peer;
      else
        f << "null";
      f << "}" << (i + 1 < records.size() ? "," : "") << "\n";
    }
    f << "]}\n";
  }
  return 0;
}
