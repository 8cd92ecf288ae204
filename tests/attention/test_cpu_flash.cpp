// SPDX-License-Identifier: Apache-2.0
// CpuFlash<float|double|bf16>: the shared kernel conformance cases (tests/support/kernel_cases.hpp: every
// mask and layout against the fp64 Reference, non-finite isolation, refusals and aliasing), and what is
// CpuFlash's own: determinism across thread counts, the scale and tile refusals, the online-softmax row step
// and the bf16 conversions.
#include <doctest/doctest.h>

#include <seqpar/attention/cpu_flash.hpp>
#include <seqpar/attention/reference.hpp>

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "support/kernel_cases.hpp"
#include "support/sanitizer.hpp"

using namespace seqpar;

namespace {

namespace kc = test::kernel_cases;

// max abs error relative to the output scale max(1, max|ref|): fp64 1e-10; fp32 1e-5 forward, 2e-5 backward
// (fp32 accumulation over up to 2267 keys / rows); bf16 storage (outputs and gradients rounded to 8
// significant bits, relative 2^-9, and the backward reads the rounded O; fp32 inside) 1e-2 and 2e-2.
template <class T>
constexpr kc::Tolerance kTolerance = std::is_same_v<T, double>  ? kc::Tolerance{1e-10, 1e-10}
                                     : std::is_same_v<T, float> ? kc::Tolerance{1e-5, 2e-5}
                                                                : kc::Tolerance{1e-2, 2e-2};

template <class T>
using Harness = kc::HostHarness<attention::CpuFlash<T>>;

// Every tile policy the header has; a test case returns early for one this CPU cannot run.
#if SEQPAR_CPU_DISPATCH
#define TILE_POLICIES \
  attention::detail::PortableTiles<float>, attention::detail::avx2::Avx2Tiles, attention::detail::avx512::Avx512Tiles
#else
#define TILE_POLICIES attention::detail::PortableTiles<float>
#endif

template <class T>
void fill_normal(ThdView<T> v, std::mt19937_64& rng) {
  std::normal_distribution<double> dist(0.0, 1.0);
  for (std::int64_t t = 0; t < v.tokens; ++t)
    for (int h = 0; h < v.heads; ++h)
      for (int x = 0; x < v.head_dim; ++x) v(t, h, x) = T(dist(rng));
}

}  // namespace

