// SPDX-License-Identifier: Apache-2.0
// attention::KokkosFlash<Kokkos::DefaultHostExecutionSpace, T> against the fp64 Reference, forward and
// backward: every mask (full, causal with positive / negative offset, sliding window), document lists,
// rows in no slice, shared keys, GQA, odd lengths and head dims, strided views, several tile sizes;
// Kokkos::View interop without copies, determinism, and bad input.
// Tolerances (max abs error / max(1, max|ref|)): double 1e-12, float 2e-5.
#include <doctest/doctest.h>

#include <seqpar/attention/reference.hpp>
#include <seqpar/kokkos.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

using namespace seqpar;

namespace {

using Space = Kokkos::DefaultHostExecutionSpace;

template <class T>
constexpr double kTol = std::is_same_v<T, double> ? 1e-12 : 2e-5;

struct Case {
  std::string name;
  int hq = 2, hkv = 2, d = 16;
  std::int64_t q_rows = 0, k_rows = 0;
  std::vector<AttnSlice> slices;
  bool strided = false;  // views are heads_slice of a tensor with 2 extra heads
};

/// Storage of (tokens, heads [+ 2], d), viewed as (tokens, heads, d) from head 1 when strided.
template <class T>
struct Buf {
  ThdTensor<T> t;
  bool strided;
  Buf(std::int64_t tokens, int heads, int d, bool s) : t(tokens, heads + (s ? 2 : 0), d), strided(s) {}
  ThdView<T> view() { return strided ? t.view().heads_slice(1, t.heads - 2) : t.view(); }
};

template <class T>
void fill(ThdView<T> v, std::mt19937_64& rng, double offset = 0) {
  std::normal_distribution<double> n(0.0, 1.0);
  for (std::int64_t t = 0; t < v.tokens; ++t)
    for (int h = 0; h < v.heads; ++h)
      for (int x = 0; x < v.head_dim; ++x) v(t, h, x) = T(offset + n(rng));
}

template <class T>
ThdTensor<double> widen(ThdView<const T> v) {
  ThdTensor<double> out(v.tokens, v.heads, v.head_dim);
  for (std::int64_t t = 0; t < v.tokens; ++t)
    for (int h = 0; h < v.heads; ++h)
      for (int x = 0; x < v.head_dim; ++x) out.view()(t, h, x) = double(v(t, h, x));
  return out;
}

template <class T>
double rel_err(ThdView<const T> got, ThdView<const double> want) {
  double e = 0, scale = 1;
  for (std::int64_t t = 0; t < want.tokens; ++t)
    for (int h = 0; h < want.heads; ++h)
      for (int x = 0; x < want.head_dim; ++x) {
        scale = std::max(scale, std::abs(want(t, h, x)));
        e = std::max(e, std::abs(double(got(t, h, x)) - want(t, h, x)));
      }
  return e / scale;
}

struct Results {
  ThdTensor<double> o, dq, dk, dv;
  LseTensor<double> lse;
};

template <class T>
void check_case(const Case& c, attention::KokkosFlashArguments args) {
  CAPTURE(c.name);
  CAPTURE(args.q_tile);
  CAPTURE(args.k_tile);
  const AttentionShape shape{c.hq, c.hkv, c.d, 0.0};
  std::mt19937_64 rng(99);
  Buf<T> q(c.q_rows, c.hq, c.d, c.strided), k(c.k_rows, c.hkv, c.d, c.strided), v(c.k_rows, c.hkv, c.d, c.strided),
      dout(c.q_rows, c.hq, c.d, c.strided);
  fill(q.view(), rng), fill(k.view(), rng), fill(v.view(), rng), fill(dout.view(), rng);

  const auto qd = widen<T>(q.view()), kd = widen<T>(k.view()), vd = widen<T>(v.view()), dod = widen<T>(dout.view());
  ThdTensor<double> o_ref(c.q_rows, c.hq, c.d), dq_ref(c.q_rows, c.hq, c.d), dk_ref(c.k_rows, c.hkv, c.d),
      dv_ref(c.k_rows, c.hkv, c.d);
  LseTensor<double> lse_ref(c.hq, c.q_rows);
  const attention::Reference<double> ref;
  ref.forward(shape, qd.view(), kd.view(), vd.view(), c.slices, o_ref.view(), lse_ref.view());
  ref.backward(shape, qd.view(), kd.view(), vd.view(), o_ref.view(), lse_ref.view(), dod.view(), c.slices,
               dq_ref.view(), dk_ref.view(), dv_ref.view());

  using Flash = attention::KokkosFlash<Space, T>;
  using A = typename Flash::accum_type;
  const Flash flash(args);
  std::vector<std::byte> ws(flash.workspace_bytes(shape, c.q_rows, c.k_rows));
  Buf<T> o(c.q_rows, c.hq, c.d, c.strided);
  fill(o.view(), rng, 3.0);  // garbage: forward overwrites every row
  LseTensor<A> lse(c.hq, c.q_rows);
  std::fill(lse.storage.begin(), lse.storage.end(), A(7));
  flash.forward(shape, q.view(), k.view(), v.view(), c.slices, o.view(), lse.view(), ws);
  CHECK(rel_err<T>(o.view(), o_ref.view()) <= kTol<T>);
  double lse_err = 0;
  for (int h = 0; h < c.hq; ++h)
    for (std::int64_t t = 0; t < c.q_rows; ++t) {
      const double want = lse_ref.view()(h, t), got = double(lse.view()(h, t));
      if (std::isinf(want)) {
        REQUIRE(got == -std::numeric_limits<double>::infinity());
      } else {
        lse_err = std::max(lse_err, std::abs(got - want) / std::max(1.0, std::abs(want)));
      }
    }
  CHECK(lse_err <= kTol<T>);

  // backward accumulates (+=): start from 0.25 and compare with ref + 0.25
  Buf<T> dq(c.q_rows, c.hq, c.d, c.strided), dk(c.k_rows, c.hkv, c.d, c.strided), dv(c.k_rows, c.hkv, c.d, c.strided);
  for (auto* b : {&dq, &dk, &dv}) std::fill(b->t.storage.begin(), b->t.storage.end(), T(0.25));
  flash.backward(shape, q.view(), k.view(), v.view(), o.view(), lse.view(), dout.view(), c.slices, dq.view(), dk.view(),
                 dv.view(), ws);
  for (auto* r : {&dq_ref, &dk_ref, &dv_ref})
    for (double& x : r->storage) x += 0.25;
  CHECK(rel_err<T>(dq.view(), dq_ref.view()) <= kTol<T>);
  CHECK(rel_err<T>(dk.view(), dk_ref.view()) <= kTol<T>);
  CHECK(rel_err<T>(dv.view(), dv_ref.view()) <= kTol<T>);
}

std::vector<AttnSlice> documents(const std::vector<std::int64_t>& lengths, Mask mask) {
  std::vector<AttnSlice> s;
  std::int64_t at = 0;
  for (std::int64_t len : lengths) {
    s.push_back({{at, at + len}, {at, at + len}, mask});
    at += len;
  }
  return s;
}

std::vector<Case> cases() {
  const auto one = [](std::int64_t q, std::int64_t k, Mask m) { return std::vector<AttnSlice>{{{0, q}, {0, k}, m}}; };
  std::vector<Case> cs;
  cs.push_back({"1 token causal", 2, 2, 16, 1, 1, one(1, 1, Mask::causal()), false});
  cs.push_back({"full 37x53 d24", 2, 2, 24, 37, 53, one(37, 53, Mask::full()), false});
  cs.push_back({"full 37x53 d13 GQA 3:1", 3, 1, 13, 37, 53, one(37, 53, Mask::full()), false});
  cs.push_back({"causal 101 d64", 2, 2, 64, 101, 101, one(101, 101, Mask::causal()), false});
  cs.push_back({"causal offset 16", 2, 1, 16, 37, 53, one(37, 53, Mask::causal(16)), false});
  cs.push_back({"causal offset -5 (rows that see nothing)", 2, 2, 16, 37, 53, one(37, 53, Mask::causal(-5)), false});
  cs.push_back({"sliding window 9, offset 16", 4, 2, 8, 70, 86, one(70, 86, Mask::sliding_window(9, 16)), false});
  cs.push_back({"sliding window 1", 2, 2, 8, 33, 33, one(33, 33, Mask::sliding_window(1)), false});
  cs.push_back({"sliding window 40, GQA 4:1", 4, 1, 32, 130, 130, one(130, 130, Mask::sliding_window(40)), false});
  cs.push_back({"GQA 6:2 causal, odd length 77", 6, 2, 16, 77, 77, one(77, 77, Mask::causal()), false});
  cs.push_back({"document causal", 4, 2, 16, 111, 111, documents({1, 5, 1, 70, 33, 1}, Mask::causal()), false});
  cs.push_back({"document sliding 7", 2, 1, 16, 111, 111, documents({40, 1, 63, 7}, Mask::sliding_window(7)), false});
  cs.push_back({"strided heads_slice", 4, 2, 16, 90, 90, documents({17, 73}, Mask::causal()), true});
  {  // rows in no slice, slices sharing keys, an empty slice, unsorted query ranges
    Case c{"gaps, shared keys, empty and unsorted slices", 2, 1, 16, 80, 70, {}, false};
    c.slices = {{{30, 60}, {10, 70}, Mask::causal(30)},
                {{0, 20}, {0, 70}, Mask::causal(10)},
                {{20, 20}, {0, 70}, Mask::full()},
                {{65, 78}, {5, 40}, Mask::full()}};
    cs.push_back(c);
  }
  return cs;
}

}  // namespace

