// SPDX-License-Identifier: Apache-2.0
// attention::KokkosFlash<Kokkos::DefaultHostExecutionSpace, T>: the shared kernel conformance cases
// (tests/support/kernel_cases.hpp, through a harness of Kokkos::Views) on several tile sizes, the
// unequal query/key and value head-size cases (MLA 192/128, 576/512, and small odd pairs), non-finite
// isolation, refusals and aliasing; and what is KokkosFlash's own: Kokkos::View interop without copies,
// determinism, and its tile refusals. Tolerances (max abs error / max(1, max|ref|)): double 1e-12, float 2e-5.
#include <doctest/doctest.h>

#include <seqpar/attention/reference.hpp>
#include <seqpar/kokkos.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "support/kernel_cases.hpp"

using namespace seqpar;

namespace {

namespace kc = test::kernel_cases;

using Space = Kokkos::DefaultHostExecutionSpace;

// max abs error / max(1, max|ref|): double 1e-12, float 2e-5 (forward and backward).
template <class T>
constexpr kc::Tolerance kTolerance =
    std::is_same_v<T, double> ? kc::Tolerance{1e-12, 1e-12} : kc::Tolerance{2e-5, 2e-5};

/// KokkosFlash's harness: tensors are Kokkos::Views in the space's memory (LayoutRight, a heads slice of a
/// wider View when padded), filled and read through host mirrors; the slices a View in that memory too.
template <class T>
struct Harness {
  using kernel_type = attention::KokkosFlash<Space, T>;
  using value_type = T;
  using accum_type = typename kernel_type::accum_type;
  using Memory = typename Space::memory_space;
  static constexpr bool kRefusesAliasing = true;

  template <class U>
  class Thd {
   public:
    Thd(std::int64_t tokens, int heads, int d, int pad)
        : v_("thd", static_cast<std::size_t>(tokens), static_cast<std::size_t>(heads + pad),
             static_cast<std::size_t>(d)),
          heads_(heads),
          pad_(pad) {}
    [[nodiscard]] ThdView<U> view() const { return kokkos::as_thd(v_).heads_slice(pad_ == 0 ? 0 : 1, heads_); }
    void write(const ThdTensor<double>& src) {
      const auto m = Kokkos::create_mirror_view(v_);
      Kokkos::deep_copy(m, v_);
      const int first = pad_ == 0 ? 0 : 1;
      for (std::int64_t t = 0; t < src.tokens; ++t)
        for (int h = 0; h < heads_; ++h)
          for (int x = 0; x < src.head_dim; ++x) m(t, h + first, x) = U(src.view()(t, h, x));
      Kokkos::deep_copy(v_, m);
    }
    [[nodiscard]] ThdTensor<double> read() const {
      const auto m = Kokkos::create_mirror_view(v_);
      Kokkos::deep_copy(m, v_);
      const int first = pad_ == 0 ? 0 : 1;
      ThdTensor<double> out(static_cast<std::int64_t>(v_.extent(0)), heads_, static_cast<int>(v_.extent(2)));
      for (std::int64_t t = 0; t < out.tokens; ++t)
        for (int h = 0; h < heads_; ++h)
          for (int x = 0; x < out.head_dim; ++x) out.view()(t, h, x) = double(m(t, h + first, x));
      return out;
    }

   private:
    Kokkos::View<U***, Kokkos::LayoutRight, Memory> v_;
    int heads_, pad_;
  };

  class Lse {
   public:
    Lse(int heads, std::int64_t tokens)
        : v_("lse", static_cast<std::size_t>(heads), static_cast<std::size_t>(tokens)) {}
    [[nodiscard]] LseView<accum_type> view() const { return kokkos::as_lse(v_); }
    void write(const LseTensor<double>& src) {
      const auto m = Kokkos::create_mirror_view(v_);
      for (int h = 0; h < src.heads; ++h)
        for (std::int64_t t = 0; t < src.tokens; ++t) m(h, t) = accum_type(src.view()(h, t));
      Kokkos::deep_copy(v_, m);
    }
    [[nodiscard]] LseTensor<double> read() const {
      const auto m = Kokkos::create_mirror_view(v_);
      Kokkos::deep_copy(m, v_);
      LseTensor<double> out(static_cast<int>(v_.extent(0)), static_cast<std::int64_t>(v_.extent(1)));
      for (int h = 0; h < out.heads; ++h)
        for (std::int64_t t = 0; t < out.tokens; ++t) out.view()(h, t) = double(m(h, t));
      return out;
    }

