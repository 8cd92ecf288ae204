// SPDX-License-Identifier: Apache-2.0
// The fp64 oracle itself: closed-form cases and a central finite-difference gradient check; and
// Reference<float> (fp32 storage, fp64 inside: 1e-6 forward, 5e-6 backward, the GQA sums rounded per head)
// on the shared kernel conformance cases.
// Tolerance: finite differences with step 1e-5 in fp64 are accurate to ~1e-9; we require 1e-7 absolute.
#include <doctest/doctest.h>

#include <seqpar/attention/reference.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <stdexcept>
#include <vector>

#include "support/kernel_cases.hpp"

using namespace seqpar;

namespace {

void fill(ThdTensor<double>& t, std::mt19937_64& rng) {
  std::normal_distribution<double> dist(0.0, 1.0);
  for (double& x : t.storage) x = dist(rng);
}

// L = sum(O * W): dL/dO = W.
double loss(const AttentionShape& shape, const ThdTensor<double>& q, const ThdTensor<double>& k,
            const ThdTensor<double>& v, const std::vector<AttnSlice>& slices, const ThdTensor<double>& w) {
  ThdTensor<double> o(q.tokens, shape.heads_q, shape.head_dim);
  LseTensor<double> lse(shape.heads_q, q.tokens);
  attention::Reference<double>{}.forward(shape, q.view(), k.view(), v.view(), slices, o.view(), lse.view());
  double l = 0;
  for (std::size_t i = 0; i < o.storage.size(); ++i) l += o.storage[i] * w.storage[i];
  return l;
}

}  // namespace

TEST_SUITE("attention") {
  TEST_CASE("Reference: one visible key gives O = V and LSE = score") {
    const AttentionShape shape{1, 1, 2, 1.0};
    ThdTensor<double> q(1, 1, 2), k(1, 1, 2), v(1, 1, 2), o(1, 1, 2);
    q.storage = {1.0, 2.0};
    k.storage = {0.5, -1.0};
    v.storage = {3.0, 4.0};
    LseTensor<double> lse(1, 1);
    const std::vector<AttnSlice> s{{{0, 1}, {0, 1}, Mask::causal()}};
    attention::Reference<double>{}.forward(shape, q.view(), k.view(), v.view(), s, o.view(), lse.view());
    CHECK(o.storage[0] == 3.0);
    CHECK(o.storage[1] == 4.0);
    CHECK(lse.storage[0] == doctest::Approx(-1.5));
    // a fully masked row: O = 0, LSE = -inf
    const std::vector<AttnSlice> masked{{{0, 1}, {0, 1}, Mask::causal(-1)}};
    attention::Reference<double>{}.forward(shape, q.view(), k.view(), v.view(), masked, o.view(), lse.view());
    CHECK(o.storage[0] == 0.0);
    CHECK(lse.storage[0] == -std::numeric_limits<double>::infinity());
  }

  TEST_CASE("Reference refuses outputs that alias an input, as the flash kernels do") {
    const AttentionShape shape{1, 1, 2, 1.0};
    ThdTensor<double> q(3, 1, 2), k(3, 1, 2), v(3, 1, 2), o(3, 1, 2), dq(3, 1, 2), dk(3, 1, 2), dout(3, 1, 2);
    LseTensor<double> lse(1, 3);
    const std::vector<AttnSlice> s{{{0, 3}, {0, 3}, Mask::causal()}};
    const attention::Reference<double> ref;
    // o over v: rows of o written while later rows still read v
    CHECK_THROWS_AS(ref.forward(shape, q.view(), k.view(), v.view(), s, v.view(), lse.view()), std::invalid_argument);
    ref.forward(shape, q.view(), k.view(), v.view(), s, o.view(), lse.view());
    // dv over dq
    CHECK_THROWS_AS(ref.backward(shape, q.view(), k.view(), v.view(), o.view(), lse.view(), dout.view(), s, dq.view(),
                                 dk.view(), dq.view()),
                    std::invalid_argument);
  }

  TEST_CASE("Reference backward matches central finite differences (fp64)") {
    const AttentionShape shape{4, 2, 3, 0.0};
    const std::int64_t nq = 5, nk = 7;
    std::mt19937_64 rng(99);
    ThdTensor<double> q(nq, 4, 3), k(nk, 2, 3), v(nk, 2, 3), w(nq, 4, 3);
    for (auto* t : {&q, &k, &v, &w}) fill(*t, rng);
    for (const std::vector<AttnSlice>& slices :
         {std::vector<AttnSlice>{{{0, nq}, {0, nk}, Mask::causal(2)}},
          std::vector<AttnSlice>{{{0, 2}, {0, 3}, Mask::full()}, {{2, nq}, {1, nk}, Mask::sliding_window(3, 2)}}}) {
      ThdTensor<double> o(nq, 4, 3), dq(nq, 4, 3), dk(nk, 2, 3), dv(nk, 2, 3);
      LseTensor<double> lse(4, nq);
      const attention::Reference<double> ref;
      ref.forward(shape, q.view(), k.view(), v.view(), slices, o.view(), lse.view());
      ref.backward(shape, q.view(), k.view(), v.view(), o.view(), lse.view(), w.view(), slices, dq.view(), dk.view(),
                   dv.view());
      const double eps = 1e-5;
      auto check_grad = [&](ThdTensor<double>& x, const ThdTensor<double>& g) {
        for (std::size_t i = 0; i < x.storage.size(); ++i) {
          const double keep = x.storage[i];
          x.storage[i] = keep + eps;
          const double up = loss(shape, q, k, v, slices, w);
          x.storage[i] = keep - eps;
          const double down = loss(shape, q, k, v, slices, w);
          x.storage[i] = keep;
          CHECK(std::abs(g.storage[i] - (up - down) / (2 * eps)) <= 1e-7);
        }
      };
      check_grad(q, dq);
      check_grad(k, dk);
      check_grad(v, dv);
    }
  }

  TEST_CASE("Reference<float>: the kernel conformance cases, isolation and refusals") {
    namespace kc = test::kernel_cases;
    using Harness = kc::HostHarness<attention::Reference<float>>;
    attention::Reference<float> ref;
    kc::run_cases<Harness>(ref, {1e-6, 5e-6});
    kc::check_nonfinite_isolation<Harness>(ref, kc::Isolation::kMask, 1);
    kc::check_refusals<Harness>(ref);
  }
}