TEST_SUITE("attention") {
  // The shared conformance cases (tests/support/kernel_cases.hpp), with large tiles on one thread and small
  // tiles on two (many query tiles and blocks per slice).
  TEST_CASE_TEMPLATE("CpuFlash: the kernel conformance cases", T, float, double, attention::bf16) {
    attention::CpuFlash<T> large({1, 576, 192}), small({2, 12, 6});
    kc::run_cases<Harness<T>>(large, kTolerance<T>);
    kc::run_cases<Harness<T>>(small, kTolerance<T>);
  }
  TEST_CASE_TEMPLATE("CpuFlash: unequal q/k and v head sizes (MLA 192/128, 576/512 and odd pairs)", T, float, double,
                     attention::bf16) {
    attention::CpuFlash<T> large({1, 576, 192}), small({2, 12, 6});
    CHECK(kc::run_head_size_cases<Harness<T>>(large, kTolerance<T>) == kc::head_size_cases().size());
    CHECK(kc::run_head_size_cases<Harness<T>>(small, kTolerance<T>) == kc::head_size_cases().size());
  }
  TEST_CASE_TEMPLATE("CpuFlash: the long kernel conformance cases", T, float, double) {
    attention::CpuFlash<T> flash({2, 96, 48});
    kc::run_long_cases<Harness<T>>(flash, kTolerance<T>, std::is_same_v<T, double> ? 2 : 3);  // CI time
  }
  TEST_CASE_TEMPLATE("CpuFlash keeps a NaN or infinity inside the rows and keys that read it", T, float, double,
                     attention::bf16) {
    // double runs the portable path, ~10x slower: two planted positions keep the test cheap under the sanitizers
    attention::CpuFlash<T> flash({2, 48, 24});
    kc::check_nonfinite_isolation<Harness<T>>(flash, kc::Isolation::kMask, std::is_same_v<T, double> ? 2 : 4);
  }
  TEST_CASE_TEMPLATE("CpuFlash refuses bad input and aliased outputs", T, float, attention::bf16) {
    attention::CpuFlash<T> flash;
    kc::check_refusals<Harness<T>>(flash);
    CHECK_THROWS_AS(attention::CpuFlash<T>({0, 576, 192}), std::invalid_argument);
  }

  // Each instruction set this CPU runs, forced by Arguments::isa: the shared conformance cases (small tiles on two
  // threads: many query tiles and blocks per slice) and the MLA head sizes, for float and bf16 storage. The default
  // (auto) runs the best one in every other test of the suite.
  // For bf16 also the bf16 dot products (avx512bf16, bf16 storage only), within the same tolerance: they compute S and
  // dP from the exact bf16 inputs with fp32 accumulation (no rounding added), and P V with P rounded to bf16
  // (flash_tiles_avx512bf16.hpp): at most 2^-9 of max|V| on O, a fifth of the 1e-2 forward tolerance.
  TEST_CASE_TEMPLATE("CpuFlash: the kernel conformance cases on every instruction set this CPU has", T, float,
                     attention::bf16) {
    constexpr bool kBf16 = std::is_same_v<T, attention::bf16>;
    int ran = 0;
    for (attention::CpuIsa isa : {attention::CpuIsa::kPortable, attention::CpuIsa::kAvx2, attention::CpuIsa::kAvx512,
                                  attention::CpuIsa::kAvx512Bf16}) {
      if (!attention::cpu_isa_runnable(isa) || (isa == attention::CpuIsa::kAvx512Bf16 && !kBf16)) continue;
      CAPTURE(attention::to_string(isa));
      attention::CpuFlash<T> flash({.threads = 2, .q_tile = 12, .backward_q_block = 6, .isa = isa});
      REQUIRE(flash.isa() == isa);
      ++ran;
      //       // Under a sanitizer (CI time): the default instruction set runs in every other case of the suite, and
      // the portable float path is scalar at -O2 (~30x slower than AVX2): its conformance cases only. On a CPU with
      // AVX512-BF16 the AVX-512 fp32 tiles are float's default and not bf16's: as before that path existed, the
      // float cases cover them (bf16 storage differs only in the row conversions, shared with AVX2).
      if (test::kUnderSanitizer &&
          (isa == attention::cpu_features().best(kBf16) || isa == attention::cpu_features().best(false)))
        continue;
      kc::run_cases<Harness<T>>(flash, kTolerance<T>);
      if (!test::kUnderSanitizer || isa != attention::CpuIsa::kPortable) {
        CHECK(kc::run_head_size_cases<Harness<T>>(flash, kTolerance<T>) == kc::head_size_cases().size());
        kc::check_nonfinite_isolation<Harness<T>>(flash, kc::Isolation::kMask, 2);
      }
    }
    CHECK(ran >= 1);
    MESSAGE("instruction sets run: " << ran << " (this CPU: " << attention::cpu_features().to_string() << ")");
  }

  TEST_CASE("CpuFlash picks the best instruction set, and refuses by name one the CPU or the type cannot run") {
    // The choice: the best supported, unless Arguments::isa or SEQPAR_CPU_ISA names one.
    const attention::CpuFeatures avx2_only{.avx2_fma = true, .avx512 = false, .avx512_bf16 = false};
    const attention::CpuFeatures none{};
    const attention::CpuFeatures all{.avx2_fma = true, .avx512 = true, .avx512_bf16 = true};
    const attention::CpuFeatures avx512_only{.avx2_fma = true, .avx512 = true, .avx512_bf16 = false};
    ::unsetenv("SEQPAR_CPU_ISA");
    CHECK(attention::resolve_cpu_isa(attention::CpuIsa::kAuto, "t", all) == attention::CpuIsa::kAvx512);
    // bf16 storage: the bf16 dot products where the CPU has them, else the fp32 tiles
    CHECK(attention::resolve_cpu_isa(attention::CpuIsa::kAuto, "t", all, true) == attention::CpuIsa::kAvx512Bf16);
    CHECK(attention::resolve_cpu_isa(attention::CpuIsa::kAuto, "t", avx512_only, true) == attention::CpuIsa::kAvx512);
    CHECK(attention::resolve_cpu_isa(attention::CpuIsa::kAuto, "t", avx2_only, true) == attention::CpuIsa::kAvx2);
    CHECK(attention::CpuFlash<attention::bf16>().isa() == attention::cpu_features().best(true));
    try {
      (void)attention::resolve_cpu_isa(attention::CpuIsa::kAvx512Bf16, "CpuFlash", avx512_only, true);
      FAIL("avx512bf16 accepted on a CPU without it");
    } catch (const std::invalid_argument& e) {
      CHECK(std::string(e.what()) ==
            "CpuFlash: args.isa = avx512bf16: this CPU does not support it (it has: avx2+fma "
            "avx512(f,bw,dq,vl)); use auto or avx512");
    }
    try {  // float storage, whatever the CPU has
      attention::CpuFlash<float> f({.isa = attention::CpuIsa::kAvx512Bf16});
      FAIL("CpuFlash<float> accepted avx512bf16");
    } catch (const std::invalid_argument& e) {
      CHECK(std::string(e.what()) ==
            "CpuFlash: args.isa = avx512bf16: the bf16 dot-product tiles are for bf16 storage (CpuFlash<bf16>); "
            "float storage has fp32 tiles: use auto or avx512");
    }
    try {
      attention::CpuFlash<double> f({.isa = attention::CpuIsa::kAvx512Bf16});
      FAIL("CpuFlash<double> accepted avx512bf16");
    } catch (const std::invalid_argument& e) {
      CHECK(std::string(e.what()) ==
            "CpuFlash: args.isa = avx512bf16: CpuFlash<double> has the portable kernels only (use auto)");
    }
    CHECK(attention::resolve_cpu_isa(attention::CpuIsa::kAuto, "t", avx2_only) == attention::CpuIsa::kAvx2);
    CHECK(attention::resolve_cpu_isa(attention::CpuIsa::kAuto, "t", none) == attention::CpuIsa::kPortable);
    CHECK(attention::CpuFlash<float>().isa() == attention::cpu_features().best());
    CHECK(attention::CpuFlash<double>().isa() == attention::CpuIsa::kPortable);
    try {
      (void)attention::resolve_cpu_isa(attention::CpuIsa::kAvx512, "CpuFlash", avx2_only);
      FAIL("avx512 accepted on a CPU without it");
    } catch (const std::invalid_argument& e) {
      CHECK(std::string(e.what()) ==
            "CpuFlash: args.isa = avx512: this CPU does not support it (it has: avx2+fma); use auto or avx2");
    }
    CHECK_THROWS_AS((void)attention::resolve_cpu_isa(attention::CpuIsa::kAvx2, "CpuFlash", none),
                    std::invalid_argument);
    try {
      attention::CpuFlash<double> d({.isa = attention::CpuIsa::kAvx2});
      FAIL("CpuFlash<double> accepted avx2");
    } catch (const std::invalid_argument& e) {
      CHECK(std::string(e.what()) ==
            "CpuFlash: args.isa = avx2: CpuFlash<double> has the portable kernels only (use auto)");
    }
    // The environment variable: a forced instruction set for kAuto, refused by name when unknown or unsupported.
    ::setenv("SEQPAR_CPU_ISA", "portable", 1);
    CHECK(attention::CpuFlash<float>().isa() == attention::CpuIsa::kPortable);
    CHECK(attention::CpuFlash<attention::bf16>().isa() == attention::CpuIsa::kPortable);
    CHECK(attention::resolve_cpu_isa(attention::CpuIsa::kAvx2, "t", all) == attention::CpuIsa::kAvx2);  // args win
    ::setenv("SEQPAR_CPU_ISA", "avx512", 1);
    try {
      (void)attention::resolve_cpu_isa(attention::CpuIsa::kAuto, "CpuFlash", avx2_only);
      FAIL("SEQPAR_CPU_ISA=avx512 accepted on a CPU without it");
    } catch (const std::invalid_argument& e) {
      CHECK(std::string(e.what()) ==
            "CpuFlash: SEQPAR_CPU_ISA = avx512: this CPU does not support it (it has: avx2+fma); use auto or avx2");
    }
    // The variable is process-wide: avx512bf16 runs the bf16 dot products for bf16 storage, the AVX-512 fp32 tiles
    // for float storage (refused where the CPU lacks it).
    ::setenv("SEQPAR_CPU_ISA", "avx512bf16", 1);
    CHECK(attention::resolve_cpu_isa(attention::CpuIsa::kAuto, "t", all, true) == attention::CpuIsa::kAvx512Bf16);
    CHECK(attention::resolve_cpu_isa(attention::CpuIsa::kAuto, "t", all, false) == attention::CpuIsa::kAvx512);
    try {
      (void)attention::resolve_cpu_isa(attention::CpuIsa::kAuto, "CpuFlash", avx512_only, false);
      FAIL("SEQPAR_CPU_ISA=avx512bf16 accepted on a CPU without it");
    } catch (const std::invalid_argument& e) {
      CHECK(std::string(e.what()) ==
            "CpuFlash: SEQPAR_CPU_ISA = avx512bf16: this CPU does not support it (it has: "
            "avx2+fma avx512(f,bw,dq,vl)); use auto or avx512");
    }
    ::setenv("SEQPAR_CPU_ISA", "sse9", 1);
    try {
      attention::CpuFlash<float> f;
      FAIL("SEQPAR_CPU_ISA=sse9 accepted");
    } catch (const std::invalid_argument& e) {
      CHECK(std::string(e.what()) ==
            "CpuFlash: SEQPAR_CPU_ISA = sse9: is not an instruction set CpuFlash has kernels for (auto, portable, "
            "avx2, avx512, avx512bf16)");
    }
    CHECK(attention::CpuFlash<double>().isa() == attention::CpuIsa::kPortable);  // double ignores the variable
    ::setenv("SEQPAR_CPU_ISA", "auto", 1);
    CHECK(attention::CpuFlash<float>().isa() == attention::cpu_features().best());
    ::unsetenv("SEQPAR_CPU_ISA");
  }

  TEST_CASE("CpuFlash is deterministic across runs and thread counts") {
    const AttentionShape shape{4, 2, 64, 0.0};
    const std::int64_t n = 300;
    std::mt19937_64 rng(7);
    ThdTensor<float> q(n, 4, 64), k(n, 2, 64), v(n, 2, 64), dout(n, 4, 64);
    for (auto* t : {&q, &k, &v, &dout}) fill_normal(t->view(), rng);
    const auto slices = kc::documents({100, 200}, Mask::causal());
    std::vector<std::vector<float>> results;
    for (int threads : {1, 2, 2}) {
      const attention::CpuFlash<float> flash({threads, 48, 24});
      std::vector<std::byte> ws(flash.workspace_bytes(shape, n, n));
      ThdTensor<float> o(n, 4, 64), dq(n, 4, 64), dk(n, 2, 64), dv(n, 2, 64);
      LseTensor<float> lse(4, n);
      flash.forward(shape, q.view(), k.view(), v.view(), slices, o.view(), lse.view(), ws);
      flash.backward(shape, q.view(), k.view(), v.view(), o.view(), lse.view(), dout.view(), slices, dq.view(),
                     dk.view(), dv.view(), ws);
      std::vector<float> all;
      for (auto* t : {&o, &dq, &dk, &dv}) all.insert(all.end(), t->storage.begin(), t->storage.end());
      all.insert(all.end(), lse.storage.begin(), lse.storage.end());
      results.push_back(all);
    }
    CHECK(results[0] == results[1]);
    CHECK(results[1] == results[2]);
  }

  TEST_CASE("CpuFlash refuses a softmax_scale its accumulation type cannot hold, and oversized tiles") {
    const attention::CpuFlash<float> flash;
    ThdTensor<float> q(4, 1, 8), k(4, 1, 8), v(4, 1, 8), o(4, 1, 8);
    LseTensor<float> lse(1, 4);
    const std::vector<AttnSlice> sl{{{0, 4}, {0, 4}, Mask::causal()}};
    const AttentionShape huge{1, 1, 8, 1e300};
    std::vector<std::byte> ws(flash.workspace_bytes(huge, 4, 4));
    try {
      flash.forward(huge, q.view(), k.view(), v.view(), sl, o.view(), lse.view(), ws);
      FAIL("softmax_scale 1e300 accepted for float");
    } catch (const std::invalid_argument& e) {
      CHECK(std::string(e.what()).find("softmax_scale") != std::string::npos);
    }
    const AttentionShape tiny{1, 1, 8, 1e-300};
    CHECK_THROWS_AS(flash.forward(tiny, q.view(), k.view(), v.view(), sl, o.view(), lse.view(), ws),
                    std::invalid_argument);
    // Past what float keeps exact at head_dim 8 (attention::max_softmax_scale<float>(8) = 9.09e4), within
    // what double does (4.9e13): float refuses it, double holds it.
    const AttentionShape large{1, 1, 8, 1e8};
    CHECK_THROWS_AS(flash.forward(large, q.view(), k.view(), v.view(), sl, o.view(), lse.view(), ws),
                    std::invalid_argument);
    const attention::CpuFlash<double> flash_d;
    ThdTensor<double> qd(4, 1, 8), kd(4, 1, 8), vd(4, 1, 8), od(4, 1, 8);
    LseTensor<double> lsed(1, 4);
    std::vector<std::byte> wsd(flash_d.workspace_bytes(large, 4, 4));
    CHECK_NOTHROW(flash_d.forward(large, qd.view(), kd.view(), vd.view(), sl, od.view(), lsed.view(), wsd));
    for (int bad : {std::numeric_limits<int>::max(), attention::CpuFlash<float>::kMaxTileRows + 1, -3}) {
      try {
        attention::CpuFlash<float> f({1, bad, 192});
        FAIL("q_tile accepted");
      } catch (const std::invalid_argument& e) {
        CHECK(std::string(e.what()).find("q_tile") != std::string::npos);
      }
      CHECK_THROWS_AS(attention::CpuFlash<float>({1, 576, bad}), std::invalid_argument);
    }
  }

  TEST_CASE_TEMPLATE("softmax_row: P within 3e-7 of exp2 in fp64, and the reference max moves only past 2^8", Tiles,
                     TILE_POLICIES) {
    if (!attention::cpu_features().supports(Tiles::kIsa)) return;  // not on this CPU
    CAPTURE(attention::to_string(Tiles::kIsa));
    // The online-softmax row step of the forward, on every instruction set this CPU has: its exp2
    // polynomial over the whole argument range [-126, 8] that the lazy reference max allows, and the rule
    // that m moves only when a tile's visible max exceeds it by more than kLazyRescale.
    std::mt19937_64 rng(11);
    std::uniform_real_distribution<float> score(-110.0f, 12.0f);
    std::uniform_int_distribution<int> col(0, attention::detail::kKeyTile);
    int moved = 0, kept = 0;
    for (int trial = 0; trial < 400; ++trial) {
      CAPTURE(trial);
      std::vector<float> row(attention::detail::kKeyTile);
      for (float& x : row) x = score(rng);
      int lo = col(rng), hi = col(rng);
      if (lo > hi) std::swap(lo, hi);
      if (lo == hi) continue;
      if (trial % 4 == 0) lo = 0, hi = attention::detail::kKeyTile;  // the dense path
      const float m0 = trial % 5 == 0 ? -std::numeric_limits<float>::infinity() : score(rng);
      const float l0 = trial % 5 == 0 ? 0.0f : 3.0f;
      float m = m0, l = l0;
      const std::vector<float> in = row;
      const float alpha = Tiles::softmax_row(row.data(), lo, hi, m, l);
      float mx = -std::numeric_limits<float>::infinity();
      for (int j = lo; j < hi; ++j) mx = std::max(mx, in[static_cast<std::size_t>(j)]);
      const float want_m = mx > m0 + attention::detail::kLazyRescale ? mx : m0;
      REQUIRE(m == want_m);
      (m == m0 ? kept : moved) += 1;
      const float alpha_arg = m0 - m;  // in float, as the kernel forms it
      const double want_alpha = m == m0                                         ? 1.0
                                : m0 == -std::numeric_limits<float>::infinity() ? 0.0
                                                                                : std::exp2(double(alpha_arg));
      CHECK(std::abs(alpha - want_alpha) <= 3e-7 * want_alpha);
      double sum = 0;
      for (int j = 0; j < attention::detail::kKeyTile; ++j) {
        const std::size_t u = static_cast<std::size_t>(j);
        // the argument as the kernel forms it, in float (its rounding, up to 2^-18 at |x| ~ 100, is the input's)
        const float arg = in[u] - m;
        const double want = j >= lo && j < hi ? std::exp2(double(arg)) : 0.0;
        CAPTURE(j);
        CAPTURE(arg);
        CHECK(std::abs(double(row[u]) - want) <= 3e-7 * want + 2e-38);  // 2^-126 floor of the argument
        sum += want;
      }
      CHECK(std::abs(double(l) - (l0 * want_alpha + sum)) <= 1e-6 * (l0 * want_alpha + sum));
    }
    CHECK(moved > 20);  // both branches of the lazy rule ran (fixed seed: 46 kept)
    CHECK(kept > 20);
  }

  TEST_CASE_TEMPLATE(
      "bf16 rounds to nearest even, keeps NaN and infinity, and the vector paths agree with the scalar one", Tiles,
      TILE_POLICIES) {
    if (!attention::cpu_features().supports(Tiles::kIsa)) return;  // not on this CPU
    CAPTURE(attention::to_string(Tiles::kIsa));
    using attention::bf16;
    CHECK(bf16(1.0f).bits == 0x3F80);
    CHECK(bf16(1.00390625f).bits == 0x3F80);    // 1 + 2^-8: halfway, ties to the even 1.0
    CHECK(bf16(1.01171875f).bits == 0x3F82);    // 1 + 3 * 2^-8: halfway, ties to the even 1 + 2^-6
    CHECK(bf16(1.0048828125f).bits == 0x3F81);  // above halfway rounds up
    CHECK(bf16(-2.5f).bits == 0xC020);
    CHECK(std::isnan(float(bf16(std::numeric_limits<float>::quiet_NaN()))));
    CHECK(std::isnan(float(bf16(std::bit_cast<float>(0x7F800001u)))));  // a NaN whose payload would round to inf
    CHECK(float(bf16(std::numeric_limits<float>::infinity())) == std::numeric_limits<float>::infinity());
    CHECK(float(bf16(3.4e38f)) == std::numeric_limits<float>::infinity());  // beyond bf16's largest finite value
    std::mt19937_64 rng(5);
    std::normal_distribution<float> dist(0.0f, 100.0f);
    std::vector<float> acc(37);
    std::vector<bf16> vec(37), ref(37), back(37);
    for (float& x : acc) x = dist(rng);
    acc[3] = std::numeric_limits<float>::quiet_NaN();
    acc[9] = std::numeric_limits<float>::infinity();
    Tiles::store_scaled(vec.data(), acc.data(), 37, 0.5f);
    for (int i = 0; i < 37; ++i) ref[static_cast<std::size_t>(i)] = bf16(acc[static_cast<std::size_t>(i)] * 0.5f);
    for (int i = 0; i < 37; ++i) {
      CAPTURE(i);
      const std::size_t u = static_cast<std::size_t>(i);
      CHECK((vec[u].bits == ref[u].bits || (std::isnan(float(vec[u])) && std::isnan(float(ref[u])))));
    }
    std::vector<float> wide(37);
    Tiles::load_scaled(ref.data(), wide.data(), 37, 1.0f);
    for (int i = 0; i < 37; ++i) {
      const std::size_t u = static_cast<std::size_t>(i);
      CHECK((wide[u] == float(ref[u]) || std::isnan(wide[u])));
    }
  }

#if SEQPAR_CPU_DISPATCH
  TEST_CASE("gemm_pairs: bf16 dot products equal the fp64 product of the bf16 values to fp32 rounding") {
    if (!attention::cpu_features().supports(attention::CpuIsa::kAvx512Bf16)) return;  // not on this CPU
    using Tiles = attention::detail::avx512bf16::Avx512Bf16Tiles;
    using attention::bf16;
    // Shapes past the kernel's blocking: 53 rows (two 48-row groups, a 5-row block), kdim 301 (odd, and past the
    // 256 values of one chunk of A: the partial sums and the scale alpha cross chunks), 100 of 128 columns stored,
    // and the second panel's second register block skipped by the column ranges (its C must stay as it was).
    const int m = 53, n = 100, kdim = 301, kp = 64;
    const std::int64_t panel = Tiles::kPanel * std::int64_t{(kdim + 1) / 2};
    std::mt19937_64 rng(13);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    std::vector<bf16> a(static_cast<std::size_t>(m) * kdim), b(static_cast<std::size_t>(kp) * 2 * kdim);
    for (bf16& x : a) x = bf16(dist(rng));
    for (bf16& x : b) x = bf16(dist(rng));
    std::vector<float> af(a.size());
    for (std::size_t i = 0; i < a.size(); ++i) af[i] = float(a[i]);
    // B(k, j) = b[j * kdim + k]: key j's row, packed as a K^T tile is (columns past n zero)
    std::vector<std::uint32_t> packed(static_cast<std::size_t>(2 * panel));
    for (int j = 0; j < 2 * kp; ++j)
      Tiles::pack_key_pairs(j < n ? b.data() + static_cast<std::size_t>(j) * kdim : nullptr, kdim,
                            packed.data() + (j / kp) * panel + j % kp, kp);
    const int col_lo[9] = {0, 0, 0, 0, 0, 0, 0, 0, 0}, col_hi[9] = {128, 128, 128, 128, 128, 128, 128, 128, 64};
    std::vector<float> c(static_cast<std::size_t>(m) * 128, -7.0f);
    const float alpha = 0.375f;
    Tiles::gemm_pairs(m, n, kdim, af.data(), kdim, 1, packed.data(), panel, c.data(), 128, false, alpha,
                      {col_lo, col_hi, nullptr, nullptr});
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < 128; ++j) {
        CAPTURE(i);
        CAPTURE(j);
        const float got = c[static_cast<std::size_t>(i) * 128 + static_cast<std::size_t>(j)];
        if (j >= n || (i >= 48 && j >= 64)) {  // not computed: left as it was
          CHECK(got == -7.0f);
          continue;
        }
        double want = 0, mag = 0;
        for (int k = 0; k < kdim; ++k) {
          const double x = double(a[static_cast<std::size_t>(i) * kdim + static_cast<std::size_t>(k)]) *
                           double(b[static_cast<std::size_t>(j) * kdim + static_cast<std::size_t>(k)]);
          want += x;
          mag += std::abs(x);
        }
        // fp32 sums of kdim exact products: at most kdim * 2^-24 of the sum of their magnitudes (a bound, not the
        // typical error), then one rounding of the scaled result
        CHECK(std::abs(double(got) - alpha * want) <=
              alpha * (kdim * 0x1p-24 * mag) + 0x1p-24 * std::abs(alpha * want));
      }
  }
  TEST_CASE("gemm_pairs: A read as columns with a one-row shift, exact ends drop the value beside an odd end") {
    if (!attention::cpu_features().supports(attention::CpuIsa::kAvx512Bf16)) return;  // not on this CPU
    using Tiles = attention::detail::avx512bf16::Avx512Bf16Tiles;
    using attention::bf16;
    // dV += P^T dO's form: A(i, k) = at[(k - 1) * ld + i] (7 columns, 28 rows: k = 1..28, k = 0 reads as 0), B's rows
    // 0..29 as pairs, rows 0 and 29 NaN (the rows beside the block) and row 2 and 17 NaN too: block 0 sums k in
    // [1, 29), block 1 (row 6) k in [3, 17); every range end is odd, so each NaN shares a pair with a summed value.
    const int m = 7, n = 40, kdim = 29, ld = 9;
    const std::int64_t panel = 64 * 15;
    std::mt19937_64 rng(17);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    std::vector<float> at(static_cast<std::size_t>(28) * ld);
    for (float& x : at) x = float(bf16(dist(rng)));
    std::vector<std::vector<bf16>> rows(30, std::vector<bf16>(n));
    for (auto& r : rows)
      for (bf16& x : r) x = bf16(dist(rng));
    for (int nan_row : {0, 2, 17, 29}) rows[static_cast<std::size_t>(nan_row)][5] = bf16(std::nanf(""));
    std::vector<std::uint32_t> b(static_cast<std::size_t>(panel));
    for (int j = 0; j < 15; ++j)
      Tiles::pack_row_pairs(rows[static_cast<std::size_t>(2 * j)].data(),
                            rows[static_cast<std::size_t>(2 * j + 1)].data(), n, b.data() + j * 64, panel);
    const int k_lo[2] = {1, 3}, k_hi[2] = {29, 17};
    std::vector<float> c(static_cast<std::size_t>(m) * n, 0.5f);
    Tiles::gemm_pairs(m, n, kdim, at.data(), 1, ld, b.data(), panel, c.data(), n, true, 1.0f,
                      {nullptr, nullptr, k_lo, k_hi}, true, 1);
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < n; ++j) {
        CAPTURE(i);
        CAPTURE(j);
        double want = 0.5, mag = 0.5;
        for (int k = k_lo[i / 6]; k < k_hi[i / 6]; ++k) {
          const double x = double(at[static_cast<std::size_t>(k - 1) * ld + static_cast<std::size_t>(i)]) *
                           double(rows[static_cast<std::size_t>(k)][static_cast<std::size_t>(j)]);
          want += x;
          mag += std::abs(x);
        }
        const float got = c[static_cast<std::size_t>(i) * n + static_cast<std::size_t>(j)];
        if (j == 5 && i == 6) {  // block 1 sums row 2 .. 16: no NaN row inside [3, 17)
          CHECK(std::isfinite(got));
        }
        if (std::isnan(want)) {
          CHECK(std::isnan(got));  // a NaN inside the range stays
          continue;
        }
        CHECK(std::abs(double(got) - want) <= kdim * 0x1p-24 * mag + 0x1p-24 * std::abs(want));
      }
  }
#endif
}