   private:
    Kokkos::View<accum_type**, Kokkos::LayoutRight, Memory> v_;
  };

  class Slices {
   public:
    Slices(std::span<const AttnSlice> s, std::int64_t, std::int64_t) : v_("slices", s.size()) {
      const auto m = Kokkos::create_mirror_view(v_);
      for (std::size_t i = 0; i < s.size(); ++i) m(i) = s[i];
      Kokkos::deep_copy(v_, m);
    }
    [[nodiscard]] std::span<const AttnSlice> span() const { return {v_.data(), v_.extent(0)}; }

   private:
    Kokkos::View<AttnSlice*, Memory> v_;
  };

  class Bytes {
   public:
    explicit Bytes(std::size_t n) : v_("workspace", n) {}
    [[nodiscard]] std::span<std::byte> span() const { return {v_.data(), v_.extent(0)}; }

   private:
    Kokkos::View<std::byte*, Memory> v_;
  };

  static AttentionShape adapt(AttentionShape shape) { return shape; }
  static void finish(const kernel_type& k) { k.exec().space().fence(); }
};

template <class T>
void fill(ThdView<T> v, std::mt19937_64& rng) {
  std::normal_distribution<double> n(0.0, 1.0);
  for (std::int64_t t = 0; t < v.tokens; ++t)
    for (int h = 0; h < v.heads; ++h)
      for (int x = 0; x < v.head_dim; ++x) v(t, h, x) = T(n(rng));
}

}  // namespace