TEST_SUITE("kokkos") {
  TEST_CASE_TEMPLATE("KokkosFlash matches Reference forward and backward", T, double, float) {
    for (const Case& c : cases()) {
      check_case<T>(c, {});                             // default tiles: one tile per short slice
      check_case<T>(c, {.q_tile = 7, .k_tile = 5});     // many partial tiles
      check_case<T>(c, {.q_tile = 16, .k_tile = 128});  // key tile wider than the slices
    }
  }

  TEST_CASE("KokkosFlash on Kokkos::Views: as_thd / as_lse are the same memory, results equal the ThdView call") {
    using Flash = attention::KokkosFlash<Space, double>;
    const AttentionShape shape{4, 2, 12, 0.0};
    const std::int64_t n = 45;
    const auto slices = documents({20, 25}, Mask::causal());
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
    CHECK(rel_err<double>(kokkos::as_thd(o), o_ref.view()) <= 1e-12);
    CHECK(std::abs(lse(1, 30) - lse_ref.view()(1, 30)) <= 1e-12);
  }

  TEST_CASE("KokkosFlash backward is deterministic: two runs give the same bits") {
    using Flash = attention::KokkosFlash<Space, float>;
    const AttentionShape shape{4, 2, 16, 0.0};
    const std::int64_t n = 150;
    const auto slices = documents({50, 1, 99}, Mask::causal());
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

  TEST_CASE("KokkosFlash rejects bad input with std::invalid_argument") {
    using Flash = attention::KokkosFlash<Space, float>;
    const AttentionShape shape{4, 2, 32, 0.0};
    const Flash flash;
    ThdTensor<float> q(10, 4, 32), k(12, 2, 32), v(12, 2, 32), o(10, 4, 32), dq(10, 4, 32), dk(12, 2, 32),
        dv(12, 2, 32);
    LseTensor<float> lse(4, 10);
    std::vector<std::byte> ws(flash.workspace_bytes(shape, 10, 12));
    const std::vector<AttnSlice> good{{{0, 10}, {0, 12}, Mask::causal(2)}};
    CHECK_NOTHROW(flash.forward(shape, q.view(), k.view(), v.view(), good, o.view(), lse.view(), ws));
    ThdTensor<float> o_bad(9, 4, 32), v_bad(12, 2, 16);
    CHECK_THROWS_AS(flash.forward(shape, q.view(), k.view(), v.view(), good, o_bad.view(), lse.view(), ws),
                    std::invalid_argument);
    CHECK_THROWS_AS(flash.forward(shape, q.view(), k.view(), v_bad.view(), good, o.view(), lse.view(), ws),
                    std::invalid_argument);
    const std::vector<AttnSlice> overlap{{{0, 6}, {0, 12}, Mask::full()}, {{5, 10}, {0, 12}, Mask::full()}};
    CHECK_THROWS_AS(flash.forward(shape, q.view(), k.view(), v.view(), overlap, o.view(), lse.view(), ws),
                    std::invalid_argument);
    const std::vector<AttnSlice> out_of_range{{{0, 10}, {0, 13}, Mask::full()}};
    CHECK_THROWS_AS(flash.backward(shape, q.view(), k.view(), v.view(), o.view(), lse.view(), o.view(), out_of_range,
                                   dq.view(), dk.view(), dv.view(), ws),
                    std::invalid_argument);
    const std::vector<AttnSlice> no_window{{{0, 10}, {0, 12}, Mask::sliding_window(0)}};
    CHECK_THROWS_AS(flash.forward(shape, q.view(), k.view(), v.view(), no_window, o.view(), lse.view(), ws),
                    std::invalid_argument);
    std::vector<std::byte> small(ws.size() / 2);
    CHECK_THROWS_AS(flash.forward(shape, q.view(), k.view(), v.view(), good, o.view(), lse.view(), small),
                    std::invalid_argument);
    CHECK_THROWS_AS(Flash({.q_tile = 0}), std::invalid_argument);
    CHECK_THROWS_AS(Flash({.k_tile = 5000}), std::invalid_argument);
    // Tiles whose team scratch exceeds the space's level-1 maximum are refused by name.
    const Flash huge({.q_tile = 4096, .k_tile = 4096});
    ThdTensor<float> q1(10, 4, 1024), k1(12, 2, 1024), o1(10, 4, 1024);
    const AttentionShape wide{4, 2, 1024, 0.0};
    std::vector<std::byte> ws1(huge.workspace_bytes(wide, 10, 12));
    CHECK_THROWS_WITH_AS(huge.forward(wide, q1.view(), k1.view(), k1.view(), good, o1.view(), lse.view(), ws1),
                         doctest::Contains("args.q_tile/k_tile"), std::invalid_argument);
    const AttentionShape bad_gqa{3, 2, 32, 0.0};
    CHECK_THROWS_AS(flash.forward(bad_gqa, q.view(), k.view(), v.view(), good, o.view(), lse.view(), ws),
                    std::invalid_argument);
  }
}
