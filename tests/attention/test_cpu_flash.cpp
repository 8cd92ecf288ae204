// SPDX-License-Identifier: Apache-2.0
// CpuFlash<float|double> against the fp64 Reference, forward and backward, on every mask and layout.
// Tolerances (max abs error relative to the output scale max|ref|, floor 1):
//   double: 1e-10;  float: 1e-5 forward, 2e-5 backward (fp32 accumulation over up to 1111 keys / rows);
//   bf16 storage (fp32 accumulation): 1e-2 forward, 2e-2 backward.
#include <doctest/doctest.h>

#include <seqpar/attention/cpu_flash.hpp>
#include <seqpar/attention/reference.hpp>

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

using namespace seqpar;

namespace {

template <class T>
struct Tol;
template <>
struct Tol<double> {
  static constexpr double fwd = 1e-10, bwd = 1e-10;
};
template <>
struct Tol<float> {
  static constexpr double fwd = 1e-5, bwd = 2e-5;
};
// bf16 storage: outputs and gradients are rounded to 8 significant bits (relative 2^-9 = 0.2%), and the
// backward reads the rounded O; fp32 inside.
template <>
struct Tol<attention::bf16> {
  static constexpr double fwd = 1e-2, bwd = 2e-2;
};

struct Case {
  std::string name;
  int hq = 2, hkv = 2, d = 64;
  std::int64_t q_rows = 0, k_rows = 0;
  std::vector<AttnSlice> slices;
  bool strided = false;  // views are heads_slice of a wider tensor
  /// Key magnitudes ramp along the buffer: k(t) *= 1 + ramp * t (ramp > 0: every later key tile holds larger
  /// scores, so the online softmax's reference max must move, by more than its lazy threshold, tile after tile)
  /// or 1 + |ramp| * (k_rows - 1 - t) (ramp < 0: the first tile dominates and the max never moves again).
  double k_ramp = 0.0;
};

/// (tokens, heads + pad, d) storage viewed as (tokens, heads, d) starting at head `pad / 2`.
template <class T>
struct Buf {
  ThdTensor<T> t;
  int pad = 0;
  Buf(std::int64_t tokens, int heads, int d, bool strided)
      : t(tokens, heads + (strided ? 3 : 0), d), pad(strided ? 3 : 0) {}
  ThdView<T> view() { return t.view().heads_slice(pad == 0 ? 0 : 1, t.heads - pad); }
};

template <class T>
ThdTensor<double> to_double(ThdView<const T> v) {
  ThdTensor<double> out(v.tokens, v.heads, v.head_dim);
  for (std::int64_t t = 0; t < v.tokens; ++t)
    for (int h = 0; h < v.heads; ++h)
      for (int x = 0; x < v.head_dim; ++x) out.view()(t, h, x) = double(v(t, h, x));
  return out;
}

template <class T>
void fill_normal(ThdView<T> v, std::mt19937_64& rng) {
  std::normal_distribution<double> dist(0.0, 1.0);
  for (std::int64_t t = 0; t < v.tokens; ++t)
    for (int h = 0; h < v.heads; ++h)
      for (int x = 0; x < v.head_dim; ++x) v(t, h, x) = T(dist(rng));
}

template <class T>
double max_abs(ThdView<const T> v) {
  double m = 0;
  for (std::int64_t t = 0; t < v.tokens; ++t)
    for (int h = 0; h < v.heads; ++h)
      for (int x = 0; x < v.head_dim; ++x) m = std::max(m, std::abs(double(v(t, h, x))));
  return m;
}

/// max |a - b| / max(1, max|b|)
template <class T>
double rel_err(ThdView<const T> a, ThdView<const double> b) {
  double e = 0;
  for (std::int64_t t = 0; t < a.tokens; ++t)
    for (int h = 0; h < a.heads; ++h)
      for (int x = 0; x < a.head_dim; ++x) e = std::max(e, std::abs(double(a(t, h, x)) - b(t, h, x)));
  return e / std::max(1.0, max_abs(b));
}

template <class T>
void check_case(const Case& c, const attention::CpuFlashArguments& args) {
  CAPTURE(c.name);
  CAPTURE(args.threads);
  CAPTURE(args.q_tile);
  const AttentionShape shape{c.hq, c.hkv, c.d, 0.0};
  std::mt19937_64 rng(1234);
  Buf<T> q(c.q_rows, c.hq, c.d, c.strided), k(c.k_rows, c.hkv, c.d, c.strided), v(c.k_rows, c.hkv, c.d, c.strided),
      dout(c.q_rows, c.hq, c.d, c.strided);
  fill_normal(q.view(), rng);
  fill_normal(k.view(), rng);
  fill_normal(v.view(), rng);
  fill_normal(dout.view(), rng);
  if (c.k_ramp != 0.0)
    for (std::int64_t t = 0; t < c.k_rows; ++t) {
      const double f = c.k_ramp > 0 ? 1 + c.k_ramp * double(t) : 1 - c.k_ramp * double(c.k_rows - 1 - t);
      for (int h = 0; h < c.hkv; ++h)
        for (int x = 0; x < c.d; ++x) k.view()(t, h, x) = T(double(k.view()(t, h, x)) * f);
    }

  // fp64 oracle on the same (T-representable) inputs
  const auto qd = to_double<T>(q.view()), kd = to_double<T>(k.view()), vd = to_double<T>(v.view()),
             dod = to_double<T>(dout.view());
  ThdTensor<double> o_ref(c.q_rows, c.hq, c.d), dq_ref(c.q_rows, c.hq, c.d), dk_ref(c.k_rows, c.hkv, c.d),
      dv_ref(c.k_rows, c.hkv, c.d);
  LseTensor<double> lse_ref(c.hq, c.q_rows);
  const attention::Reference<double> ref;
  ref.forward(shape, qd.view(), kd.view(), vd.view(), c.slices, o_ref.view(), lse_ref.view());
  ref.backward(shape, qd.view(), kd.view(), vd.view(), o_ref.view(), lse_ref.view(), dod.view(), c.slices,
               dq_ref.view(), dk_ref.view(), dv_ref.view());

  using Flash = attention::CpuFlash<T>;
  using A = typename Flash::accum_type;
  const Flash flash(args);
  std::vector<std::byte> ws(flash.workspace_bytes(shape, c.q_rows, c.k_rows));
  Buf<T> o(c.q_rows, c.hq, c.d, c.strided);
  fill_normal(o.view(), rng);  // garbage: forward must overwrite every row
  LseTensor<A> lse(c.hq, c.q_rows);
  flash.forward(shape, q.view(), k.view(), v.view(), c.slices, o.view(), lse.view(), ws);
  CHECK(rel_err<T>(o.view(), o_ref.view()) <= Tol<T>::fwd);
  for (int h = 0; h < c.hq; ++h)
    for (std::int64_t t = 0; t < c.q_rows; ++t) {
      const double r = lse_ref.view()(h, t), got = double(lse.view()(h, t));
      if (std::isinf(r)) {
        REQUIRE(got == -std::numeric_limits<double>::infinity());
      } else {
        REQUIRE(std::abs(got - r) <= Tol<T>::fwd * std::max(1.0, std::abs(r)));
      }
    }

  // backward accumulates: start from 0.5 and compare to ref + 0.5
  Buf<T> dq(c.q_rows, c.hq, c.d, c.strided), dk(c.k_rows, c.hkv, c.d, c.strided), dv(c.k_rows, c.hkv, c.d, c.strided);
  for (auto* b : {&dq, &dk, &dv}) std::fill(b->t.storage.begin(), b->t.storage.end(), T(0.5));
  flash.backward(shape, q.view(), k.view(), v.view(), o.view(), lse.view(), dout.view(), c.slices, dq.view(), dk.view(),
                 dv.view(), ws);
  for (auto* r : {&dq_ref, &dk_ref, &dv_ref})
    for (double& x : r->storage) x += 0.5;
  CHECK(rel_err<T>(dq.view(), dq_ref.view()) <= Tol<T>::bwd);
  CHECK(rel_err<T>(dk.view(), dk_ref.view()) <= Tol<T>::bwd);
  CHECK(rel_err<T>(dv.view(), dv_ref.view()) <= Tol<T>::bwd);
}

std::vector<AttnSlice> self_slices(const std::vector<std::int64_t>& docs, Mask mask) {
  std::vector<AttnSlice> s;
  std::int64_t at = 0;
  for (std::int64_t len : docs) {
    s.push_back({{at, at + len}, {at, at + len}, mask});
    at += len;
  }
  return s;
}

std::vector<Case> small_cases() {
  std::vector<Case> cs;
  const auto one = [](std::int64_t q, std::int64_t k, Mask m) { return std::vector<AttnSlice>{{{0, q}, {0, k}, m}}; };
  cs.push_back({"len1 causal", 2, 2, 64, 1, 1, one(1, 1, Mask::causal()), false});
  cs.push_back({"len1 full", 2, 1, 128, 1, 1, one(1, 1, Mask::full()), false});
  cs.push_back({"len7 causal", 2, 2, 64, 7, 7, one(7, 7, Mask::causal()), false});
  cs.push_back({"len7 full d40", 4, 1, 40, 7, 7, one(7, 7, Mask::full()), false});
  cs.push_back({"full 37x53 d24", 2, 2, 24, 37, 53, one(37, 53, Mask::full()), false});
  cs.push_back(
      {"causal d20 (8 x 8 transposes plus a remainder)", 2, 1, 20, 45, 45, one(45, 45, Mask::causal()), false});
  cs.push_back({"causal offset 16", 2, 1, 64, 37, 53, one(37, 53, Mask::causal(16)), false});
  cs.push_back({"causal offset -5 (masked rows)", 2, 2, 64, 37, 53, one(37, 53, Mask::causal(-5)), false});
  cs.push_back({"sliding w9 offset 16", 8, 2, 40, 70, 86, one(70, 86, Mask::sliding_window(9, 16)), false});
  cs.push_back({"sliding w100 d128 GQA 4:1", 4, 1, 128, 130, 130, one(130, 130, Mask::sliding_window(100)), false});
  cs.push_back({"GQA 8:2 causal d128", 8, 2, 128, 150, 150, one(150, 150, Mask::causal()), false});
  cs.push_back({"document causal", 4, 2, 64, 111, 111, self_slices({1, 5, 1, 70, 33, 1}, Mask::causal()), false});
  cs.push_back({"strided heads_slice", 4, 2, 40, 90, 90, self_slices({17, 73}, Mask::causal()), true});
  // Documents across several 128-key tiles: starts and ends at, just before and just after tile edges
  // (127, 128, 129, 256), a document longer than a tile inside one, and one-token documents between them.
  cs.push_back({"document causal across key tiles", 4, 2, 48, 700, 700,
                self_slices({127, 1, 128, 129, 1, 214, 100}, Mask::causal()), false});
  cs.push_back({"sliding w140 across key tiles, GQA 6:2", 6, 2, 40, 520, 520,
                self_slices({3, 389, 128}, Mask::sliding_window(140)), false});
  {  // rows in no slice, and two query blocks sharing keys (zigzag-like)
    Case c{"gaps and shared keys", 2, 1, 64, 80, 70, {}, false};
    c.slices = {{{0, 20}, {0, 70}, Mask::causal(10)},
                {{30, 60}, {10, 70}, Mask::causal(30)},
                {{65, 78}, {5, 40}, Mask::full()}};
    cs.push_back(c);
  }
  {  // log2-domain scores growing by ~0.3 per key: the reference max moves past the lazy threshold (8) again and
     // again, so the output rows are rescaled; and the mirror case, where it never moves after the first tile
    Case up{"causal, key norms ramping up", 2, 1, 64, 300, 300, one(300, 300, Mask::causal()), false, 0.05};
    cs.push_back(up);
    Case down{"causal, key norms ramping down", 2, 1, 64, 300, 300, one(300, 300, Mask::causal()), false, -0.05};
    cs.push_back(down);
  }
  return cs;
}

// ---- non-finite isolation ----
// Four documents packed in one buffer (KV tiles of 128 keys straddle their boundaries), masks causal,
// causal, sliding window and full; a NaN or infinity planted at one token of one tensor must leave every
// output and gradient that cannot depend on it bit-for-bit as in the clean run (and finite).
struct Outputs {
  ThdTensor<double> o, dq, dk, dv;  // converted for comparison (exact: float -> double)
  LseTensor<double> lse;
};

template <class T>
Outputs run_flash(const AttentionShape& shape, const std::vector<AttnSlice>& slices, std::int64_t n,
                  const ThdTensor<T>& q, const ThdTensor<T>& k, const ThdTensor<T>& v, const ThdTensor<T>& dout,
                  int threads) {
  using Flash = attention::CpuFlash<T>;
  const Flash flash({threads, 48, 24});
  std::vector<std::byte> ws(flash.workspace_bytes(shape, n, n));
  ThdTensor<T> o(n, shape.heads_q, shape.head_dim), dq(n, shape.heads_q, shape.head_dim),
      dk(n, shape.heads_kv, shape.head_dim), dv(n, shape.heads_kv, shape.head_dim);
  LseTensor<typename Flash::accum_type> lse(shape.heads_q, n);
  flash.forward(shape, q.view(), k.view(), v.view(), slices, o.view(), lse.view(), ws);
  flash.backward(shape, q.view(), k.view(), v.view(), o.view(), lse.view(), dout.view(), slices, dq.view(), dk.view(),
                 dv.view(), ws);
  Outputs out{to_double<T>(o.view()), to_double<T>(dq.view()), to_double<T>(dk.view()), to_double<T>(dv.view()),
              LseTensor<double>(shape.heads_q, n)};
  for (int h = 0; h < shape.heads_q; ++h)
    for (std::int64_t t = 0; t < n; ++t) out.lse.view()(h, t) = double(lse.view()(h, t));
  return out;
}

/// Rows `t` of `a` and `b` (every head) are bit-identical and (for `finite`) finite.
bool same_rows(const ThdTensor<double>& a, const ThdTensor<double>& b, std::int64_t t) {
  for (int h = 0; h < a.heads; ++h)
    for (int x = 0; x < a.head_dim; ++x) {
      const double u = a.view()(t, h, x), w = b.view()(t, h, x);
      if (!(std::isfinite(u) && std::memcmp(&u, &w, sizeof u) == 0)) return false;
    }
  return true;
}

template <class T>
void check_nonfinite_isolation(int threads) {
  const AttentionShape shape{4, 2, 40, 0.0};
  std::vector<AttnSlice> slices;
  const std::vector<std::pair<std::int64_t, Mask>> docs{
      {100, Mask::causal()}, {150, Mask::causal()}, {90, Mask::sliding_window(33)}, {60, Mask::full()}};
  std::int64_t n = 0;
  for (const auto& [len, m] : docs) {
    slices.push_back({{n, n + len}, {n, n + len}, m});
    n += len;
  }
  std::mt19937_64 rng(99);
  ThdTensor<T> q(n, 4, 40), k(n, 2, 40), v(n, 2, 40), dout(n, 4, 40);
  for (auto* t : {&q, &k, &v, &dout}) fill_normal(t->view(), rng);
  const Outputs clean = run_flash<T>(shape, slices, n, q, k, v, dout, threads);

  const auto doc_of = [&](std::int64_t t) {
    for (std::size_t s = 0; s < slices.size(); ++s)
      if (slices[s].q_range.contains(t)) return s;
    return slices.size();
  };
  // does query token i see key token j (same document, visible under its mask)?
  const auto sees = [&](std::int64_t i, std::int64_t j) {
    const std::size_t s = doc_of(i);
    if (s != doc_of(j)) return false;
    const AttnSlice& sl = slices[s];
    return sl.mask.visible_keys(i - sl.q_range.begin, sl.k_range.size()).contains(j - sl.k_range.begin);
  };
  const T bad_values[] = {T(std::numeric_limits<float>::quiet_NaN()), T(-std::numeric_limits<float>::infinity())};
  const char* names[] = {"q", "k", "v", "dout"};
  // planted tokens: inside a causal document mid-tile, at a document's last token, in the window and full docs
  // (double runs the portable path, ~10x slower: two positions keep the test cheap under the sanitizers)
  const std::vector<std::int64_t> planted =
      std::is_same_v<T, double> ? std::vector<std::int64_t>{130, 300} : std::vector<std::int64_t>{130, 249, 300, 370};
  for (std::int64_t at : planted) {
    for (int which = 0; which < 4; ++which)
      for (T bad : bad_values) {
        CAPTURE(names[which]);
        CAPTURE(at);
        CAPTURE(double(float(bad)));
        ThdTensor<T> qb = q, kb = k, vb = v, db = dout;
        ThdTensor<T>* tgt[] = {&qb, &kb, &vb, &db};
        tgt[which]->view()(at, 0, 3) = bad;
        const Outputs got = run_flash<T>(shape, slices, n, qb, kb, vb, db, threads);
        if (which == 0 && std::isnan(double(float(bad)))) CHECK(std::isnan(got.o.view()(at, 0, 0)));  // not hidden
        for (std::int64_t t = 0; t < n; ++t) {
          // Which outputs of token t may legitimately depend on the planted value?
          bool o_dep = false, dq_dep = false, kv_dep = false;
          if (which == 0) {  // q[at]: row at, and keys it sees
            o_dep = dq_dep = t == at;
            kv_dep = sees(at, t);
          } else if (which == 3) {  // dout[at]: dq of row at, dk/dv of keys it sees
            dq_dep = t == at;
            kv_dep = sees(at, t);
          } else {  // k or v at key `at`: rows that see it; their gradients reach every key those rows see
            o_dep = dq_dep = sees(t, at);
            for (std::int64_t i = 0; i < n && !kv_dep; ++i) kv_dep = sees(i, at) && sees(i, t);
          }
          CAPTURE(t);
          if (!o_dep) {
            CHECK(same_rows(got.o, clean.o, t));
            for (int h = 0; h < 4; ++h) {
              const double a = got.lse.view()(h, t), b = clean.lse.view()(h, t);
              CHECK(std::memcmp(&a, &b, sizeof a) == 0);
            }
          }
          if (!dq_dep) CHECK(same_rows(got.dq, clean.dq, t));
          if (!kv_dep) {
            CHECK(same_rows(got.dk, clean.dk, t));
            CHECK(same_rows(got.dv, clean.dv, t));
          }
        }
      }
  }
}
}  // namespace