TEST_SUITE("kokkos") {
  // The shared conformance cases (tests/support/kernel_cases.hpp) with the default tiles (one tile per short
  // slice), and in fp32 (the same code as fp64) with many partial tiles and with a key tile wider than the slices.
  TEST_CASE_TEMPLATE("KokkosFlash: the kernel conformance cases", T, double, float) {
    std::vector<attention::KokkosFlashArguments> tilings{{}};
    if (std::is_same_v<T, float>) {
      tilings.push_back({.q_tile = 7, .k_tile = 5});
      tilings.push_back({.q_tile = 16, .k_tile = 128});
    }
    for (const attention::KokkosFlashArguments& args : tilings) {
      CAPTURE(args.q_tile);
      CAPTURE(args.k_tile);
      attention::KokkosFlash<Space, T> flash(args);
      kc::run_cases<Harness<T>>(flash, kTolerance<T>);
    }
  }
  // d_qk != d_v (kernel_cases::head_size_cases: 192/128 causal GQA, 576/512 documents, 24/16 full, 16/40
  // sliding window, 20/12 strided documents across key tiles, 8/1 MQA): one tile per slice, many partial
  // tiles, and a key tile wider than the slices, in fp64 and fp32.
  TEST_CASE_TEMPLATE("KokkosFlash: unequal query/key and value head sizes, forward and backward", T, double, float) {
    const std::vector<attention::KokkosFlashArguments> tilings{
        {}, {.q_tile = 7, .k_tile = 5}, {.q_tile = 16, .k_tile = 128}};
    for (const attention::KokkosFlashArguments& args : tilings) {
      CAPTURE(args.q_tile);
      CAPTURE(args.k_tile);
      attention::KokkosFlash<Space, T> flash(args);
      CHECK(kc::run_head_size_cases<Harness<T>>(flash, kTolerance<T>) == kc::head_size_cases().size());
    }
  }
  TEST_CASE("KokkosFlash: the long kernel conformance cases") {
    attention::KokkosFlash<Space, float> flash;
    kc::run_long_cases<Harness<float>>(flash, kTolerance<float>, 1);  // 1111 causal (CI time)
  }
  // A key tile of the dK/dV pass may straddle a document boundary (or, in a ring, two sequences): rows
  // outside the slice or hidden by the mask are skipped, never multiplied by a zero P or dS, so a NaN or
  // infinity planted in one document's q or dout stays out of the neighbouring document's dK and dV.
  TEST_CASE("KokkosFlash keeps a NaN or infinity inside the document that holds it") {
    attention::KokkosFlash<Space, float> flash({.q_tile = 32, .k_tile = 48});
    kc::check_nonfinite_isolation<Harness<float>>(flash, kc::Isolation::kDocument, 4);
  }
  TEST_CASE("KokkosFlash refuses a softmax_scale its accumulation type cannot hold, in can_implement and its calls") {
    // Q is loaded pre-scaled in accum_type: 1e300 is Inf in float (all-NaN outputs), 1e-60 is 0.
    const attention::KokkosFlash<Space, float> flash;
    const AttentionShape huge{1, 1, 8, 1e300};
    const Status s = flash.can_implement(huge);
    REQUIRE_FALSE(s);
    CHECK(s.reason == "KokkosFlash: softmax_scale = 1e+300: is not representable in the accumulation type (float)");
    CHECK_FALSE(flash.can_implement({1, 1, 8, 1e-60}));
    // Finite in float, but past what float keeps exact at head_dim 8 (attention::max_softmax_scale<float>(8) =
    // 9.09e4): refused naming the limit; double holds 1e8 (its limit: 4.9e13), not 1e300.
    CHECK(flash.can_implement({1, 1, 8, 1e30}).reason.find("KokkosFlash: softmax_scale = 1e+30: exceeds 90852.2") !=
          std::string::npos);
    CHECK(attention::KokkosFlash<Space, double>().can_implement({1, 1, 8, 1e8}));
    CHECK_FALSE(attention::KokkosFlash<Space, double>().can_implement(huge));
    CHECK(flash.can_implement({1, 1, 8, 1e4}));

    ThdTensor<float> q(4, 1, 8), k(4, 1, 8), v(4, 1, 8), o(4, 1, 8), dq(4, 1, 8), dk(4, 1, 8), dv(4, 1, 8);
    LseTensor<float> lse(1, 4);
    const std::vector<AttnSlice> sl{{{0, 4}, {0, 4}, Mask::causal()}};
    std::vector<std::byte> ws(flash.workspace_bytes(huge, 4, 4));
    CHECK_THROWS_WITH_AS(flash.forward(huge, q.view(), k.view(), v.view(), sl, o.view(), lse.view(), ws),
                         doctest::Contains("softmax_scale"), std::invalid_argument);
    CHECK_THROWS_WITH_AS(flash.backward(huge, q.view(), k.view(), v.view(), o.view(), lse.view(), q.view(), sl,
                                        dq.view(), dk.view(), dv.view(), ws),
                         doctest::Contains("softmax_scale"), std::invalid_argument);
  }
  TEST_CASE(
      "KokkosFlash accepts any pair of head sizes it can hold, and refuses the others and views of the wrong size") {
    const attention::KokkosFlash<Space, float> flash;
    for (const int d_v : {0, 1, 4, 8, 40, 512, 1024}) {
      CAPTURE(d_v);
      CHECK(flash.can_implement({2, 1, 24, 0.0, d_v}));
    }
    CHECK(flash.can_implement({2, 1, 576, 0.0, 512}));
    for (const int d_v : {-1, 1025}) {
      const Status s = flash.can_implement({2, 1, 24, 0.0, d_v});
      REQUIRE_FALSE(s);
      CHECK(s.reason == "KokkosFlash: head_dim_v = " + std::to_string(d_v) + ": must be in [0, 1024] (0 = head_dim)");
    }
    // Team scratch counts each width: tiles that hold 8/8 refuse 8/1024 (V, O, dO tiles at 1024 values).
    const attention::KokkosFlash<Space, float> wide_tiles({.q_tile = 4096, .k_tile = 256});
    CHECK(wide_tiles.can_implement({1, 1, 8, 0.0, 8}));
    const Status scratch = wide_tiles.can_implement({1, 1, 8, 0.0, 1024});
    REQUIRE_FALSE(scratch);
    CHECK(scratch.reason.find("args.q_tile/k_tile = 4096/256: team scratch of") != std::string::npos);
    {  // and each call refuses for its own pass (the forward's O accumulator alone is 4096 x 1024 floats)
      AttentionShape narrow_qk{1, 1, 8};
      narrow_qk.head_dim_v = 1024;
      ThdTensor<float> q(3, 1, 8), v(3, 1, 1024), o(3, 1, 1024), dq(3, 1, 8), dk(3, 1, 8), dv(3, 1, 1024);
      LseTensor<float> lse(1, 3);
      const std::vector<AttnSlice> sl{{{0, 3}, {0, 3}, Mask::full()}};
      std::vector<std::byte> ws(wide_tiles.workspace_bytes(narrow_qk, 3, 3));
      CHECK_THROWS_WITH_AS(wide_tiles.forward(narrow_qk, q.view(), q.view(), v.view(), sl, o.view(), lse.view(), ws),
                           doctest::Contains("args.q_tile/k_tile = 4096/256"), std::invalid_argument);
      CHECK_THROWS_WITH_AS(wide_tiles.backward(narrow_qk, q.view(), q.view(), v.view(), o.view(), lse.view(), o.view(),
                                               sl, dq.view(), dk.view(), dv.view(), ws),
                           doctest::Contains("args.q_tile/k_tile = 4096/256"), std::invalid_argument);
    }

    // 24/16: q, k, dq, dk hold 24 values per head, v, o, dout, dv 16; a view of the other width is named.
    AttentionShape shape{2, 1, 24};
    shape.head_dim_v = 16;
    ThdTensor<float> q(6, 2, 24), k(6, 1, 24), v(6, 1, 16), o(6, 2, 16), dout(6, 2, 16), dq(6, 2, 24), dk(6, 1, 24),
        dv(6, 1, 16), v24(6, 1, 24), o24(6, 2, 24), dq16(6, 2, 16), dv24(6, 1, 24);
    LseTensor<float> lse(2, 6);
    const std::vector<AttnSlice> sl{{{0, 6}, {0, 6}, Mask::causal()}};
    std::vector<std::byte> ws(flash.workspace_bytes(shape, 6, 6));
    flash.forward(shape, q.view(), k.view(), v.view(), sl, o.view(), lse.view(), ws);
    flash.backward(shape, q.view(), k.view(), v.view(), o.view(), lse.view(), dout.view(), sl, dq.view(), dk.view(),
                   dv.view(), ws);
    CHECK_THROWS_WITH_AS(flash.forward(shape, q.view(), k.view(), v24.view(), sl, o.view(), lse.view(), ws),
                         doctest::Contains("v.head_dim = 24: expected 16"), std::invalid_argument);
    CHECK_THROWS_WITH_AS(flash.forward(shape, q.view(), k.view(), v.view(), sl, o24.view(), lse.view(), ws),
                         doctest::Contains("o.head_dim = 24: expected 16"), std::invalid_argument);
    CHECK_THROWS_WITH_AS(flash.backward(shape, q.view(), k.view(), v.view(), o.view(), lse.view(), dout.view(), sl,
                                        dq16.view(), dk.view(), dv.view(), ws),
                         doctest::Contains("dq.head_dim = 16: expected 24"), std::invalid_argument);
    CHECK_THROWS_WITH_AS(flash.backward(shape, q.view(), k.view(), v.view(), o.view(), lse.view(), dout.view(), sl,
                                        dq.view(), dk.view(), dv24.view(), ws),
                         doctest::Contains("dv.head_dim = 24: expected 16"), std::invalid_argument);
    AttentionShape bad = shape;
    bad.head_dim_v = 1025;
    CHECK_THROWS_WITH_AS(flash.forward(bad, q.view(), k.view(), v.view(), sl, o.view(), lse.view(), ws),
                         doctest::Contains("head_dim_v = 1025"), std::invalid_argument);
  }
  TEST_CASE("KokkosFlash refuses bad input and aliased outputs") {
    attention::KokkosFlash<Space, float> flash;
    kc::check_refusals<Harness<float>>(flash);
  }

  TEST_CASE("KokkosFlash on Kokkos::Views: as_thd / as_lse are the same memory, results equal the ThdView call") {
    using Flash = attention::KokkosFlash<Space, double>;
    const AttentionShape shape{4, 2, 12, 0.0};
    const std::int64_t n = 45;
    const auto slices = kc::documents({20, 25}, Mask::causal());
    using V3 = Kokkos::View<double***, Kokkos::LayoutRight, Kokkos::HostSpace>;
    using V2 = Kokkos::View<double**, Kokkos::LayoutRight, Kokkos::HostSpace>;
    V3 q("q", n, 4, 12), k("k", n, 2, 12), v("v", n, 2, 12), o("o", n, 4, 12);
    V2 lse("lse", 4, n);
    std::mt19937_64 rng(5);
    std::normal_distribution<double> dist(0.0, 1.0);
    for (V3* x : {&q, &k, &v})
      for (std::size_t i = 0; i < x->span(); ++i) x->data()[i] = dist(rng);
    const ThdView<double> qt = kokkos::as_thd(q);
    CHECK(qt.data == q.data());
    CHECK(qt.tokens == n);
    CHECK(qt.heads == 4);
    CHECK(qt.head_dim == 12);
    CHECK(&qt(3, 2, 5) == &q(3, 2, 5));
    const Kokkos::View<const double***, Kokkos::LayoutRight, Kokkos::HostSpace> qc = q;
    const ThdView<const double> qct = kokkos::as_thd(qc);
    CHECK(qct.data == q.data());
    const LseView<double> lt = kokkos::as_lse(lse);
    CHECK(&lt(3, 17) == &lse(3, 17));
    // and back: an unmanaged View over a strided ThdView
    ThdTensor<double> wide(n, 6, 12);
    const auto sub = wide.view().heads_slice(1, 4);
    const auto back = kokkos::as_view(sub);
    CHECK(&back(7, 3, 2) == &sub(7, 3, 2));
    const auto lback = kokkos::as_view(lt);
    CHECK(&lback(2, 9) == &lse(2, 9));

    const Flash flash;
    std::vector<std::byte> ws(flash.workspace_bytes(shape, n, n));
    flash.forward(shape, kokkos::as_thd(q), kokkos::as_thd(k), kokkos::as_thd(v), slices, kokkos::as_thd(o),
                  kokkos::as_lse(lse), ws);
    ThdTensor<double> o_ref(n, 4, 12);
    LseTensor<double> lse_ref(4, n);
    attention::Reference<double>().forward(shape, kokkos::as_thd(q), kokkos::as_thd(k), kokkos::as_thd(v), slices,
                                           o_ref.view(), lse_ref.view());
    double err = 0;
    for (std::int64_t t = 0; t < n; ++t)
      for (int h = 0; h < 4; ++h)
        for (int x = 0; x < 12; ++x) err = std::max(err, std::abs(o(t, h, x) - o_ref.view()(t, h, x)));
    CHECK(err <= 1e-12);
    CHECK(std::abs(lse(1, 30) - lse_ref.view()(1, 30)) <= 1e-12);
  }

  TEST_CASE("KokkosFlash backward is deterministic: two runs give the same bits") {
    using Flash = attention::KokkosFlash<Space, float>;
    const AttentionShape shape{4, 2, 16, 0.0};
    const std::int64_t n = 150;
    const auto slices = kc::documents({50, 1, 99}, Mask::causal());
    std::mt19937_64 rng(8);
    ThdTensor<float> q(n, 4, 16), k(n, 2, 16), v(n, 2, 16), dout(n, 4, 16), o(n, 4, 16);
    fill(q.view(), rng), fill(k.view(), rng), fill(v.view(), rng), fill(dout.view(), rng);
    LseTensor<float> lse(4, n);
    const Flash flash({.q_tile = 32, .k_tile = 16});
    std::vector<std::byte> ws(flash.workspace_bytes(shape, n, n));
    flash.forward(shape, q.view(), k.view(), v.view(), slices, o.view(), lse.view(), ws);
    std::vector<ThdTensor<float>> runs;
    for (int run = 0; run < 2; ++run) {
      ThdTensor<float> dq(n, 4, 16), dk(n, 2, 16), dv(n, 2, 16);
      flash.backward(shape, q.view(), k.view(), v.view(), o.view(), lse.view(), dout.view(), slices, dq.view(),
                     dk.view(), dv.view(), ws);
      runs.push_back(std::move(dq)), runs.push_back(std::move(dk)), runs.push_back(std::move(dv));
    }
    for (int i = 0; i < 3; ++i)
      CHECK(runs[static_cast<std::size_t>(i)].storage == runs[static_cast<std::size_t>(i + 3)].storage);
  }

  TEST_CASE("KokkosFlash refuses bad tiles, and tiles whose team scratch the space cannot hold, by name") {
    using Flash = attention::KokkosFlash<Space, float>;
    CHECK_THROWS_AS(Flash({.q_tile = 0}), std::invalid_argument);
    CHECK_THROWS_AS(Flash({.k_tile = 5000}), std::invalid_argument);
    const Flash huge({.q_tile = 4096, .k_tile = 4096});
    ThdTensor<float> q1(10, 4, 1024), k1(12, 2, 1024), o1(10, 4, 1024);
    LseTensor<float> lse(4, 10);
    const AttentionShape wide{4, 2, 1024, 0.0};
    const std::vector<AttnSlice> good{{{0, 10}, {0, 12}, Mask::causal(2)}};
    std::vector<std::byte> ws1(huge.workspace_bytes(wide, 10, 12));
    CHECK_THROWS_WITH_AS(huge.forward(wide, q1.view(), k1.view(), k1.view(), good, o1.view(), lse.view(), ws1),
                         doctest::Contains("args.q_tile/k_tile"), std::invalid_argument);
  }
}
