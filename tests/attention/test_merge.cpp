// SPDX-License-Identifier: Apache-2.0
// merge_into: partial (O, LSE) over disjoint key sets combine to the result over their union.
// Tolerances relative to max|O| (floor 1): double 1e-12, float 1e-6 (the merge itself is a few flops).
#include <doctest/doctest.h>

#include <seqpar/attention/merge.hpp>
#include <seqpar/attention/reference.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

using namespace seqpar;

namespace {

template <class T>
struct Partial {
  ThdTensor<T> o;
  LseTensor<T> lse;
};

/// Attention of queries (nq rows) over keys [k0, k1) of k/v, causal with the diagonal at offset 0
/// in global key coordinates (query i sees keys j <= i + shift).
template <class T>
Partial<T> attend(const AttentionShape& shape, const ThdTensor<double>& q, const ThdTensor<double>& k,
                  const ThdTensor<double>& v, std::int64_t k0, std::int64_t k1, std::int64_t shift) {
  ThdTensor<double> o(q.tokens, shape.heads_q, shape.head_dim);
  LseTensor<double> lse(shape.heads_q, q.tokens);
  const std::vector<AttnSlice> s{{{0, q.tokens}, {0, k1 - k0}, Mask::causal(shift - k0)}};
  attention::Reference<double>{}.forward(shape, q.view(), k.view().tokens_slice(k0, k1 - k0),
                                         v.view().tokens_slice(k0, k1 - k0), s, o.view(), lse.view());
  Partial<T> p{ThdTensor<T>(q.tokens, shape.heads_q, shape.head_dim), LseTensor<T>(shape.heads_q, q.tokens)};
  for (std::size_t i = 0; i < o.storage.size(); ++i) p.o.storage[i] = T(o.storage[i]);
  for (std::size_t i = 0; i < lse.storage.size(); ++i) p.lse.storage[i] = T(lse.storage[i]);
  return p;
}

template <class T>
double diff(const Partial<T>& a, const Partial<T>& b) {
  double e = 0;
  for (std::size_t i = 0; i < a.o.storage.size(); ++i)
    e = std::max(e, std::abs(double(a.o.storage[i]) - double(b.o.storage[i])));
  for (std::size_t i = 0; i < a.lse.storage.size(); ++i) {
    const double x = a.lse.storage[i], y = b.lse.storage[i];
    if (std::isinf(x) || std::isinf(y))
      e = std::max(e, x == y ? 0.0 : 1e30);
    else
      e = std::max(e, std::abs(x - y));
  }
  return e;
}

}  // namespace

TEST_SUITE("attention") {
  TEST_CASE_TEMPLATE("merge_into is order independent and equals attention over the union", T, float, double) {
    const double tol = std::is_same_v<T, double> ? 1e-12 : 1e-6;
    const AttentionShape shape{4, 2, 16, 0.0};
    std::mt19937_64 rng(5);
    std::normal_distribution<double> dist(0.0, 2.0);
    ThdTensor<double> q(12, 4, 16), k(30, 2, 16), v(30, 2, 16);
    for (auto* t : {&q, &k, &v})
      for (double& x : t->storage) x = dist(rng);
    // queries sit at global positions 8..19: row i sees keys j <= i + 8. Key blocks [0,10), [10,20), [20,30):
    // the last block is invisible to the first rows (LSE = -inf there) and to all rows but the last ones.
    const std::int64_t shift = 8;
    const auto whole = attend<T>(shape, q, k, v, 0, 30, shift);
    const auto a = attend<T>(shape, q, k, v, 0, 10, shift);
    const auto b = attend<T>(shape, q, k, v, 10, 20, shift);
    const auto c = attend<T>(shape, q, k, v, 20, 30, shift);
    CHECK(std::isinf(c.lse.storage[0]));

    auto ab = a;
    attention::merge_into(ab.o.view(), ab.lse.view(), b.o.view(), b.lse.view());
    attention::merge_into(ab.o.view(), ab.lse.view(), c.o.view(), c.lse.view());
    auto cb = c;
    attention::merge_into(cb.o.view(), cb.lse.view(), b.o.view(), b.lse.view());
    attention::merge_into(cb.o.view(), cb.lse.view(), a.o.view(), a.lse.view());
    CHECK(diff(ab, whole) <= tol * 4);
    CHECK(diff(cb, whole) <= tol * 4);
    CHECK(diff(ab, cb) <= tol * 4);
  }

  TEST_CASE("merge_into keeps rows that are -inf on both sides at O = 0, LSE = -inf") {
    ThdTensor<float> o(3, 1, 4), p(3, 1, 4);
    LseTensor<float> lse(1, 3), lp(1, 3);
    const float ninf = -std::numeric_limits<float>::infinity();
    lse.storage = {ninf, ninf, 0.0f};
    lp.storage = {ninf, 1.0f, ninf};
    for (int x = 0; x < 4; ++x) {
      p.view()(1, 0, x) = 2.0f;
      p.view()(2, 0, x) = 7.0f;  // ignored: lse_part = -inf
      o.view()(2, 0, x) = 3.0f;
    }
    attention::merge_into(o.view(), lse.view(), p.view(), lp.view());
    CHECK(lse.storage[0] == ninf);
    CHECK(lse.storage[1] == 1.0f);
    CHECK(lse.storage[2] == 0.0f);
    for (int x = 0; x < 4; ++x) {
      CHECK(o.view()(0, 0, x) == 0.0f);
      CHECK(o.view()(1, 0, x) == 2.0f);
      CHECK(o.view()(2, 0, x) == 3.0f);
    }
    ThdTensor<float> bad(2, 1, 4);
    CHECK_THROWS_AS(attention::merge_into(o.view(), lse.view(), bad.view(), lp.view()), std::invalid_argument);
  }
}