TEST_SUITE("attention") {
  TEST_CASE_TEMPLATE("CpuFlash matches Reference forward and backward on small shapes", T, float, double,
                     attention::bf16) {
    for (const Case& c : small_cases()) {
      check_case<T>(c, {1, 576, 192});
      check_case<T>(c, {2, 12, 6});  // small tiles: many query tiles and blocks per slice
    }
  }

  TEST_CASE_TEMPLATE("CpuFlash matches Reference at length 1111", T, float, double) {
    Case causal{"1111 causal GQA 2:1", 2, 1, 64, 1111, 1111, {{{0, 1111}, {0, 1111}, Mask::causal()}}, false};
    check_case<T>(causal, {2, 576, 192});
    Case docs{
        "1111 document causal d40", 2, 2, 40, 1111, 1111, self_slices({1, 300, 1, 500, 2, 307}, Mask::causal()), true};
    check_case<T>(docs, {1, 96, 48});
  }

  TEST_CASE("CpuFlash is deterministic across runs and thread counts") {
    const AttentionShape shape{4, 2, 64, 0.0};
    const std::int64_t n = 300;
    std::mt19937_64 rng(7);
    ThdTensor<float> q(n, 4, 64), k(n, 2, 64), v(n, 2, 64), dout(n, 4, 64);
    for (auto* t : {&q, &k, &v, &dout}) fill_normal(t->view(), rng);
    const auto slices = self_slices({100, 200}, Mask::causal());
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

  TEST_CASE("CpuFlash rejects bad input") {
    const AttentionShape shape{4, 2, 32, 0.0};
    const attention::CpuFlash<float> flash;
    ThdTensor<float> q(10, 4, 32), k(12, 2, 32), v(12, 2, 32), o(10, 4, 32), dq(10, 4, 32), dk(12, 2, 32),
        dv(12, 2, 32);
    LseTensor<float> lse(4, 10);
    std::vector<std::byte> ws(flash.workspace_bytes(shape, 10, 12));
    const std::vector<AttnSlice> good{{{0, 10}, {0, 12}, Mask::causal(2)}};
    CHECK_NOTHROW(flash.forward(shape, q.view(), k.view(), v.view(), good, o.view(), lse.view(), ws));

    ThdTensor<float> o_bad(9, 4, 32);
    CHECK_THROWS_AS(flash.forward(shape, q.view(), k.view(), v.view(), good, o_bad.view(), lse.view(), ws),
                    std::invalid_argument);
    ThdTensor<float> v_bad(12, 2, 16);
    CHECK_THROWS_AS(flash.forward(shape, q.view(), k.view(), v_bad.view(), good, o.view(), lse.view(), ws),
                    std::invalid_argument);
    const std::vector<AttnSlice> overlap{{{0, 6}, {0, 12}, Mask::full()}, {{5, 10}, {0, 12}, Mask::full()}};
    CHECK_THROWS_AS(flash.forward(shape, q.view(), k.view(), v.view(), overlap, o.view(), lse.view(), ws),
                    std::invalid_argument);
    CHECK_THROWS_AS(flash.backward(shape, q.view(), k.view(), v.view(), o.view(), lse.view(), o.view(), overlap,
                                   dq.view(), dk.view(), dv.view(), ws),
                    std::invalid_argument);
    CHECK_THROWS_AS(flash.backward(shape, q.view(), k.view(), v.view(), o.view(), lse.view(), o.view(), good, dq.view(),
                                   dq.view(), dv.view(), ws),
                    std::invalid_argument);
    const std::vector<AttnSlice> out_of_range{{{0, 10}, {0, 13}, Mask::full()}};
    CHECK_THROWS_AS(flash.forward(shape, q.view(), k.view(), v.view(), out_of_range, o.view(), lse.view(), ws),
                    std::invalid_argument);
    std::vector<std::byte> small(ws.size() / 2);
    CHECK_THROWS_AS(flash.forward(shape, q.view(), k.view(), v.view(), good, o.view(), lse.view(), small),
                    std::invalid_argument);
    CHECK_THROWS_AS(attention::CpuFlash<float>({0, 576, 192}), std::invalid_argument);
    const AttentionShape bad_gqa{3, 2, 32, 0.0};
    CHECK_THROWS_AS(flash.forward(bad_gqa, q.view(), k.view(), v.view(), good, o.view(), lse.view(), ws),
                    std::invalid_argument);
    // Outputs that share memory with an input, another output or the workspace.
    CHECK_THROWS_WITH_AS(flash.forward(shape, q.view(), k.view(), v.view(), good, q.view(), lse.view(), ws),
                         doctest::Contains("overlaps q"), std::invalid_argument);
    ThdTensor<float> dout(10, 4, 32);
    CHECK_THROWS_WITH_AS(flash.backward(shape, q.view(), k.view(), v.view(), o.view(), lse.view(), dout.view(), good,
                                        dout.view(), dk.view(), dv.view(), ws),
                         doctest::Contains("overlaps dout"), std::invalid_argument);
    std::vector<std::byte> ws_over_o(ws.size() + o.storage.size() * sizeof(float));
    ThdView<float> o_in_ws = ThdView<float>::dense(reinterpret_cast<float*>(ws_over_o.data()), 10, 4, 32);
    CHECK_THROWS_WITH_AS(
        flash.forward(shape, q.view(), k.view(), v.view(), good, o_in_ws, lse.view(), std::span<std::byte>(ws_over_o)),
        doctest::Contains("workspace = [0x"), std::invalid_argument);
    CHECK_NOTHROW(flash.forward(shape, q.view(), k.view(), v.view(), good, o.view(), lse.view(), ws));
  }
  TEST_CASE_TEMPLATE("CpuFlash keeps a NaN or infinity inside the rows and keys that read it", T, float, double,
                     attention::bf16) {
    check_nonfinite_isolation<T>(2);
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
    // double holds it
    const attention::CpuFlash<double> flash_d;
    ThdTensor<double> qd(4, 1, 8), kd(4, 1, 8), vd(4, 1, 8), od(4, 1, 8);
    LseTensor<double> lsed(1, 4);
    std::vector<std::byte> wsd(flash_d.workspace_bytes(AttentionShape{1, 1, 8, 1e30}, 4, 4));
    CHECK_NOTHROW(flash_d.forward(AttentionShape{1, 1, 8, 1e30}, qd.view(), kd.view(), vd.view(), sl, od.view(),
                                  lsed.view(), wsd));
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

  TEST_CASE("softmax_row: P within 3e-7 of exp2 in fp64, and the reference max moves only past 2^8") {
    // The online-softmax row step of the forward (the AVX2 or AVX-512 path where the build has it): its exp2
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
      const float alpha = attention::detail::softmax_row(row.data(), lo, hi, m, l);
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

  TEST_CASE("bf16 rounds to nearest even, keeps NaN and infinity, and the vector paths agree with the scalar one") {
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
    attention::detail::store_scaled(vec.data(), acc.data(), 37, 0.5f);
    for (int i = 0; i < 37; ++i) ref[static_cast<std::size_t>(i)] = bf16(acc[static_cast<std::size_t>(i)] * 0.5f);
    for (int i = 0; i < 37; ++i) {
      CAPTURE(i);
      const std::size_t u = static_cast<std::size_t>(i);
      CHECK((vec[u].bits == ref[u].bits || (std::isnan(float(vec[u])) && std::isnan(float(ref[u])))));
    }
    std::vector<float> wide(37);
    attention::detail::load_scaled(ref.data(), wide.data(), 37, 1.0f);
    for (int i = 0; i < 37; ++i) {
      const std::size_t u = static_cast<std::size_t>(i);
      CHECK((wide[u] == float(ref[u]) || std::isnan(wide[u])));
    }
  }
}
