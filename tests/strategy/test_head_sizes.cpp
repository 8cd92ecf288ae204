// SPDX-License-Identifier: Apache-2.0
// Unequal query/key and value head sizes (AttentionShape::head_dim_v, MLA: 192/128, 576/512 absorbed)
// through every partitioner x communicator combination (tests/support/strategy_list.hpp) against the fp64
// reference, forward and backward, with the K and V pieces of their own sizes in the byte accounting; the
// reference itself against an oracle written out from the definition (test::detail::sink_reference with no
// sink); CpuFlash fp32 at 192/128 and bf16 through a few strategies; chunk by chunk (the carry holds K and V
// rows of their own sizes); and the refusals.
#include <doctest/doctest.h>

#include <seqpar/attention/cpu_flash.hpp>
#include <seqpar/schedule/dynamic_chunk.hpp>
#include <seqpar/seqpar.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "support/distributed_check.hpp"
#include "support/expect_error.hpp"
#include "support/strategy_list.hpp"

using namespace seqpar;

namespace {

constexpr double kHeadSizesTolerance = 1e-10;
constexpr int kQk = 24, kV = 16;  // small, unequal, not multiples of each other's panel count

AttentionShape mla_shape(int heads_q, int heads_kv) {
  AttentionShape s{heads_q, heads_kv, kQk};
  s.head_dim_v = kV;
  return s;
}

template <class Combination>
void check_head_sizes(Combination) {
  using S = typename Combination::strategy;
  const std::string name = Combination::name();
  typename S::Arguments args = Combination::arguments();
  int accepted = 0;
  for (const int world : {2, 3, 5, 8}) {
    std::mt19937 rng(static_cast<unsigned>(53 * world + name.size()));
    const DocumentBatch batch({test::lognormal_docs(60, 6.0, 1.0, rng), test::lognormal_docs(50, 9.0, 1.0, rng)});
    // Head counts every head-splitting communicator (Ulysses) can divide on this world; GQA on 2 and 8.
    const AttentionShape shape = world == 2 ? mla_shape(4, 2) : world == 8 ? mla_shape(16, 8) : mla_shape(world, world);
    args.ranks_per_node = world >= 4 ? world / 2 : world;
    for (const std::int64_t window : {std::int64_t{0}, std::int64_t{7}}) {
      const test::MaskedBatch b = test::windowed(batch, window);
      INFO(name << ": world " << world << ", window " << window << ", " << b.batch.documents().size() << " documents");
      if (!S::can_implement(args, b.batch, shape, Topology{world, args.ranks_per_node}, b.mask).ok) continue;
      ++accepted;
      const auto err = test::check_strategy<S, attention::Reference<double>>(b, shape, world, args, {}, 3 + world);
      CHECK(err.o < kHeadSizesTolerance);
      CHECK(err.lse < kHeadSizesTolerance);
      CHECK(err.dq < kHeadSizesTolerance);
      CHECK(err.dk < kHeadSizesTolerance);
      CHECK(err.dv < kHeadSizesTolerance);
      CHECK(err.bytes_match);  // K and V pieces counted at their own sizes, as the transport moved them
    }
  }
  MESSAGE(name << ": " << accepted << " runs");
  CHECK(accepted >= 4);
}

template <class Kernel, class S>
test::Errors run_kernel(const test::MaskedBatch& batch, const AttentionShape& shape, int world,
                        const typename S::Arguments& args = {}, const std::vector<double>& sinks = {}) {
  return test::check_attention<Kernel>(
      batch, shape, world,
      [&](backend::inproc::Transport& t) -> std::unique_ptr<runtime::AttentionEngine<Kernel>> {
        return std::make_unique<DistributedAttention<S, Kernel>>(t, shape, args);
      },
      17, sinks);
}

// f must throw std::invalid_argument whose message names every one of `parts`.
template <class F>
void expect_invalid(F&& f, const std::vector<std::string>& parts) {
  const std::string what = test::invalid_message(f);
  INFO(what);
  CHECK_FALSE(what.empty());
  for (const std::string& p : parts) CHECK(what.find(p) != std::string::npos);
}

using Ring = Strategy<partition::Zigzag, comm::Ring>;
using Ulysses = Strategy<partition::Uniform, comm::AllToAll>;
using Gather = Strategy<partition::PerDoc, comm::AllGather>;
using Hier = Strategy<partition::Hybrid, comm::Hierarchical<comm::AllToAll, comm::Ring>>;

}  // namespace

