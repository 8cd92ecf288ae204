// SPDX-License-Identifier: Apache-2.0
// attention::KokkosFlash<Kokkos::DefaultHostExecutionSpace, float> beside attention::CpuFlash<float>
// on 1 thread, same shapes: GFLOP/s forward and backward and their ratio (Kokkos / CpuFlash). Debian's
// Kokkos 3.4 has the Serial backend only, so both run on one core. FLOPs = 4 * d * Hq * (visible
// pairs) forward, 2.5x that backward; best of N runs. Masks: one causal sequence ("causal") and a
// lognormal document mix of the same length, causal per document ("doc", median seq/16).
//   attention_kokkos [--smoke] [--quick] [--seq N] [--d D] [--json FILE]
#include <seqpar/kokkos.hpp>
#include <seqpar/seqpar.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "support/json.hpp"

using namespace seqpar;
using Clock = std::chrono::steady_clock;

namespace {

std::vector<AttnSlice> make_slices(std::int64_t seq, const std::string& mask) {
  std::vector<std::int64_t> docs;
  if (mask == "causal") {
    docs = {seq};
  } else {
    std::mt19937_64 rng(42);
    std::lognormal_distribution<double> dist(std::log(double(seq) / 16.0), 1.0);
    for (std::int64_t left = seq; left > 0;) {
      docs.push_back(std::clamp<std::int64_t>(std::llround(dist(rng)), 1, left));
      left -= docs.back();
    }
  }
  std::vector<AttnSlice> slices;
  std::int64_t at = 0;
  for (std::int64_t len : docs) {
    slices.push_back({{at, at + len}, {at, at + len}, Mask::causal()});
    at += len;
  }
  return slices;
}

template <class F>
double best_seconds(F&& f, double budget_s, int max_reps) {
  double best = 1e300, total = 0;
  for (int rep = 0; rep < max_reps && (rep < 2 || total < budget_s); ++rep) {
    const auto t0 = Clock::now();
    f();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    best = std::min(best, s);
    total += s;
  }
  return best;
}

struct Timing {
  double fwd_gflops = 0, bwd_gflops = 0;
};

/// Forward and backward GFLOP/s of `kernel` on the problem (fresh outputs per run; dQ/dK/dV accumulate).
template <class Kernel>
Timing measure(const Kernel& kernel, const AttentionShape& shape, const std::vector<AttnSlice>& slices,
               std::int64_t seq, double budget_s, int reps) {
  std::mt19937_64 rng(7);
  std::normal_distribution<float> n(0.0f, 1.0f);
  ThdTensor<float> q(seq, shape.heads_q, shape.head_dim), k(seq, shape.heads_kv, shape.head_dim),
      v(seq, shape.heads_kv, shape.head_dim), o(seq, shape.heads_q, shape.head_dim),
      dout(seq, shape.heads_q, shape.head_dim), dq(seq, shape.heads_q, shape.head_dim),
      dk(seq, shape.heads_kv, shape.head_dim), dv(seq, shape.heads_kv, shape.head_dim);
  for (auto* t : {&q, &k, &v, &dout})
    for (float& x : t->storage) x = n(rng);
  LseTensor<float> lse(shape.heads_q, seq);
  std::vector<std::byte> ws(kernel.workspace_bytes(shape, seq, seq));
  const double flops = 4.0 * shape.head_dim * shape.heads_q * double(total_area(slices));
  const double f = best_seconds(
      [&] { kernel.forward(shape, q.view(), k.view(), v.view(), slices, o.view(), lse.view(), ws); }, budget_s, reps);
  const double b = best_seconds(
      [&] {
        kernel.backward(shape, q.view(), k.view(), v.view(), o.view(), lse.view(), dout.view(), slices, dq.view(),
                        dk.view(), dv.view(), ws);
      },
      budget_s, reps);
  return {flops / f * 1e-9, 2.5 * flops / b * 1e-9};
}

}  // namespace

int main(int argc, char** argv) {
  Kokkos::ScopeGuard kokkos(argc, argv);
  bool smoke = false, quick = false;
  std::vector<std::int64_t> seqs{1024, 4096};
  std::vector<int> dims{64, 128};
  std::string json;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--smoke") {
      smoke = true;
    } else if (a == "--quick") {
      quick = true;
    } else if (a == "--seq" && i + 1 < argc) {
      seqs = {std::atoll(argv[++i])};
    } else if (a == "--d" && i + 1 < argc) {
      dims = {std::atoi(argv[++i])};
    } else if (a == "--json" && i + 1 < argc) {
      json = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--smoke] [--quick] [--seq N] [--d D] [--json FILE]\n", argv[0]);
      return 2;
    }
  }
  if (smoke) seqs = {128}, dims = {64};
  if (quick) seqs = {1024};
  const double budget = smoke ? 0.0 : 1.0;
  const int reps = smoke ? 1 : 5;
  const attention::CpuFlash<float> cpu({.threads = 1});
  const attention::KokkosFlash<Kokkos::DefaultHostExecutionSpace, float> kk;
  std::printf("KokkosFlash<%s, float> vs CpuFlash<float> (1 thread), Hq:Hkv 4:2, GFLOP/s\n",
              Kokkos::DefaultHostExecutionSpace::name());
  std::printf("%-7s %6s %4s | %9s %9s %6s | %9s %9s %6s\n", "mask", "seq", "d", "fwd kk", "fwd cpu", "ratio", "bwd kk",
              "bwd cpu", "ratio");
  std::vector<bench::JsonRecord> records;
  for (const std::string mask : {"causal", "doc"})
    for (std::int64_t seq : seqs)
      for (int d : dims) {
        const AttentionShape shape{4, 2, d, 0.0};
        const auto slices = make_slices(seq, mask);
        const Timing tk = measure(kk, shape, slices, seq, budget, reps);
        const Timing tc = measure(cpu, shape, slices, seq, budget, reps);
        std::printf("%-7s %6lld %4d | %9.2f %9.2f %6.3f | %9.2f %9.2f %6.3f\n", mask.c_str(),
                    static_cast<long long>(seq), d, tk.fwd_gflops, tc.fwd_gflops, tk.fwd_gflops / tc.fwd_gflops,
                    tk.bwd_gflops, tc.bwd_gflops, tk.bwd_gflops / tc.bwd_gflops);
        records.push_back(bench::JsonRecord()
                              .add("bench", "attention_kokkos")
                              .add("space", Kokkos::DefaultHostExecutionSpace::name())
                              .add("mask", mask)
                              .add("seq", seq)
                              .add("d", d)
                              .add("heads_q", shape.heads_q)
                              .add("heads_kv", shape.heads_kv)
                              .add("documents", static_cast<std::int64_t>(slices.size()))
                              .add("kokkos_fwd_gflops", tk.fwd_gflops)
                              .add("cpuflash_fwd_gflops", tc.fwd_gflops)
                              .add("fwd_ratio", tk.fwd_gflops / tc.fwd_gflops)
                              .add("kokkos_bwd_gflops", tk.bwd_gflops)
                              .add("cpuflash_bwd_gflops", tc.bwd_gflops)
                              .add("bwd_ratio", tk.bwd_gflops / tc.bwd_gflops));
      }
  if (!json.empty() && !bench::write_json(json, records)) return 1;
  return 0;
}
