// SPDX-License-Identifier: Apache-2.0
// Non-finite values through the strategies: a NaN or an Inf planted in one token of one document of
// q, k, v or dout must leave every other document's O, LSE, dQ, dK and dV exactly as without it, on
// every communicator (ring merges, all-to-all, all-gather, hierarchical) -- documents are
// independent. The first case runs the fp64 reference kernel, so it isolates what the strategies, the
// LSE merge and the data ops do; the second runs CpuFlash (its tiles mix documents, so a 0 x NaN
// there would leak) through the same strategies. CpuFlash alone is tested in tests/attention.
#include <doctest/doctest.h>

#include "adversarial/harness.hpp"

#include <cmath>
#include <limits>
#include <random>

using namespace seqpar;
using namespace seqpar::test;

namespace {

using ZigzagRing = Strategy<partition::Zigzag, comm::Ring>;
using Ulysses = Strategy<partition::Uniform, comm::AllToAll>;
using PerDocGather = Strategy<partition::PerDoc, comm::AllGather>;
using WholeDocRing = Strategy<partition::WholeDoc, comm::Ring>;
using Usp = Strategy<partition::BatchAware<partition::Uniform>, comm::Hierarchical<comm::AllToAll, comm::Ring>>;

// Plants `value` in each input tensor in turn (one element of document `doc`) and checks that every
// row of every other document matches the clean run.
template <class Kernel>
void check_isolation(const char* name, const FactoryOf<Kernel>& make, int world) {
  const AttentionShape shape{4, 2, 8};
  const DocumentBatch batch({{11, 17, 6}, {14, 9}});
  const Range poisoned = batch.documents()[1].tokens;  // the second document of sequence 0
  Global clean(batch.total_tokens(), shape);
  std::mt19937 rng(11);
  std::normal_distribution<double> normal;
  for (auto* t : {&clean.q, &clean.k, &clean.v, &clean.dout})
    for (double& x : t->storage) x = normal(rng);
  reference(batch, shape, clean);
  const double values[] = {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(),
                           -std::numeric_limits<double>::infinity()};
  for (int tensor = 0; tensor < 4; ++tensor)
    for (double value : values)
      for (std::int64_t token : {poisoned.begin, poisoned.begin + 7, poisoned.end - 1}) {
        Global g = clean;
        ThdTensor<double>* const inputs[] = {&g.q, &g.k, &g.v, &g.dout};
        inputs[tensor]->view()(token, 1, 3) = value;
        distributed(batch, shape, world, make, g);
        INFO(name << ": tensor "
                  << "qkvd"[tensor] << " token " << token << " = " << value);
        bool same = true, poisoned_seen = false;
        const auto compare = [&](const ThdTensor<double>& got, const ThdTensor<double>& want) {
          for (std::int64_t t = 0; t < batch.total_tokens(); ++t)
            for (int h = 0; h < got.heads; ++h)
              for (int x = 0; x < got.head_dim; ++x) {
                const double a = got.view()(t, h, x), b = want.view()(t, h, x);
                if (poisoned.contains(t)) {
                  poisoned_seen = poisoned_seen || !std::isfinite(a);
                  continue;
                }
                same = same && std::isfinite(a) && std::abs(a - b) <= 1e-11 * (1 + std::abs(b));
              }
        };
        compare(g.o, clean.o), compare(g.dq, clean.dq), compare(g.dk, clean.dk), compare(g.dv, clean.dv);
        for (int h = 0; h < shape.heads_q; ++h)
          for (std::int64_t t = 0; t < batch.total_tokens(); ++t)
            if (!poisoned.contains(t))
              same = same && std::abs(g.lse.view()(h, t) - clean.lse.view()(h, t)) <=
                                 1e-11 * (1 + std::abs(clean.lse.view()(h, t)));
        CHECK(same);
        // A NaN reaches its own document (the test plants where it is read); an infinity may cancel
        // out (a -inf score is a zero weight).
        CHECK((poisoned_seen || !std::isnan(value)));
      }
}

}  // namespace

TEST_SUITE("adversarial") {
  TEST_CASE("non-finite: a NaN or Inf stays inside its document on every communicator") {
    const AttentionShape shape{4, 2, 8};
    check_isolation("Zigzag x Ring", factory<ZigzagRing>(shape), 3);
    ZigzagRing::Arguments aware;
    aware.comm.sharding_aware = true;
    check_isolation("Zigzag x Ring(sharding-aware)", factory<ZigzagRing>(shape, aware), 4);
    check_isolation("Uniform x AllToAll", factory<Ulysses>(shape), 2);
    check_isolation("PerDoc x AllGather", factory<PerDocGather>(shape), 3);
    WholeDocRing::Arguments whole;
    whole.partition.capacity_factor = 2.0;
    check_isolation("WholeDoc x Ring", factory<WholeDocRing>(shape, whole), 2);
    check_isolation("BatchAware<Uniform> x Hierarchical", factory<Usp>(shape), 4);
  }

  TEST_CASE("non-finite: a NaN or Inf stays inside its document with CpuFlash as the kernel") {
    using Flash = attention::CpuFlash<double>;
    const AttentionShape shape{4, 2, 8};
    ZigzagRing::Arguments aware;
    aware.comm.sharding_aware = true;
    check_isolation("Zigzag x Ring(sharding-aware), CpuFlash", factory<ZigzagRing, Flash>(shape, aware), 4);
    check_isolation("Uniform x AllToAll, CpuFlash", factory<Ulysses, Flash>(shape), 2);
    check_isolation("BatchAware<Uniform> x Hierarchical, CpuFlash", factory<Usp, Flash>(shape), 4);
  }

  TEST_CASE("non-finite: the LSE merge never lets a fully masked partial in") {
    // A partial with LSE = -inf (no visible key) contributes nothing whatever its O holds, and a
    // running result with LSE = -inf is replaced, not weighted (0 x NaN would be NaN).
    constexpr double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
    ThdTensor<double> o(2, 1, 4), part(2, 1, 4);
    LseTensor<double> lse(1, 2), lse_part(1, 2);
    for (int x = 0; x < 4; ++x) {
      o.view()(0, 0, x) = 1.0 + x;
      part.view()(0, 0, x) = nan;  // row 0: masked partial full of NaN
      o.view()(1, 0, x) = nan;     // row 1: masked running result full of NaN
      part.view()(1, 0, x) = 2.0 - x;
    }
    lse.view()(0, 0) = 0.5, lse_part.view()(0, 0) = -inf;
    lse.view()(0, 1) = -inf, lse_part.view()(0, 1) = 0.25;
    attention::merge_into(o.view(), lse.view(), part.view(), lse_part.view());
    for (int x = 0; x < 4; ++x) {
      CHECK(o.view()(0, 0, x) == 1.0 + x);
      CHECK(o.view()(1, 0, x) == 2.0 - x);
    }
    CHECK(lse.view()(0, 0) == 0.5);
    CHECK(lse.view()(0, 1) == 0.25);
    // Both masked: the row stays empty (LSE -inf), never NaN.
    LseTensor<double> both(1, 2), both_part(1, 2);
    ThdTensor<double> zero(2, 1, 4), zero_part(2, 1, 4);
    for (auto* l : {&both, &both_part}) l->storage.assign(2, -inf);
    attention::merge_into(zero.view(), both.view(), zero_part.view(), both_part.view());
    for (double x : zero.storage) CHECK(x == 0.0);
    for (double x : both.storage) CHECK(x == -inf);
  }
}