TEST_SUITE("strategy") {
  TEST_CASE("head sizes: Reference with d_qk != d_v equals attention written out row by row") {
    // sink_reference with every sink at -inf is plain attention from the definition (explicit softmax,
    // backward from the explicit probabilities): it shares no code with attention::Reference.
    std::mt19937 rng(4);
    const DocumentBatch batch({test::lognormal_docs(40, 8.0, 1.0, rng), {13, 1, 6}});
    const double ninf = -std::numeric_limits<double>::infinity();
    for (const std::int64_t window : {std::int64_t{0}, std::int64_t{5}}) {
      for (const AttentionShape& shape : {mla_shape(4, 2), mla_shape(2, 2)}) {
        const test::MaskedBatch b = test::windowed(batch, window);
        INFO("window " << window << ", heads " << shape.heads_q << "/" << shape.heads_kv);
        const std::vector<double> none(static_cast<std::size_t>(shape.heads_q), ninf);
        test::detail::WholeBatch oracle(b.batch, b.mask, shape, 9, std::type_identity<test::HostStorage>{},
                                        std::type_identity<double>{}, none);
        REQUIRE(oracle.o_ref.head_dim == kV);
        REQUIRE(oracle.dq_ref.head_dim == kQk);
        const attention::Reference<double> ref;
        const auto slices = test::detail::reference_slices(b.batch, b.mask);
        ref.forward(shape, oracle.q.view(), oracle.k.view(), oracle.v.view(), slices, oracle.o.view(),
                    oracle.lse.view());
        ref.backward(shape, oracle.q.view(), oracle.k.view(), oracle.v.view(), oracle.o.view(), oracle.lse.view(),
                     oracle.dout.view(), slices, oracle.dq.view(), oracle.dk.view(), oracle.dv.view());
        oracle.dsinks.push_back(oracle.dsinks_ref);  // no sink gradient to compare here
        test::Errors e;
        oracle.errors(e);
        CHECK(e.o < 1e-12);
        CHECK(e.lse < 1e-12);
        CHECK(e.dq < 1e-12);
        CHECK(e.dk < 1e-12);
        CHECK(e.dv < 1e-12);
      }
    }
  }

  TEST_CASE("head sizes: every strategy with d_qk 24, d_v 16 equals the fp64 reference, bytes as declared") {
    test::for_each_combination([](auto combination) { check_head_sizes(combination); });
  }

  TEST_CASE("head sizes: CpuFlash fp32 at 192/128 and bf16 through ring, Ulysses, all-gather and hierarchical") {
    std::mt19937 rng(8);
    const DocumentBatch batch({test::lognormal_docs(150, 20.0, 1.0, rng), {90, 3, 1}});
    AttentionShape shape{4, 2, 192};
    shape.head_dim_v = 128;
    Hier::Arguments hier;
    hier.ranks_per_node = 2;
    using F32 = attention::CpuFlash<float>;
    for (const test::Errors& e :
         {run_kernel<F32, Ring>(batch, shape, 4), run_kernel<F32, Ulysses>(batch, shape, 2),
          run_kernel<F32, Gather>(test::windowed(batch, 16), shape, 3), run_kernel<F32, Hier>(batch, shape, 4, hier)}) {
      CHECK(e.o < 1e-5);
      CHECK(e.lse < 1e-5);
      CHECK(e.dq < 1e-4);
      CHECK(e.dk < 1e-4);
      CHECK(e.dv < 1e-4);
      CHECK(e.bytes_match);
    }
    // bf16 storage: the tolerances of tests/strategy/test_bf16.cpp (1e-2 forward, 2e-2 backward), with a
    // sink on one run (the epilogue rescales rows of d_v values).
    using B16 = attention::CpuFlash<attention::bf16>;
    const std::vector<double> sinks{1.0, -0.5, 0.25, -std::numeric_limits<double>::infinity()};
    for (const test::Errors& e : {run_kernel<B16, Ring>(batch, shape, 4), run_kernel<B16, Ulysses>(batch, shape, 2),
                                  run_kernel<B16, Hier>(test::windowed(batch, 9), shape, 4, hier, sinks)}) {
      CHECK(e.o < 1e-2);
      CHECK(e.lse < 1e-2);
      CHECK(e.dq < 2e-2);
      CHECK(e.dk < 2e-2);
      CHECK(e.dv < 2e-2);
      CHECK(e.dsinks < 2e-2);
      CHECK(e.bytes_match);
    }
  }

  TEST_CASE("head sizes: 576/512 (MLA's absorbed form) with CpuFlash fp32 through the ring") {
    const DocumentBatch batch({{40, 9, 23}});
    AttentionShape shape{2, 1, 576};
    shape.head_dim_v = 512;
    const auto e = run_kernel<attention::CpuFlash<float>, Ring>(batch, shape, 3);
    CHECK(e.o < 1e-5);
    CHECK(e.lse < 1e-5);
    CHECK(e.dq < 1e-4);
    CHECK(e.dk < 1e-4);
    CHECK(e.dv < 1e-4);
    CHECK(e.bytes_match);
  }

  TEST_CASE("head sizes: chunk by chunk, the carry holds K and V rows of their own sizes") {
    std::mt19937 rng(9);
    const DocumentBatch batch({{70, 5, 1, 20}, test::lognormal_docs(50, 8.0, 1.0, rng)});
    const AttentionShape shape = mla_shape(4, 2);
    const auto chunks = schedule::DynamicChunk{{.token_capacity = 32}}.chunks(batch);
    REQUIRE(chunks.size() >= 4);
    using Kernel = attention::Reference<double>;
    const auto err = test::distributed_check<Kernel>(
        batch, chunks, test::forward_then_backward(chunks.size()), shape, 4,
        [&](backend::inproc::Transport& t) -> std::unique_ptr<runtime::AttentionEngine<Kernel>> {
          return std::make_unique<DistributedAttention<Ring, Kernel>>(t, shape);
        },
        13);
    CHECK(err.max() < kHeadSizesTolerance);
    CHECK(err.bytes_match);
  }

  TEST_CASE("head sizes: the byte accounting counts V-sized pieces at d_v") {
    // The same batch and plan with d_v = d_qk and d_v < d_qk: the ring moves K and V blocks forward, so the
    // bytes drop by exactly the V share, heads_kv * (d_qk - d_v) values per moved token.
    const DocumentBatch batch({{64, 32}});
    const AttentionShape equal{2, 2, kQk};
    const AttentionShape split = mla_shape(2, 2);
    using S = Strategy<partition::Zigzag, comm::Ring>;
    const auto a = test::check_strategy<S, attention::Reference<double>>(batch, equal, 4);
    const auto b = test::check_strategy<S, attention::Reference<double>>(batch, split, 4);
    REQUIRE(a.bytes_match);
    REQUIRE(b.bytes_match);
    // Forward: K and V of the same tokens, so bytes scale by (d_qk + d_v) / (2 d_qk).
    CHECK(a.bytes_forward * (kQk + kV) == b.bytes_forward * 2 * kQk);
    CHECK(b.bytes_backward < a.bytes_backward);
  }

  TEST_CASE("head sizes: bad head_dim_v, views of the wrong size and kernels of one size are refused by name") {
    AttentionShape bad{2, 2, 16};
    bad.head_dim_v = -1;
    expect_invalid([&] { bad.validate(); }, {"head_dim_v", "-1"});
    bad.head_dim_v = 2048;
    expect_invalid([&] { bad.validate(); }, {"head_dim_v", "2048"});
    CHECK_FALSE(attention::Reference<double>{}.can_implement(bad));
    CHECK(AttentionShape{2, 2, 16}.v_dim() == 16);  // 0: the same as head_dim
    CHECK(mla_shape(2, 2).v_dim() == kV);
    CHECK(mla_shape(2, 2).qk_dim() == kQk);

    // A view sized for the other head size is refused by the engine, naming it.
    const DocumentBatch batch({{12, 4}});
    const AttentionShape shape = mla_shape(2, 2);
    backend::inproc::World(1).run([&](backend::inproc::Transport& t) {
      DistributedAttention<Ring, attention::Reference<double>> attn(t, shape);
      const std::int64_t n = attn.local_tokens(batch);
      ThdTensor<double> q(n, 2, kQk), k(n, 2, kQk), v_wrong(n, 2, kQk), o(n, 2, kV);
      LseTensor<double> lse(2, n);
      expect_invalid([&] { attn.forward(batch, q.view(), k.view(), v_wrong.view(), o.view(), lse.view()); },
                     {"v.head_dim", std::to_string(kQk)});
    });
  }
}
